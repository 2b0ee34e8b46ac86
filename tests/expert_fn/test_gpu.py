"""On a GPU (run with -m gpu on the lent H200): the CUDA path computes what the CPU does, inline and
through pinned shared memory, from CPU and from CUDA hidden states, with and without CUDA graphs, and
a layer's stacked experts grouped as they are one by one."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.expert import ExpertWeights, expert_ffn
from kubemoe.expert_fn import batcher
from kubemoe.expert_fn import graphs as graphs_module
from kubemoe.expert_fn.batcher import Job, run_round
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.round_graph import RoundGraph
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment
from kubemoe.expert_fn.store import ExpertStore, LayerStack
from kubemoe.moe import StackedExperts, can_group, sorted_ffn
from kubemoe.verify import rel_err

pytestmark = pytest.mark.gpu

ARCH = "mixtral"  # tiny: MoE layers 0 and 1, 8 experts, hidden 128, float32
LAYER, EXPERTS, COUNTS = 1, [0, 5, 7], [4, 5, 1]


@pytest.fixture
def tmpfs():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        yield Path(folder)


def test_a_tmpfs_segment_pins_and_a_failed_pin_leaves_cuda_usable(tmpfs, tmp_path):
    segment = Segment.create(tmpfs, 1 << 20)
    assert segment.pin()  # /dev/shm, as kubemoe serves by default: copies are direct DMA
    segment.unpin()
    elsewhere = Segment.create(tmp_path, 1 << 20)  # on a disk file system CUDA refuses to register it
    elsewhere.pin()
    assert torch.ones(2, device="cuda").sum().item() == 2  # whatever the outcome, no CUDA error lingers
    elsewhere.unpin()
    segment.unlink(), elsewhere.unlink()


@pytest.mark.parametrize("cuda_graph_tokens", [256, 0])
@pytest.mark.parametrize("folder", ["tmpfs", "tmp_path"])
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
async def test_a_cuda_expert_function_matches_the_cpu_one(dtype, tolerance, folder, cuda_graph_tokens, tiny_checkpoint,
                                                          serve, request):
    tmp_path = request.getfixturevalue(folder)  # a pinned segment, and one that may not pin
    checkpoint = tiny_checkpoint(ARCH)
    x = torch.randn(sum(COUNTS), 128, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    async with serve(checkpoint, dtype=dtype) as cpu:
        client = cpu.client(streaming=False)
        want = await client.forward(LAYER, EXPERTS, COUNTS, x)
        await client.close()
    async with serve(checkpoint, dtype=dtype, device="cuda", shm_dir=tmp_path, cuda_graph_tokens=cuda_graph_tokens,
                     data_port=0) as gpu:
        for transport, options in {"unary": dict(streaming=False), "inline": dict(tcp=False),
                                   "shm": dict(shm_dir=tmp_path), "tcp": {}}.items():
            client = gpu.client(**options)
            got = await client.forward(LAYER, EXPERTS, COUNTS, x)
            assert rel_err(got.float(), want.float()) < tolerance, transport
            from_cuda = await client.forward(LAYER, EXPERTS, COUNTS, x.cuda())  # the segment or arena pins here
            assert from_cuda.device.type == "cuda" and torch.equal(from_cuda.cpu(), got), transport
            assert client.transport == (transport if transport != "unary" else None)
            arena = client._stream.segment if transport in ("shm", "tcp") else None
            await client.close()
            assert arena is None or (arena.tried_pinning and not arena.pinned)  # unregistered with the stream


def test_graphed_rounds_match_eager_ones_from_pinned_regions_too_and_follow_reloaded_weights(tmpfs):
    cuda, H, I = torch.device("cuda"), 128, 64
    gen = torch.Generator().manual_seed(0)
    weights = {(0, e): ExpertWeights((torch.randn(2 * I, H, generator=gen) / 8).cuda(),
                                     (torch.randn(H, I, generator=gen) / 8).cuda()) for e in range(3)}
    graphs = ExpertGraphs(H, F.silu, cuda, torch.float32, max_tokens=8)
    segment = Segment.create(tmpfs, 1 << 20)
    assert segment.pin()

    def jobs(pinned: bool) -> list[Job]:  # one round: expert 0 gets 3+1 rows, expert 1 2+4, expert 2 9 (eager: > 8)
        gen = torch.Generator().manual_seed(1)
        groups = (((0, 3), (1, 2)), ((1, 4),), ((2, 9), (0, 1)))
        made = [Job(torch.randn(sum(t for _, t in g), H, generator=gen), [((0, e), t) for e, t in g]) for g in groups]
        if pinned:  # jobs 0 and 2 in regions of the pinned segment, as the lane's calls are
            for j, offset in ((0, HEADER_BYTES), (2, HEADER_BYTES + (64 << 10))):
                region = segment.view(offset, torch.float32, list(made[j].x.shape))
                region.copy_(made[j].x)
                made[j] = Job(region, made[j].groups, out_buffer=region, pinned=True)
        return made

    def compare() -> None:
        want = jobs(pinned=False)
        run_round(want, weights.__getitem__, F.silu, cuda, torch.float32)
        for pinned, with_graphs in ((False, graphs), (True, graphs), (True, None)):
            got = jobs(pinned)
            run_round(got, weights.__getitem__, F.silu, cuda, torch.float32, with_graphs)
            for w, g in zip(want, got):
                assert g.error is None and g.out.device.type == "cpu" and g.out.shape == g.x.shape
                assert rel_err(g.out, w.out) < 1e-5, (pinned, with_graphs)
                if g.pinned:
                    assert g.out.data_ptr() == g.x.data_ptr()  # the reply is in the request's region
            assert got[0].compute_seconds > 0  # measured (no upper bound: a first round pays CUDA's warm-up)

    compare()
    assert len(graphs) == 2  # (expert 0, 4 rows) and (expert 1, 8 rows); expert 2 ran eagerly
    compare()  # replayed
    assert len(graphs) == 2
    old = weights[(0, 1)]
    weights[(0, 1)] = ExpertWeights(old.gate_up * 2, old.down)  # reloaded: the old graph reads the old memory
    del old
    compare()
    assert len(graphs) == 2  # the old expert 1's graph is forgotten, a new one made
    segment.unpin(), segment.unlink()


def test_graphs_are_captured_again_after_every_expert_they_were_captured_for_is_gone():
    """A re-plan that unloads all of a function's experts and loads others: the new experts' graphs are
    captured into the same memory pool, which no graph holds any more in between."""
    cuda, H, I = torch.device("cuda"), 128, 64
    gen = torch.Generator().manual_seed(0)

    def expert() -> ExpertWeights:
        return ExpertWeights((torch.randn(2 * I, H, generator=gen) / 8).cuda(), (torch.randn(H, I, generator=gen) / 8).cuda())

    graphs, clock = ExpertGraphs(H, F.silu, cuda, torch.float32, max_tokens=8), batcher.ComputeClock(cuda)
    x = torch.randn(4, H, generator=gen).cuda()
    weights = {(0, 0): expert()}
    assert graphs.run((0, 0), weights[(0, 0)], [x], clock) is not None and len(graphs) == 1
    weights = {(0, 1): expert()}  # the old expert unloaded, another loaded: no graph of the old one is left
    got = graphs.run((0, 1), weights[(0, 1)], [x], clock)
    assert got is not None and len(graphs) == 1
    assert rel_err(got, expert_ffn(x, weights[(0, 1)], F.silu)) < 1e-5


def test_a_graph_without_the_device_memory_to_capture_it_leaves_its_calls_eager(monkeypatch, caplog):
    """At its cap a function cannot free its cache during a capture: the call runs eagerly, and the capture
    is not tried again for the same weights (each call would pay for a failed one)."""
    cuda, H, I = torch.device("cuda"), 128, 64
    gen = torch.Generator().manual_seed(0)

    def expert() -> ExpertWeights:
        return ExpertWeights((torch.randn(2 * I, H, generator=gen) / 8).cuda(), (torch.randn(H, I, generator=gen) / 8).cuda())

    real = graphs_module.expert_ffn

    def short_of_memory(x, weights, act, out=None):
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return real(x, weights, act, out=out)

    graphs, clock = ExpertGraphs(H, F.silu, cuda, torch.float32, max_tokens=8), batcher.ComputeClock(cuda)
    x, weights = torch.randn(4, H, generator=gen).cuda(), expert()
    with monkeypatch.context() as patched:
        patched.setattr(graphs_module, "expert_ffn", short_of_memory)
        assert graphs.run((0, 0), weights, [x], clock) is None and len(graphs) == 0  # the caller runs it eagerly
        assert "no device memory to capture the graph of (0, 0) at 4 tokens" in caplog.text
        caplog.clear()
        assert graphs.run((0, 0), weights, [x], clock) is None and not caplog.text  # not tried again
    assert graphs.run((0, 0), weights, [x], clock) is None  # the same weights: still eager
    reloaded = expert()
    got = graphs.run((0, 0), reloaded, [x], clock)  # new weights: captured
    assert got is not None and len(graphs) == 1 and rel_err(got, expert_ffn(x, reloaded, F.silu)) < 1e-5


def test_a_call_from_a_pinned_region_is_one_launch_per_expert_that_writes_only_its_own_rows(tmpfs, monkeypatch):
    cuda, H, I = torch.device("cuda"), 128, 64
    gen = torch.Generator().manual_seed(0)
    weights = {(0, e): ExpertWeights((torch.randn(2 * I, H, generator=gen) / 8).cuda(),
                                     (torch.randn(H, I, generator=gen) / 8).cuda()) for e in range(3)}
    graphs = ExpertGraphs(H, F.silu, cuda, torch.float32, max_tokens=8)
    launches = []
    launch = RoundGraph.launch
    monkeypatch.setattr(RoundGraph, "launch", lambda self, *args: (launches.append(self), launch(self, *args)))
    segment = Segment.create(tmpfs, 1 << 20)
    assert segment.pin()
    everything = segment.view(HEADER_BYTES, torch.float32, [64, H])
    groups = [((0, e), t) for e, t in ((0, 3), (1, 5), (2, 2))]  # buckets 4, 8 and 2: padded, full, padded
    for offset_rows, seed in ((0, 1), (16, 2), (0, 3)):  # re-pointed at another region, and back
        everything.fill_(7.0)
        x = torch.randn(10, H, generator=torch.Generator().manual_seed(seed))
        want = Job(x, groups)
        run_round([want], weights.__getitem__, F.silu, cuda, torch.float32)
        region = everything[offset_rows:offset_rows + 10]
        region.copy_(x)
        got = Job(region, groups, out_buffer=region, pinned=True)
        launches.clear()
        run_round([got], weights.__getitem__, F.silu, cuda, torch.float32, graphs)
        assert len(set(launches)) == 3  # one launch for each expert, copies included
        assert got.error is None and got.out.data_ptr() == region.data_ptr()
        assert rel_err(got.out, want.out) < 1e-5
        assert 0 < got.compute_seconds < 1
        outside = torch.cat([everything[:offset_rows], everything[offset_rows + 10:]])
        assert (outside == 7.0).all()  # padded rows went nowhere
    # A region in another dtype than the weights' is cast on the way: the graphs' copies cannot.
    half = segment.view(HEADER_BYTES, torch.float16, [10, H])
    half.copy_(x)
    launches.clear()
    got = Job(half, groups, out_buffer=half, pinned=True)
    run_round([got], weights.__getitem__, F.silu, cuda, torch.float32, graphs)
    assert not launches and rel_err(got.out.float(), want.out) < 2e-3
    segment.unpin(), segment.unlink()


def test_a_grouped_round_matches_the_per_expert_one_in_bfloat16_from_pinned_regions_too(tmpfs, monkeypatch):
    cuda, H, I, dtype = torch.device("cuda"), 128, 64, torch.bfloat16
    assert can_group(dtype, cuda, H, I)
    gen = torch.Generator().manual_seed(0)
    ids = [0, 2, 3, 5, 6]
    stack = LayerStack(StackedExperts((torch.randn(len(ids), 2 * I, H, generator=gen) / 8).to(cuda, dtype),
                                      (torch.randn(len(ids), H, I, generator=gen) / 8).to(cuda, dtype)),
                       {e: i for i, e in enumerate(ids)})
    weights = {(0, e): stack.experts.expert(i) for e, i in stack.local.items()}
    graphs = ExpertGraphs(H, F.silu, cuda, dtype, max_tokens=8)
    grouped = []
    monkeypatch.setattr(batcher, "sorted_ffn", lambda *args: grouped.append(args[0].shape[0]) or sorted_ffn(*args))
    segment = Segment.create(tmpfs, 1 << 20)
    assert segment.pin()

    def jobs(pinned: bool) -> list[Job]:  # jobs 0 and 2 in regions of the pinned segment, as the lane's calls are
        gen = torch.Generator().manual_seed(1)
        groups = (((5, 3), (0, 2), (6, 1)), ((0, 4), (2, 2)), ((2, 1), (3, 2), (5, 1)))  # the last in the stack's order
        made = [Job(torch.randn(sum(t for _, t in g), H, generator=gen).to(dtype), [((0, e), t) for e, t in g])
                for g in groups]
        for j, offset in ((0, HEADER_BYTES), (2, HEADER_BYTES + (64 << 10))) if pinned else ():
            region = segment.view(offset, dtype, list(made[j].x.shape))
            region.copy_(made[j].x)
            made[j] = Job(region, made[j].groups, out_buffer=region, pinned=True)
        return made

    want = jobs(pinned=False)
    run_round(want, weights.__getitem__, F.silu, cuda, dtype)  # one expert after another, eagerly
    for pinned in (False, True):
        got = jobs(pinned)
        run_round(got, weights.__getitem__, F.silu, cuda, dtype, graphs, {0: stack}.get)
        for w, g in zip(want, got):
            assert g.error is None and g.out.device.type == "cpu" and g.out.shape == g.x.shape
            assert rel_err(g.out.float(), w.out.float()) < 2e-2, pinned  # Triton's kernel and cuBLAS: bfloat16 rounding
            if g.pinned:
                assert g.out.data_ptr() == g.x.data_ptr()  # the reply is in the request's region
        assert got[0].compute_seconds > 0  # measured (the first round also compiles Triton's kernel: no upper bound)
    assert grouped == [16, 16] and len(graphs) == 0  # every expert in the one grouped computation; no graph

    lone = Job(torch.randn(4, H, generator=gen).to(dtype), [((0, 3), 4)])  # alone in its round: its graph
    run_round([lone], weights.__getitem__, F.silu, cuda, dtype, graphs, {0: stack}.get)
    assert grouped == [16, 16] and len(graphs) == 1
    assert rel_err(lone.out.float(), expert_ffn(lone.x.cuda(), weights[(0, 3)], F.silu).cpu().float()) < 2e-2
    segment.unpin(), segment.unlink()


def test_a_restacked_layer_retires_the_graphs_of_its_old_stack(tiny_checkpoint):
    """A Load makes the layer a new stack: an expert's graph captured on the old one (which is freed,
    its memory free to be reused) is not replayed; one on the new stack is captured."""
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    checkpoint = Checkpoint(tiny_checkpoint(ARCH))
    adapter = MoEAdapter(checkpoint.config)
    store = ExpertStore(checkpoint, adapter, [], dtype, cuda)
    store.load([(LAYER, 0), (LAYER, 5)])
    graphs = ExpertGraphs(adapter.hidden_size, adapter.act, cuda, dtype, max_tokens=8)
    x = torch.randn(4, adapter.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = expert_ffn(x.cuda(), adapter.load_expert(checkpoint, LAYER, 0, dtype, "cuda"), adapter.act).cpu()

    def alone() -> torch.Tensor:  # expert 0 alone in a round: its graph
        job = Job(x, [((LAYER, 0), 4)])
        run_round([job], lambda key: store.get(*key), adapter.act, cuda, dtype, graphs, store.stack)
        assert job.error is None
        return job.out

    assert rel_err(alone().float(), want.float()) < 1e-2 and len(graphs) == 1
    old = store.stack(LAYER)
    assert old is not None
    store.load([(LAYER, 7)])
    assert store.stack(LAYER) is not old
    shapes = [old.experts.gate_up.shape, old.experts.down.shape]
    del old  # nothing holds the old stack now: its memory is free
    torch.cuda.synchronize()
    with torch.cuda.stream(store._load_stream):  # the stream it was allocated on: these take its memory
        junk = [torch.full(shape, float("nan"), dtype=dtype, device=cuda) for shape in shapes * 4]
    assert rel_err(alone().float(), want.float()) < 1e-2  # a replay of the old graph would read NaNs
    assert len(graphs) == 1  # the old stack's graph forgotten, one on the new stack made
    del junk


async def test_a_cuda_expert_function_captures_its_graphs_before_it_reports_ready(tiny_checkpoint, serve):
    async with serve(tiny_checkpoint(ARCH), "1:0-3", device="cuda", cuda_graph_tokens=16) as gpu:
        graphs = gpu.servicer._graphs
        assert graphs.sizes == [1, 2, 4, 8, 16] and len(graphs) == 4 * 5


@pytest.mark.parametrize("dtype, stacked", [(torch.float32, False), (torch.bfloat16, True)])
def test_a_load_runs_beside_the_serving_stream_not_behind_it(dtype, stacked, tiny_checkpoint):
    """A Load (a re-plan moving experts in place) copies on a stream of its own: it finishes while work
    queued on the serving stream is still running, and what it loaded equals what the CPU reads.
    In bfloat16 the layer's experts are one stack, made anew by each Load and Unload."""
    checkpoint = Checkpoint(tiny_checkpoint(ARCH))
    adapter = MoEAdapter(checkpoint.config)
    store = ExpertStore(checkpoint, adapter, [(LAYER, 0)], dtype, torch.device("cuda"))
    assert store.stacked == stacked
    store.load([(LAYER, 2)])  # a stack to copy from, in the stacked case
    serving_done = torch.cuda.Event()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of a round that is still running on the serving stream
    serving_done.record()
    store.load([(LAYER, e) for e in EXPERTS])
    assert not serving_done.query()  # the load did not wait for the serving stream
    for e in [2, *EXPERTS]:
        want = adapter.load_expert(checkpoint, LAYER, e, dtype, "cpu")
        got = store.get(LAYER, e)
        assert torch.equal(got.gate_up.cpu(), want.gate_up) and torch.equal(got.down.cpu(), want.down)
    assert (store.stack(LAYER) is not None) == stacked
    torch.cuda.synchronize()
    store.unload([(LAYER, e) for e in EXPERTS])
    store.load([(LAYER, EXPERTS[0])])  # the freed memory is reused safely once the serving stream is past it
    for e in (2, EXPERTS[0]):
        assert torch.equal(store.get(LAYER, e).down.cpu(), adapter.load_expert(checkpoint, LAYER, e, dtype, "cpu").down)
