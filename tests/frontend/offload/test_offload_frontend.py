"""A frontend in offload mode, on the CPU stand-in device with a budget smaller than the experts: the same
logits as transformers for every architecture, its counts at /metrics and /loads, bad settings refused."""

import asyncio

import pytest
import torch
from prometheus_client import generate_latest
from transformers import AutoModelForCausalLM

from kubemoe.adapters import MoEAdapter, arch_names
from kubemoe.errors import KubemoeError
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.offload.config import OffloadConfig
from kubemoe.frontend.offload.llapor import LayerArch, LLaPor
from kubemoe.verify import rel_err

IDS = torch.tensor([[5, 17, 33, 80, 12, 9, 100, 7, 3], [44, 2, 7, 8, 9, 10, 11, 1, 2]])


def offload_frontend(path, resident=3, device="cpu", **offload) -> Frontend:
    """Room for `resident` experts beside the working set: far fewer than the model has."""
    adapter = MoEAdapter.from_checkpoint(path)
    expert_bytes = adapter.expert_bytes(torch.float32)
    budget = (2 + 2 * adapter.top_k + resident) * expert_bytes
    assert budget < len(adapter.moe_layers) * adapter.num_experts * expert_bytes
    return Frontend(FrontendConfig(checkpoint=path, device=device,
                                   offload=OffloadConfig(budget, **{"predictor": "router", **offload})))


def check_logits(path, device):
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    fe = offload_frontend(path, device=device)
    try:
        assert fe.ready  # no routing table needed: every expert runs here
        fe.dispatcher.apply_pending()
        with torch.no_grad():
            assert rel_err(fe.model(IDS.to(device)).logits.cpu(), reference(IDS).logits) < 1e-4
        s = fe.offload.stats
        assert s.activated == s.hits + s.loaded + s.cpu_experts and s.hits < s.activated  # most experts were not resident
        assert fe.offload.store.pinned == (device == "cuda")
    finally:
        fe.close()


@pytest.mark.parametrize("arch", arch_names())
def test_offload_logits_match_transformers(arch, tiny_checkpoint):
    check_logits(tiny_checkpoint(arch), "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", arch_names())
def test_offload_logits_match_transformers_on_the_gpu(arch, tiny_checkpoint):
    check_logits(tiny_checkpoint(arch), "cuda")


def test_offload_generation_matches_transformers_greedy(tiny_checkpoint):
    from tests.frontend.test_correctness import PROMPTS, generate_all, reference_greedy

    path = tiny_checkpoint("mixtral")
    fe = offload_frontend(path, policy="hybrimoe-like")
    fe.engine.eos_ids = set()
    try:
        ours = asyncio.run(generate_all(fe, PROMPTS))
    finally:
        fe.close()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert ours == reference_greedy(reference, PROMPTS)


def test_offload_counts_reach_metrics_loads_and_readyz(tiny_checkpoint):
    fe = offload_frontend(tiny_checkpoint("qwen3_moe"))
    try:
        fe.dispatcher.apply_pending()
        with torch.no_grad():
            fe.model(IDS)
        s = fe.offload.stats
        report = fe.loads.report().offload
        assert (report.policy, report.activated, report.hits, report.loaded, report.bytes_copied, report.cpu_tokens) == \
            ("kubemoe", s.activated, s.hits, s.loaded, s.bytes_copied, s.cpu_tokens)
        assert report.hit_rate == pytest.approx(s.hit_rate) and report.cpu_share == pytest.approx(s.cpu_share)
        text = generate_latest(fe.metrics.registry).decode()
        work = f'kubemoe_offload_expert_tokens_total{{deployment="{fe.model_id}",side="gpu"}} {float(s.gpu_tokens)}'
        assert work in text and "kubemoe_offload_experts_total" in text and "kubemoe_offload_copied_bytes_total" in text
        seconds = fe.offload.seconds
        for phase in ("layers", "decide", "cpu_wait"):
            sample = fe.metrics.registry.get_sample_value("kubemoe_offload_host_seconds_total",
                                                          {"deployment": fe.model_id, "phase": phase})
            assert sample == pytest.approx(getattr(seconds, phase))
        assert 0 < seconds.decide < seconds.layers  # the decisions are part of the layers' time
        assert fe.readiness()["offload"]["policy"] == "kubemoe"
    finally:
        fe.close()


def test_a_distributed_frontend_reports_no_offload_counts(make_frontend):
    assert not make_frontend().loads.report().HasField("offload")


def test_an_llapor_predictor_of_another_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    other = ModelShape.of(MoEAdapter.from_checkpoint(tiny_checkpoint("qwen3_moe")))
    path = LLaPor.build(other, {s: LayerArch("middle", 8, 16, 0, 0.0) for s in other.moe_layers[:-1]}).save(
        tmp_path / "llapor.safetensors")
    with pytest.raises(KubemoeError, match="belongs to another model.*kubemoe predictor train --kind llapor"):
        offload_frontend(tiny_checkpoint("mixtral"), predictor=str(path))


def llapor_file(checkpoint, path):
    shape = ModelShape.of(MoEAdapter.from_checkpoint(checkpoint))
    return LLaPor.build(shape, {s: LayerArch("middle", 8, 16, 0, 0.0) for s in shape.moe_layers[:-1]}).save(path)


def test_an_llapor_predictor_of_this_checkpoint_feeds_the_scheduler(tiny_checkpoint, tmp_path, caplog):
    path = tiny_checkpoint("mixtral")
    file = llapor_file(path, tmp_path / "llapor.safetensors")
    with caplog.at_level("INFO", logger="kubemoe.frontend.offload.lookahead"):
        fe = offload_frontend(path, predictor=str(file), policy="gpu-prefetch")  # prefetches whatever is predicted
    try:
        assert fe.offload.lookahead.name == "llapor"
        # Which predictor serves, and from where, in the log and at /readyz.
        assert f"offload predictor: llapor, the file {file}, trained for mixtral" in caplog.text
        assert fe.readiness()["offload"]["lookahead_source"].startswith(f"the file {file}")
        fe.dispatcher.apply_pending()
        with torch.no_grad():
            fe.model(IDS)
        assert fe.offload.stats.prefetched > 0
    finally:
        fe.close()


def test_llapor_reads_the_file_in_the_checkpoint_folder_else_says_it_reuses_the_router(tiny_checkpoint, tmp_path,
                                                                                      caplog):
    import shutil

    from kubemoe.offload_env import LLAPOR_FILE

    checkpoint = shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "mixtral")
    with caplog.at_level("INFO", logger="kubemoe.frontend.offload.lookahead"):
        fe = offload_frontend(checkpoint, predictor="llapor")
    fe.close()
    assert fe.offload.lookahead.name == "router" and f"no LLaPor predictor at {checkpoint / LLAPOR_FILE}" in caplog.text
    assert "offload predictor: router, the next MoE layer's router" in caplog.text
    llapor_file(checkpoint, checkpoint / LLAPOR_FILE)
    fe = offload_frontend(checkpoint, predictor="llapor")
    fe.close()
    assert fe.offload.lookahead.name == "llapor" and str(checkpoint / LLAPOR_FILE) in fe.offload.lookahead.source


def test_a_named_predictor_file_that_is_missing_stops_the_start(tiny_checkpoint, tmp_path):
    with pytest.raises(KubemoeError, match="no LLaPor file at .*missing.safetensors.*kubemoe predictor train"):
        offload_frontend(tiny_checkpoint("mixtral"), predictor=str(tmp_path / "missing.safetensors"))
