"""The offload executor on the CPU stand-in device: every policy computes what the experts compute in
process, slots are fixed, what ran where adds up, and bad budgets are refused with the minimum."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kubemoe.errors import KubemoeError
from kubemoe.expert import ExpertWeights
from kubemoe.frontend.offload.config import POLICIES, OffloadConfig
from kubemoe.frontend.offload.costs import CostLine, ExpertCosts, OffloadProfile
from kubemoe.frontend.offload.hot_table import TokenCounter
from kubemoe.frontend.offload.lookahead import NoLookahead, Replayed
from kubemoe.frontend.offload.runtime import build_executor, check_budget
from kubemoe.frontend.offload.store import HostExperts
from kubemoe.moe import LocalExperts

LAYERS, E, K, H, I = (0, 1, 2), 8, 2, 32, 16
EXPERT_BYTES = 3 * H * I * 4


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {(l, e): ExpertWeights(torch.randn(2 * I, H, generator=g) / H**0.5, torch.randn(H, I, generator=g) / I**0.5)
            for l in LAYERS for e in range(E)}


def profile(t_io=2.0, t_g=0.5, beta=1.0, c=1.0, t_attn=1.0, expert_bytes=EXPERT_BYTES):
    """Hand-worked figures (seconds; only their ratios matter): the CPU is cheap for few tokens."""
    return OffloadProfile("test", (ExpertCosts(expert_bytes, t_io, CostLine(0.0, t_g), CostLine(beta, c)),),
                          CostLine(0.0, t_attn), source="assumed")


def make(policy="kubemoe", resident=3, lookahead=None, counter=None, experts=None, device="cpu", dtype=torch.float32,
         **config):
    experts = experts or weights()
    expert_bytes = EXPERT_BYTES * dtype.itemsize // 4
    budget = (resident + 2 + 2 * K) * expert_bytes
    host = HostExperts(LAYERS, E, H, I, dtype, lambda l, e: experts[(l, e)])
    return build_executor(OffloadConfig(budget, policy=policy, **config), host, K, torch.device(device), F.silu, False,
                          lookahead or NoLookahead(), counter=counter, profile=profile(expert_bytes=expert_bytes))


def close(executor):
    executor.close()
    executor.store.host.close()


def routing(tokens, seed=1):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])  # [T, K]
    return index, torch.rand(tokens, K, generator=g)


def forward(executor, hidden, routes, lookahead=None):
    """One pass over the layers; with a Replayed lookahead it is told the next layer's routing exactly."""
    outs = []
    for i, layer in enumerate(LAYERS):
        if lookahead is not None and i + 1 < len(LAYERS):
            lookahead.next[layer] = routes[i + 1][0]
        outs.append(executor.run_layer(layer, hidden, *routes[i]))
    return outs


def forward_like_in_process(executor, experts, hidden, routes, device, dtype=torch.float32, tolerance=None,
                            lookahead=None) -> None:
    """One forward pass of `routes` through the executor computes what in-process experts compute (tolerance: fp32's
    unless given)."""
    tolerance = tolerance or dict(rtol=1e-4, atol=1e-5)
    outs = forward(executor, hidden.to(device, dtype), [(i.to(device), w.to(device)) for i, w in routes], lookahead)
    for layer, out, (index, w) in zip(LAYERS, outs, routes):
        reference = LocalExperts({e: experts[(layer, e)] for e in range(E)}, F.silu, False)
        torch.testing.assert_close(out.float().cpu(), reference(hidden, index, w), **tolerance)


def check_policy(policy, device, async_io=True):
    experts, hidden = weights(), torch.randn(12, H)
    routes = [routing(12, seed=s) for s in range(len(LAYERS))]
    lookahead = Replayed(E)
    executor = make(policy, lookahead=lookahead, experts=experts, device=device, async_io=async_io)
    try:
        for _ in range(2):  # a second pass starts with prefetches of the first forgotten
            forward_like_in_process(executor, experts, hidden, routes, device, lookahead=lookahead)
        s = executor.stats
        assert s.activated == s.hits + s.loaded + s.cpu_experts  # every activated expert ran once, somewhere
        assert s.bytes_copied == (s.loaded + s.prefetched) * EXPERT_BYTES
        assert s.gpu_tokens + s.cpu_tokens == 2 * len(LAYERS) * 12 * K
    finally:
        close(executor)


def check_grouped(device, dtype, tolerance):
    """Every expert resident: a layer's experts on the device run as one grouped FFN over the slots, never one
    by one, and compute what in-process experts compute."""
    experts, hidden = weights(), torch.randn(32, H)
    routes = [routing(32, seed=s) for s in range(len(LAYERS))]  # every expert of every layer
    executor = make("on-demand", resident=len(LAYERS) * E, experts=experts, device=device, dtype=dtype)
    assert executor.stack is not None

    def one_by_one(*args):
        raise AssertionError("an expert on the device ran alone")

    executor._compute = one_by_one
    try:
        forward_like_in_process(executor, experts, hidden, routes, device, dtype, tolerance)
        assert executor.stats.hits == executor.stats.activated == len(LAYERS) * E
    finally:
        close(executor)


def on_demand_in_halves_of_five(experts, device, dtype):
    """An on-demand executor with nothing resident and ten free slots (two on-demand, two groups of four for
    prefetches): its loads alternate between halves of five. -> it, and the sizes of its store's copy_many calls."""
    expert_bytes = EXPERT_BYTES * dtype.itemsize // 4
    host = HostExperts(LAYERS, E, H, I, dtype, lambda l, e: experts[(l, e)])
    executor = build_executor(OffloadConfig((2 + 2 * 4) * expert_bytes, policy="on-demand", prefetch_slots=4), host,
                              K, torch.device(device), F.silu, False, NoLookahead(), profile=profile(expert_bytes=expert_bytes))
    batches: list[int] = []
    copy_many = executor.store.copy_many
    executor.store.copy_many = lambda pairs: batches.append(len(pairs)) or copy_many(pairs)
    return executor, batches


def check_loads_grouped(device, dtype, tolerance):
    """Nothing resident and room for batches (two halves of five free slots): a layer's on-demand loads are
    copied in batches and each batch runs as one grouped FFN, never one expert at a time."""
    experts, hidden = weights(), torch.randn(32, H)
    routes = [routing(32, seed=s) for s in range(len(LAYERS))]  # every expert of every layer
    executor, batches = on_demand_in_halves_of_five(experts, device, dtype)
    assert executor.stack is not None and not executor.resident_slot

    def one_by_one(*args):
        raise AssertionError("an expert loaded on demand ran alone")

    executor._compute = one_by_one
    try:
        forward_like_in_process(executor, experts, hidden, routes, device, dtype, tolerance)
        assert executor.stats.loaded == len(LAYERS) * E and batches == [4, 4, 0] * len(LAYERS)  # no prefetches
    finally:
        close(executor)


def test_loads_too_few_for_even_batches_that_group_fill_a_half_first():
    # Six experts a layer, none resident, halves of five free slots: 3 + 3 would run every expert alone; 5 + 1
    # runs five as one grouped FFN and one alone.
    experts, hidden = weights(), torch.randn(32, H)
    g = torch.Generator().manual_seed(3)
    routes = [(torch.stack([torch.randperm(6, generator=g)[:K] for _ in range(32)]), torch.rand(32, K, generator=g))
              for _ in LAYERS]
    executor, batches = on_demand_in_halves_of_five(experts, "cpu", torch.float32)
    alone, compute = [], executor._compute
    executor._compute = lambda *args: alone.append(1) or compute(*args)
    try:
        forward_like_in_process(executor, experts, hidden, routes, "cpu")
        assert batches == [5, 1, 0] * len(LAYERS) and len(alone) == len(LAYERS)  # the 1 is a copy of one
    finally:
        close(executor)


def test_loads_on_demand_run_in_grouped_batches():
    check_loads_grouped("cpu", torch.float32, dict(rtol=1e-4, atol=1e-5))


@pytest.mark.gpu
def test_loads_on_demand_on_the_gpu_run_in_grouped_batches():
    check_loads_grouped("cuda", torch.bfloat16, dict(rtol=3e-2, atol=3e-2))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, dict(rtol=1e-4, atol=1e-5)),
                                              (torch.bfloat16, dict(rtol=3e-2, atol=3e-2))])
def test_experts_on_the_device_run_as_one_grouped_ffn(dtype, tolerance):
    check_grouped("cpu", dtype, tolerance)


@pytest.mark.gpu
def test_experts_on_the_gpu_run_as_one_grouped_ffn():
    check_grouped("cuda", torch.bfloat16, dict(rtol=3e-2, atol=3e-2))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_computes_what_in_process_experts_compute(policy):
    check_policy(policy, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("async_io", [True, False])
def test_every_policy_on_the_gpu_computes_what_in_process_experts_compute(policy, async_io):
    check_policy(policy, "cuda", async_io)


def test_presched_mixes_resident_prefetched_loaded_and_cpu_experts():
    lookahead = Replayed(E)
    executor = make("kubemoe", lookahead=lookahead)
    try:
        # Skewed routing: a few experts take most tokens (worth copying), the rest one token each (CPU).
        index = torch.tensor([[0, 1]] * 10 + [[2, 3], [4, 5], [6, 7]])
        routes = [(index, torch.rand(13, K))] * len(LAYERS)
        forward(executor, torch.randn(13, H), routes, lookahead)
        s = executor.stats
        assert s.loaded > 0 and s.cpu_experts > 0 and s.prefetched > 0
        assert s.prefetch_used == s.prefetched  # the replayed prediction is exact
        assert 0 < s.hit_rate < 1 and 0 < s.cpu_share < 1
    finally:
        close(executor)


def test_the_policy_is_told_the_host_gap_after_every_layer():
    # The profile's t_attn (1, timed online as the host's gap between layers) is the host gap of every layer,
    # the last one's too, which has no next layer to prefetch into (its t_attn, the copy window, is 0).
    lookahead = Replayed(E)
    executor = make("kubemoe", lookahead=lookahead)
    demands, presched = [], executor.policy

    class Recording:
        name, clairvoyant = "recording", False

        def schedule(self, demand, costs):
            demands.append(demand)
            return presched.schedule(demand, costs)

    executor.policy = Recording()
    try:
        forward(executor, torch.randn(13, H), [routing(13, seed=s) for s in range(len(LAYERS))], lookahead)
        assert [d.host_gap for d in demands] == [1.0] * len(LAYERS)
        assert [d.t_attn for d in demands] == [1.0] * (len(LAYERS) - 1) + [0.0]
    finally:
        close(executor)


def test_slots_are_allocated_once_resident_plus_two_on_demand_plus_two_prefetch_groups():
    lookahead = Replayed(E)
    executor = make("gpu-prefetch", resident=3, lookahead=lookahead)
    try:
        assert executor.store.num_slots == 3 + 2 + 2 * K
        before = executor.store.slots.data_ptr()
        forward(executor, torch.randn(20, H), [routing(20, seed=s) for s in range(len(LAYERS))], lookahead)
        assert executor.stats.loaded > 2 and executor.store.slots.data_ptr() == before
        assert sorted(executor.free_prefetch + list(executor.landed.values())) == list(range(5, 5 + 2 * K))
    finally:
        close(executor)


def test_the_hot_table_preloads_the_hottest_experts():
    counter = TokenCounter({(1, 5): 100, (2, 7): 90, (0, 3): 80, (0, 0): 1})
    executor = make("on-demand", resident=3, counter=counter)
    try:
        assert list(executor.resident_slot) == [(1, 5), (2, 7), (0, 3)]  # (position, expert), hottest first
        torch.testing.assert_close(executor.store.slot_weights(0).down, executor.store.host_weights((1, 5)).down)
    finally:
        close(executor)
    executor = make("on-demand", resident=3, counter=counter, hot_table=False)  # the ablation: by (layer, expert)
    try:
        assert list(executor.resident_slot) == [(0, 0), (0, 1), (0, 2)]
    finally:
        close(executor)


def test_cpu_experts_served_slower_than_profiled_reprice_t_c_and_move_work_to_the_gpu():
    # The profile says the CPU is nearly free (t_c = 1 ms + 0.1 ms a token against t_io = 2 s); the CPU
    # worker really takes 50 ms an expert. Once served, t_c follows what the CPU took, and PreSched stops
    # sending experts there.
    import threading
    import time

    def slow_on_the_cpu_worker(x):
        if threading.current_thread().name.startswith("kubemoe-cpu-expert"):
            time.sleep(0.05)
        return F.silu(x)

    experts = weights()
    host = HostExperts(LAYERS, E, H, I, torch.float32, lambda l, e: experts[(l, e)])
    cheap_cpu = OffloadProfile("test", (ExpertCosts(EXPERT_BYTES, 0.06, CostLine(0.0, 0.001), CostLine(1e-4, 1e-3)),),
                               CostLine(0.0, 0.0), source="assumed")
    executor = build_executor(OffloadConfig((2 + 2 * K) * EXPERT_BYTES), host, K, torch.device("cpu"),
                              slow_on_the_cpu_worker, False, NoLookahead(), profile=cheap_cpu)
    index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # eight experts, one token each
    try:
        first = executor.run_layer(0, torch.randn(4, H), index, torch.rand(4, K))
        assert first.shape == (4, H)
        cpu_first = executor.stats.cpu_experts
        assert cpu_first == E  # as profiled, every missing expert is cheaper on the CPU than one 60 ms copy
        assert executor.profile.costs(EXPERT_BYTES).t_c(1) > 10 * 1.1e-3  # repriced from 50 ms runs
        for _ in range(4):
            executor.run_layer(1, torch.randn(4, H), index, torch.rand(4, K))
        last = executor.stats.cpu_experts - cpu_first
        assert executor.profile.costs(EXPERT_BYTES).t_c(1) > 0.02
        executor.stats = type(executor.stats)()
        executor.run_layer(2, torch.randn(4, H), index, torch.rand(4, K))
        assert executor.stats.cpu_experts < E and executor.stats.loaded > 0  # copies now win for part of the layer
        assert last < 4 * E
    finally:
        close(executor)


def test_a_budget_below_the_working_set_is_refused_with_the_minimum():
    minimum = (2 + 2 * K) * EXPERT_BYTES
    with pytest.raises(KubemoeError, match=f"at least {minimum:,} bytes.*raise --gpu-budget"):
        check_budget(OffloadConfig(minimum - 1), EXPERT_BYTES, K, torch.device("cpu"))
    check_budget(OffloadConfig(minimum), EXPERT_BYTES, K, torch.device("cpu"))


def test_a_budget_above_the_device_memory_is_refused():
    with pytest.raises(KubemoeError, match="more than cpu has.*lower --gpu-budget"):
        check_budget(OffloadConfig(1 << 60), EXPERT_BYTES, K, torch.device("cpu"))


class FailingLookahead:
    name = "broken"

    def ahead(self, *args):
        raise RuntimeError("predictor exploded")


def test_a_failing_lookahead_is_switched_off_and_serving_goes_on(caplog):
    experts, hidden = weights(), torch.randn(6, H)
    routes = [routing(6, seed=s) for s in range(len(LAYERS))]
    executor = make("kubemoe", lookahead=FailingLookahead(), experts=experts)
    try:
        with caplog.at_level(logging.ERROR):
            outs = forward(executor, hidden, routes)
        assert "broken lookahead failed at layer 0 and is switched off" in caplog.text
        assert executor.lookahead.name == "frequency"
        reference = LocalExperts({e: experts[(2, e)] for e in range(E)}, F.silu, False)
        torch.testing.assert_close(outs[2], reference(hidden, *routes[2]), rtol=1e-5, atol=1e-6)
    finally:
        close(executor)


def test_the_hot_table_follows_what_serving_routes():
    # Start ranked by (layer, expert); serve traffic that only uses experts 5 and 6 of every layer.
    experts, hidden = weights(), torch.randn(8, H)
    executor = make("on-demand", resident=3, experts=experts, rerank_every=2)
    index = torch.tensor([[5, 6]] * 8)
    try:
        assert list(executor.resident_slot) == [(0, 0), (0, 1), (0, 2)]
        for _ in range(2):
            forward(executor, hidden, [(index, torch.rand(8, K))] * len(LAYERS))
        # One refresh replaces at most the prefetch slots' worth (K = 2): hottest in for coldest out.
        assert set(executor.resident_slot) == {(0, 2), (0, 5), (0, 6)}  # ties by (layer, expert)
        for _ in range(2):
            forward(executor, hidden, [(index, torch.rand(8, K))] * len(LAYERS))
        assert set(executor.resident_slot) == {(0, 5), (0, 6), (1, 5)}
        for key, slot in executor.resident_slot.items():
            assert torch.equal(executor.store.slot_weights(slot).down, experts[key].down)
        hits_before = executor.stats.hits
        forward(executor, hidden, [(index, torch.rand(8, K))] * len(LAYERS))
        assert executor.stats.hits - hits_before == 3
    finally:
        close(executor)
