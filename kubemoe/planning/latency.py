"""MoEless's latency and cost model, with each replica's time from the H200's measured expert curve.

A layer's MoE forward takes as long as its slowest GPU. A GPU's time in a layer is the fixed cost of
the calls it serves (they are issued together, so their fixed costs overlap: counted once), plus
its replicas' FFN times one after another (kernels on one GPU queue), plus beta per token it
receives and returns. A replica's FFN time follows `ExpertCurve`: reading the expert's weights
bounds it up to the knee (a few hundred tokens), FLOPs beyond. Cost is GPU memory x time.
Shapes: T = iterations, R = replicas of one layer, G = GPUs, E = experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Mixtral-8x7B's expert: gate, up and down of 4096 x 14336, bfloat16.
MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2
MIXTRAL_FLOPS_PER_TOKEN = 2 * 3 * 4096 * 14336
# Measured on the H200 host: one Mixtral expert takes 0.13 ms for any count from 1 to 64 tokens,
# i.e. it streams its 336 MiB of weights at about 2.7 TB/s (57% of the H200's 4.8 TB/s).
H200_MIXTRAL_EXPERT_S = 0.13e-3
H200_WEIGHT_BYTES_PER_S = MIXTRAL_EXPERT_BYTES / H200_MIXTRAL_EXPERT_S
# Achieved dense bf16 FLOP/s at large token counts: an assumption (~60% of the H200's 989 TFLOP/s
# peak) until the curve beyond 64 tokens is measured; it puts the Mixtral knee at ~220 tokens.
H200_ACHIEVED_FLOPS = 6.0e14
# Per-call overhead of an expert function through shared memory and the lane on the H200 host
# (benchmarks/results/expert_fn_h200.json: round trip minus the FFN, median of eight runs).
H200_CALL_OVERHEAD_S = 0.25e-3
# Host-to-GPU copy rate of a call's hidden states measured on the H200 host (512 KiB at ~23 GB/s).
H200_COPY_BYTES_PER_S = 23e9


@dataclass(frozen=True)
class ExpertCurve:
    """FFN time of one expert replica against its tokens on one GPU."""

    weight_bytes: int
    flops_per_token: float
    weight_bytes_per_s: float = H200_WEIGHT_BYTES_PER_S
    flops_per_s: float = H200_ACHIEVED_FLOPS

    @classmethod
    def of_weights(cls, weight_bytes: int, dtype_bytes: int) -> "ExpertCurve":
        """An expert that uses each of its weights once per token (2 FLOPs a weight, `dtype_bytes` each):
        its knee depends on the dtype alone (~220 tokens in bfloat16 on the H200)."""
        return cls(weight_bytes, 2 * weight_bytes / dtype_bytes)

    @property
    def weight_read_s(self) -> float:
        return self.weight_bytes / self.weight_bytes_per_s

    @property
    def knee_tokens(self) -> int:
        """Tokens below which the FFN costs one weight read whatever the count."""
        return max(1, math.floor(self.weight_read_s * self.flops_per_s / self.flops_per_token))

    def seconds(self, tokens):
        """tokens (any shape) -> seconds, 0 where a replica gets no token."""
        tokens = np.asarray(tokens, dtype=np.float64)
        busy = np.maximum(self.weight_read_s, tokens * (self.flops_per_token / self.flops_per_s))
        return np.where(tokens > 0, busy, 0.0)


def min_replica_load(weight_bytes: int, dtype_bytes: int, calls_per_second: float, experts: int = 1) -> float:
    """The least load (tokens/s) worth a replica of `experts` experts of `weight_bytes` each: the curve's
    knee per call, where a replica's part stops costing a whole read of its weights (a replica for less
    costs a GPU what one for the knee costs; the simulator's scaler and split use this knee, the
    frontend's split its own --split-min-tokens, 64 by default, the curve's measured flat region), times
    the calls a second (the frontends' forward passes, each one call per MoE layer). 0 when the calls
    are not known (0): then every part counts, as a scaler without a knee counts them."""
    return ExpertCurve.of_weights(weight_bytes, dtype_bytes).knee_tokens * experts * calls_per_second


@dataclass(frozen=True)
class LatencyModel:
    curve: ExpertCurve
    token_bytes: int                                   # one token's hidden state on the wire
    call_overhead_s: float = H200_CALL_OVERHEAD_S
    copy_bytes_per_s: float = H200_COPY_BYTES_PER_S

    @property
    def beta_s_per_token(self) -> float:
        return 2 * self.token_bytes / self.copy_bytes_per_s  # there and back

    @property
    def wire_cost(self) -> float:
        """A token's copies as a fraction of its FFN time above the knee (the placer's `wire_cost`):
        a GPU's time in a layer, less the call's fixed cost, is sum_r(max(knee, t_r) + wire_cost x t_r)
        tokens of FFN time. 1.2 for a Mixtral expert on the H200: below the knee the wire is all
        that tokens cost."""
        return self.beta_s_per_token * self.curve.flops_per_s / self.curve.flops_per_token

    def replica_seconds(self, replica_tokens):
        """A replica's own time for its tokens (FFN, wire, its call's fixed cost); 0 without tokens. Any shape."""
        tokens = np.asarray(replica_tokens, dtype=np.float64)
        return np.where(tokens > 0, self.curve.seconds(tokens) + self.beta_s_per_token * tokens + self.call_overhead_s, 0.0)

    def gpu_seconds(self, replica_gpu, replica_tokens, num_gpus: int):
        """replica_gpu [R] (GPU index of each replica), replica_tokens [T, R] -> per-GPU time [T, G]."""
        replica_gpu = np.asarray(replica_gpu, dtype=np.int64)
        tokens = np.asarray(replica_tokens, dtype=np.float64).reshape(-1, len(replica_gpu))
        onehot = np.zeros((len(replica_gpu), num_gpus))
        onehot[np.arange(len(replica_gpu)), replica_gpu] = 1.0
        work = (self.curve.seconds(tokens) + self.beta_s_per_token * tokens) @ onehot
        return work + np.where(tokens @ onehot > 0, self.call_overhead_s, 0.0)

    def layer_seconds(self, replica_gpu, replica_tokens):
        """replica_gpu [R], replica_tokens [T, R] -> the layer's MoE forward time [T] (its slowest GPU)."""
        replica_gpu = np.asarray(replica_gpu, dtype=np.int64)
        if replica_gpu.size == 0:
            return np.zeros(np.asarray(replica_tokens).reshape(-1, 0).shape[0])
        _, compact = np.unique(replica_gpu, return_inverse=True)  # only the GPUs this layer uses
        return self.gpu_seconds(compact, replica_tokens, int(compact.max()) + 1).max(axis=1)

    def busy_byte_seconds(self, replica_tokens):
        """Pay-per-use (serverless, as MoEless bills): each replica's weights for the time its call
        takes; idle warm replicas cost nothing. [T, R] -> [T] byte-seconds."""
        tokens = np.asarray(replica_tokens, dtype=np.float64)
        return self.curve.weight_bytes * self.replica_seconds(tokens).reshape(tokens.shape[0], -1).sum(axis=1)


def held_byte_seconds(held_bytes: float, layer_seconds):
    """Serverful billing: memory held (every replica loaded, busy or not) for the layer's whole time.
    [T] -> [T] byte-seconds."""
    return held_bytes * np.asarray(layer_seconds, dtype=np.float64)
