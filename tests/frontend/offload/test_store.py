"""The expert store: host layout, fixed slots, copies; pinning that fails falls back to pageable memory."""

import logging
import time

import pytest
import torch
import torch.nn.functional as F

from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.frontend.offload.costs import GROUPED_MIN_EXPERTS
from kubemoe.frontend.offload.cpu_experts import CpuExperts, choose_cpu_dtype
from kubemoe.frontend.offload.profiler import measure_profile
from kubemoe.frontend.offload.store import ExpertStore, HostExperts, covered, pin_all

H, I, E = 64, 32, 4


def weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {(l, e): ExpertWeights(torch.randn(2 * I, H, generator=g).to(dtype), torch.randn(H, I, generator=g).to(dtype))
            for l in (1, 3) for e in range(E)}


def store(device="cpu", dtype=torch.float32, slots=3, **kwargs):
    w = weights(dtype)
    host = HostExperts((1, 3), E, H, I, dtype, lambda l, e: w[(l, e)], pin_memory=device == "cuda")
    return w, ExpertStore(host, torch.device(device), slots, **kwargs)


def test_host_holds_every_expert_and_copies_land_in_fixed_slots():
    w, s = store()
    assert s.expert_bytes == 3 * H * I * 4 and s.host.nbytes == 2 * E * s.expert_bytes and not s.pinned
    for key, expected in w.items():
        assert torch.equal(s.host_weights(key).gate_up, expected.gate_up) and torch.equal(s.host_weights(key).down, expected.down)
    slots = s.slots.data_ptr()
    s.copy((3, 2), 1)
    s.wait_ready(1)
    assert torch.equal(s.slot_weights(1).gate_up, w[(3, 2)].gate_up) and torch.equal(s.slot_weights(1).down, w[(3, 2)].down)
    assert s.slots.data_ptr() == slots and s.num_slots == 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_experts_copied_together_land_in_their_own_slots(device):
    w, s = store(device)
    try:
        s.copy_many([((1, 3), 2), ((3, 0), 0), ((1, 1), 1)])
        s.wait_ready(0, 1, 2)
        for slot, key in [(2, (1, 3)), (0, (3, 0)), (1, (1, 1))]:
            assert torch.equal(s.slot_weights(slot).gate_up.cpu(), w[key].gate_up)
            assert torch.equal(s.slot_weights(slot).down.cpu(), w[key].down)
    finally:
        s.close()
        s.host.close()


def test_chunk_views_are_an_experts_gate_up_and_down_in_its_row_made_once():
    w, s = store()
    gate, up, down = s.host.chunk_views((3, 1))
    assert torch.equal(torch.cat([gate, up]).view(2 * I, H), w[(3, 1)].gate_up)
    assert torch.equal(down.view(H, I), w[(3, 1)].down)
    assert gate.data_ptr() == s.host.row((3, 1)).data_ptr()  # views of the (pinned) row, not copies
    assert s.host.chunk_views((3, 1))[0] is gate


@pytest.mark.gpu
def test_a_copy_leaves_the_callers_stream_current():
    w, s = store("cuda", torch.bfloat16, slots=2)
    try:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            s.copy_many([((1, 0), 0), ((3, 1), 1)])
            assert torch.cuda.current_stream() == side
            s.wait_ready(0, 1)
            total = s.slot_weights(1).down.float().sum()
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        torch.testing.assert_close(total.cpu(), w[(3, 1)].down.float().sum())
    finally:
        s.close()
        s.host.close()


def test_pinning_that_fails_is_logged_and_leaves_pageable_memory(caplog):
    tensors = [torch.empty(10), torch.empty(10)]
    pinned, undone = [], []

    def pin(t):
        if pinned:
            raise RuntimeError("cudaErrorMemoryAllocation")
        pinned.append(t)

    with caplog.at_level(logging.WARNING):
        assert pin_all(tensors, pin, undone.append) == []
    assert undone == pinned == tensors[:1]  # what was pinned is released again
    assert "could not pin" in caplog.text and "ulimit -l" in caplog.text


def test_cpu_experts_read_host_weights_in_the_chosen_dtype():
    w, s = store(dtype=torch.bfloat16)
    cpu = CpuExperts(s.host, F.silu, threads=2)
    try:
        assert cpu.dtype in (torch.bfloat16, torch.float32)
        x = torch.randn(5, H)
        exact = expert_ffn(x, ExpertWeights(w[(1, 2)].gate_up.float(), w[(1, 2)].down.float()), F.silu)
        [got] = cpu.submit([((1, 2), x.to(torch.bfloat16), None)]).result()
        got = got.float()
        torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05 * exact.abs().max().item())
    finally:
        cpu.close()


def test_float32_weights_compute_in_float32_without_timing():
    assert choose_cpu_dtype(weights()[(1, 0)], F.silu) == torch.float32


# -- on a GPU: pinned memory, one stream per chunk, events per slot ----------------------------------

@pytest.mark.gpu
def test_host_memory_is_pinned_and_chunks_go_on_three_streams():
    _, s = store("cuda", torch.bfloat16)
    try:
        assert s.pinned and all(t.is_pinned() for t in s.host.rows.values())
        assert len({st.cuda_stream for st in s.streams}) == 3
        assert torch.cuda.current_stream().cuda_stream not in {st.cuda_stream for st in s.streams}
    finally:
        s.close()
        s.host.close()


@pytest.mark.gpu
def test_compute_waits_only_for_its_own_slots_copy():
    # A copy into slot 0 still pending must not hold up a kernel on slot 1, already landed. Slot 0's copy is
    # held behind a long sleep on a side stream (it waits for slot 0's release event), so the check does
    # not race the copy engine: an earlier version timed a bare 192 MiB copy (~4 ms at 53 GB/s) against the
    # process's first launch of the reduction kernel, and with CUDA's lazy module loading (torch's default)
    # loading that kernel synchronises the device, i.e. waits for every copy in flight.
    w, s = store("cuda", torch.bfloat16, slots=2)
    try:
        assert s.pinned, "copies from pageable memory are synchronous: nothing here could overlap"
        s.copy((1, 1), 1)
        s.wait_ready(1)
        s.slot_weights(1).down[:1, :8].sum()  # load the kernels used below before anything is in flight
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)  # about half a second or more on any current GPU
            s.release(0)  # slot 0's next copy waits for the sleep
        s.copy((1, 0), 0)
        s.wait_ready(1)
        done = torch.cuda.Event()
        total = s.slot_weights(1).down[:1, :8].sum()
        done.record()
        done.synchronize()
        assert not any(e.query() for e in s._sync[0].ready), "the kernel on slot 1 waited for slot 0's copy"
        torch.testing.assert_close(total.cpu().float(), w[(1, 1)].down[:1, :8].float().sum(), rtol=1e-2, atol=1e-2)
        s.wait_ready(0)
        torch.testing.assert_close(s.slot_weights(0).down.cpu(), w[(1, 0)].down)
    finally:
        s.close()
        s.host.close()


@pytest.mark.gpu
def test_a_stream_waits_for_a_copy_once(monkeypatch):
    waits = []
    wait_event = torch.cuda.Stream.wait_event
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda stream, event: waits.append(event) or wait_event(stream, event))
    _, s = store("cuda", torch.bfloat16, slots=1)
    try:
        s.copy((1, 0), 0)
        waits.clear()  # the copy's own chunk streams wait for nothing yet (no release), but count from here
        s.wait_ready(0)
        s.wait_ready(0)
        assert len(waits) == 3  # the three chunks' events, once
        with torch.cuda.stream(torch.cuda.Stream()):
            s.wait_ready(0)  # another stream is not ordered by the first one's waits
        assert len(waits) == 6
        s.release(0)
        s.copy((3, 0), 0)
        waits.clear()
        s.wait_ready(0)
        assert len(waits) == 3  # a new copy: waited for again
    finally:
        s.close()
        s.host.close()


@pytest.mark.gpu
def test_experts_copied_together_are_one_copy_per_stream_and_waited_for_once(monkeypatch):
    waits, copies = [], []
    wait_event, copy_ = torch.cuda.Stream.wait_event, torch.Tensor.copy_
    monkeypatch.setattr(torch.cuda.Stream, "wait_event", lambda stream, event: waits.append(event) or wait_event(stream, event))
    _, s = store("cuda", torch.bfloat16, slots=3)
    try:
        monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, **kw: copies.append(dst) or copy_(dst, src, **kw))
        s.copy_many([((1, 0), 0), ((1, 1), 1), ((3, 2), 2)])
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        assert len(copies) == 3 * 3  # three experts' three chunks
        s.wait_ready(0, 1, 2)
        assert len(waits) == 3  # the three streams' events, shared by the three slots
    finally:
        s.close()
        s.host.close()


@pytest.mark.gpu
def test_a_copy_never_overwrites_a_slot_a_kernel_still_reads():
    w, s = store("cuda", torch.float32, slots=1)
    try:
        s.copy((1, 0), 0)
        s.wait_ready(0)
        torch.cuda._sleep(200_000_000)  # the compute stream is busy for a while before it reads the slot
        total = s.slot_weights(0).gate_up.sum()
        s.release(0)
        s.copy((1, 1), 0)  # without the release event this would land before the read above
        torch.testing.assert_close(total.cpu(), w[(1, 0)].gate_up.sum())
        s.wait_ready(0)
        torch.testing.assert_close(s.slot_weights(0).gate_up.cpu(), w[(1, 1)].gate_up)
    finally:
        s.close()
        s.host.close()


@pytest.mark.gpu
def test_copy_timing_reports_bandwidth():
    _, s = store("cuda", torch.bfloat16, timing=True)
    try:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for e in range(E):  # three slots: copies queue behind each other's chunks and overlap in time
            s.copy((1, e), e % 3)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        nbytes, seconds = s.copy_seconds()
        # The link's busy time: overlapping copies count once, so never longer than the copies took in all.
        assert nbytes == E * s.expert_bytes and 0 < seconds <= wall
    finally:
        s.close()
        s.host.close()


def test_cpu_experts_run_one_after_another_and_report_their_times():
    # One worker, each expert on every core: a layer's CPU side is the sum of its experts' t_c, as the cost
    # model has it (side by side, each with a team of every core, they oversubscribed the host).
    _, s = store()
    cpu = CpuExperts(s.host, F.silu)
    try:
        outs = [torch.empty(3 + e, H, dtype=cpu.dtype) for e in range(E)]
        results = cpu.submit([((1, e), torch.randn(3 + e, H), outs[e] if e % 2 else None) for e in range(E)]).result()
        assert [r.shape[0] for r in results] == [3 + e for e in range(E)]
        assert all(results[e] is outs[e] for e in range(1, E, 2)), "an output given is where the result goes"
        timings = cpu.drain_timings()
        assert [(key, tokens) for key, tokens, _, _ in timings] == [((1, e), 3 + e) for e in range(E)]
        assert all(end >= start for _, _, start, end in timings)
        assert all(b[2] >= a[3] for a, b in zip(timings, timings[1:])), "two CPU experts ran at once"
        assert cpu.drain_timings() == []
    finally:
        cpu.close()


def test_copies_in_flight_together_count_their_shared_time_once():
    assert covered([]) == 0.0
    assert covered([(0.0, 2.0), (5.0, 6.0)]) == 3.0  # apart: the link idles between them
    assert covered([(0.0, 4.0), (1.0, 3.0)]) == 4.0  # one inside the other
    assert covered([(2.0, 5.0), (0.0, 3.0), (4.0, 7.0)]) == 7.0  # a chain, in any order


@pytest.mark.parametrize(("slots", "grouped"), [(GROUPED_MIN_EXPERTS + 2, True), (GROUPED_MIN_EXPERTS - 1, False)])
def test_the_profile_prices_grouped_experts_where_the_store_can_group_them(slots, grouped):
    # The CPU's grouped GEMM groups any dtype; a store with fewer slots than a group never runs one.
    _, s = store(slots=slots)
    cpu = CpuExperts(s.host, F.silu, threads=1)
    try:
        costs = measure_profile(s, cpu, F.silu, slot=slots - 1, repeats=1, tokens=(1, 8), warm_tokens=2).costs(
            s.expert_bytes)
        assert (costs.grouped is not None) == grouped
        assert costs.t_io > 0 and costs.t_g(1) > 0 and costs.t_c(1) > 0
        if grouped:
            assert costs.groups(GROUPED_MIN_EXPERTS) and costs.t_g_all([1] * GROUPED_MIN_EXPERTS) > 0
    finally:
        cpu.close()
        s.close()
