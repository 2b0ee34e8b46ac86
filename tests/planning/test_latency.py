import numpy as np
import pytest

from kubemoe.planning.latency import (H200_MIXTRAL_EXPERT_S, MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN, ExpertCurve,
                                      LatencyModel, held_byte_seconds)

CURVE = ExpertCurve(MIXTRAL_EXPERT_BYTES, MIXTRAL_FLOPS_PER_TOKEN)


def test_mixtral_curve_is_flat_to_the_knee_then_flop_bound():
    assert CURVE.seconds([1, 64])[1] == pytest.approx(H200_MIXTRAL_EXPERT_S) == CURVE.seconds(1)
    assert 150 < CURVE.knee_tokens < 400  # "a few hundred tokens"
    assert CURVE.seconds(4 * CURVE.knee_tokens) == pytest.approx(4 * H200_MIXTRAL_EXPERT_S, rel=0.02)
    assert CURVE.seconds(0) == 0.0


def test_layer_time_is_the_slowest_gpu_and_replicas_on_one_gpu_queue():
    model = LatencyModel(CURVE, token_bytes=0, call_overhead_s=1e-3)
    # Two replicas on GPU 5, one on GPU 9; T = 2 iterations.
    tokens = np.array([[10, 10, 10], [0, 0, 10]])
    seconds = model.layer_seconds([5, 5, 9], tokens)
    assert seconds == pytest.approx([1e-3 + 2 * H200_MIXTRAL_EXPERT_S, 1e-3 + H200_MIXTRAL_EXPERT_S])
    assert model.busy_byte_seconds(tokens)[1] == pytest.approx(MIXTRAL_EXPERT_BYTES * (1e-3 + H200_MIXTRAL_EXPERT_S))
    assert held_byte_seconds(6, [1.0, 2.0]).tolist() == [6.0, 12.0]
    with_wire = LatencyModel(CURVE, token_bytes=8192)
    assert with_wire.beta_s_per_token == pytest.approx(2 * 8192 / 23e9)


def test_wire_cost_puts_a_gpus_time_in_tokens_of_ffn_time_as_the_placer_queues_it():
    model = LatencyModel(CURVE, token_bytes=4096 * 2)
    assert model.wire_cost == pytest.approx(1.21, abs=0.01)  # Mixtral on the H200: the copies outweigh the FLOPs
    per_token = CURVE.flops_per_token / CURVE.flops_per_s
    knee = CURVE.weight_read_s / per_token
    tokens = np.array([[3, 150, 220, 900, 0]])
    [[busy]] = model.gpu_seconds([0] * 5, tokens, 1) - model.call_overhead_s
    queued = sum(max(knee, t) + model.wire_cost * t for t in tokens[0] if t > 0)
    assert busy == pytest.approx(queued * per_token)
