"""The offload path assembled from its config: budget checks, hot table, store, CPU pool, profile, policy.

Bad input is refused here, before serving, with what to do: a budget above the device's memory, or one
too small for the streaming working set (two on-demand slots and two prefetch groups; the message
gives the minimum).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from kubemoe.errors import KubemoeError
from kubemoe.offload_budget import suggested_budget, working_set_bytes
from kubemoe.frontend.offload.baselines import FiddlerLike, GatePrefetch, HybriMoELike, OnDemand, StaticSplit
from kubemoe.frontend.offload.config import OffloadConfig
from kubemoe.frontend.offload.costs import OffloadProfile
from kubemoe.frontend.offload.cpu_experts import CpuExperts
from kubemoe.frontend.offload.executor import OffloadExecutor
from kubemoe.frontend.offload.hot_table import TokenCounter, build_hot_table
from kubemoe.frontend.offload.lookahead import Lookahead
from kubemoe.frontend.offload.policy import Policy
from kubemoe.frontend.offload.presched import PreSched
from kubemoe.frontend.offload.profiler import measure_profile
from kubemoe.frontend.offload.store import ExpertStore, HostExperts, Key

log = logging.getLogger(__name__)

# The baselines made without arguments; kubemoe's PreSched and the static split are made in make_policy.
_POLICIES: dict[str, Callable[[], Policy]] = {"on-demand": OnDemand, "gpu-prefetch": GatePrefetch,
                                              "fiddler-like": FiddlerLike, "hybrimoe-like": HybriMoELike}


def device_memory_bytes(device: torch.device) -> int:
    """What the device holds: the GPU's memory, or the host's for the CPU stand-in."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def prefetch_slots_of(config: OffloadConfig, num_experts: int, top_k: int) -> int:
    """Experts per prefetch group: as configured, else the model's experts per token."""
    return min(num_experts, top_k if config.prefetch_slots is None else config.prefetch_slots)


def check_budget(config: OffloadConfig, expert_bytes: int, prefetch_slots: int, device: torch.device) -> None:
    total = device_memory_bytes(device)
    if config.gpu_budget_bytes > total:
        raise KubemoeError(f"the GPU budget of {config.gpu_budget_bytes / 2**30:.2f} GiB is more than {device} has "
                           f"({total / 2**30:.2f} GiB): lower --gpu-budget, e.g. to {suggested_budget(total) / 2**30:.2f} "
                           "GiB (the rest holds attention weights and the KV cache)")
    minimum = working_set_bytes(expert_bytes, prefetch_slots)
    if config.gpu_budget_bytes < minimum:
        raise KubemoeError(
            f"the GPU budget of {config.gpu_budget_bytes:,} bytes cannot hold one layer's working set: at least "
            f"{minimum:,} bytes ({minimum / 2**20:.1f} MiB: 2 on-demand slots and 2 prefetch groups of {prefetch_slots} "
            f"experts of {expert_bytes:,} bytes); raise --gpu-budget")


def resident_experts(config: OffloadConfig, policy: Policy, counter: TokenCounter, all_experts: list[Key],
                     expert_bytes: int, prefetch_slots: int) -> tuple[Key, ...]:
    """The experts that live on the device: the hot table's (hottest first), or the static split's layers."""
    if isinstance(policy, StaticSplit):
        return tuple(sorted(policy.resident))
    ranked = counter if config.hot_table else TokenCounter()
    return build_hot_table(ranked, all_experts, expert_bytes, config.gpu_budget_bytes, prefetch_slots).experts


def make_policy(config: OffloadConfig, layers: list[int], num_experts: int, expert_bytes: int,
                prefetch_slots: int) -> Policy:
    if config.policy == "kubemoe":
        return PreSched(xi=config.xi)
    if config.policy == "static-split":
        # Whole layers on the device within the budget left beside the working set (nothing is copied, but
        # the budget means the same for every policy). Positions, as the executor's decisions use.
        budget = config.gpu_budget_bytes - working_set_bytes(expert_bytes, prefetch_slots)
        return StaticSplit.layers_that_fit(list(range(len(layers))), num_experts, expert_bytes, budget)
    return _POLICIES[config.policy]()


def build_executor(config: OffloadConfig, host: HostExperts, top_k: int, device: torch.device, act: Callable,
                   weight_on_input: bool, lookahead: Lookahead, counter: TokenCounter | None = None,
                   profile: OffloadProfile | None = None, timing: bool = False, on_layer=None,
                   cpu_dtype: torch.dtype | None = None) -> OffloadExecutor:
    """An executor over `host`'s experts (the caller keeps `host` and closes it after the executor)."""
    layers, num_experts, expert_bytes = host.layers, host.num_experts, host.expert_bytes
    prefetch_slots = prefetch_slots_of(config, num_experts, top_k)
    check_budget(config, expert_bytes, prefetch_slots, device)
    policy = make_policy(config, list(layers), num_experts, expert_bytes, prefetch_slots)
    all_experts = [(l, e) for l in layers for e in range(num_experts)]
    counter = TokenCounter((counter or TokenCounter()).counts)  # the executor's own: it counts what it serves
    resident = resident_experts(config, policy, counter, all_experts, expert_bytes, prefetch_slots)
    if isinstance(policy, StaticSplit):  # its layers are positions: name the real layers for the store
        resident = tuple((layers[p], e) for p, e in resident)
    slots = len(resident) + working_set_bytes(expert_bytes, prefetch_slots) // expert_bytes
    store = ExpertStore(host, device, slots, async_io=config.async_io, timing=timing)
    cpu = CpuExperts(host, act, config.cpu_threads, cpu_dtype)
    if profile is None:
        profile = measure_profile(store, cpu, act, slot=slots - 1)
    log.info("offload: %d of %d experts resident (%.2f GiB), %d prefetch slots per group, policy %s, lookahead %s; "
             "%s", len(resident), len(all_experts), len(resident) * expert_bytes / 2**30, prefetch_slots,
             policy.name, lookahead.name, profile.device)
    rerank = None
    if config.hot_table and not isinstance(policy, StaticSplit):
        def rerank(counts: TokenCounter) -> tuple[Key, ...]:
            return build_hot_table(counts, all_experts, expert_bytes, config.gpu_budget_bytes, prefetch_slots).experts
    return OffloadExecutor(store, cpu, policy, lookahead, profile, resident, prefetch_slots, act, weight_on_input,
                           on_layer=on_layer, counter=counter, rerank=rerank, rerank_every=config.rerank_every,
                           rerank_swaps=config.rerank_swaps)
