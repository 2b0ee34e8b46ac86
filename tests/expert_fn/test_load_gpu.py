"""On a GPU (run with -m gpu on the lent H200): an expert function keeps serving rounds while it loads
experts in place, and what it loads is the checkpoint's weights, byte for byte."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.devices import allocator_cap, cap_device_memory
from kubemoe.expert_fn.batcher import Job, run_round
from kubemoe.expert_fn.graphs import ExpertGraphs
from kubemoe.expert_fn.shm import HEADER_BYTES, Segment
from kubemoe.expert_fn.store import ExpertStore
from kubemoe.presets import Preset
from kubemoe.synth import make_checkpoint

pytestmark = pytest.mark.gpu

HIDDEN, INTERMEDIATE, TOKENS = 4096, 14336, 64  # Mixtral's experts: 117 MB a tensor in bfloat16


def mixtral_sized_checkpoint(folder: Path) -> Checkpoint:
    """A checkpoint of one MoE layer with four Mixtral-sized experts in `folder` (bfloat16, ~1.3 GB)."""
    preset = Preset("mixtral", "load-gpu", dict(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=1, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=512, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=False), dtype="bfloat16", shard_bytes=4 << 30)
    return Checkpoint(make_checkpoint(preset, folder / "ckpt", progress=False))


@pytest.fixture(scope="module")
def mixtral_sized():
    """mixtral_sized_checkpoint in /dev/shm, for the module."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        yield mixtral_sized_checkpoint(Path(folder))


class Rounds:
    """Rounds as an expert function serves them: one call from pinned shared memory, CUDA graphs."""

    def __init__(self, store: ExpertStore, key):
        self.store, self.key = store, key
        adapter = store.adapter
        self.graphs = ExpertGraphs(adapter.hidden_size, adapter.act, store.device, store.dtype)
        asyncio.run(self.graphs.prepare(store.held_weights([key])))
        self.segment = Segment.private(HEADER_BYTES + 2 * TOKENS * adapter.hidden_size * 2)
        assert self.segment.pin()
        self.x = self.segment.view(HEADER_BYTES, store.dtype, [TOKENS, adapter.hidden_size])
        self.out = self.segment.view(HEADER_BYTES + self.x.nbytes, store.dtype, [TOKENS, adapter.hidden_size])
        self.x.copy_(torch.randn(TOKENS, adapter.hidden_size) * 0.1)

    def run(self) -> float:
        started = time.perf_counter()
        job = Job(self.x, [(self.key, TOKENS)], out_buffer=self.out, pinned=True)
        run_round([job], lambda key: self.store.get(*key), self.store.adapter.act, self.store.device, self.store.dtype,
                  self.graphs)
        assert job.error is None
        return time.perf_counter() - started

    def close(self) -> None:
        self.segment.unpin()


def _serving(checkpoint: Checkpoint) -> tuple[MoEAdapter, int, ExpertStore, Rounds]:
    """A store on the GPU holding expert 0 of the first MoE layer, and rounds that serve it."""
    adapter = MoEAdapter(checkpoint.config)
    layer = adapter.moe_layers[0]
    store = ExpertStore(checkpoint, adapter, [(layer, 0)], torch.bfloat16, torch.device("cuda"))
    store.load([(layer, 0)])
    return adapter, layer, store, Rounds(store, (layer, 0))


def test_rounds_go_on_while_experts_load_and_what_loads_is_the_checkpoint(mixtral_sized):
    adapter, layer, store, rounds = _serving(mixtral_sized)
    try:
        for _ in range(20):
            rounds.run()
        alone = sorted(rounds.run() for _ in range(50))[25]
        loading = threading.Thread(target=store.load, args=([(layer, 1), (layer, 2), (layer, 3)],))
        during = []
        loading.start()
        while loading.is_alive():
            during.append(rounds.run())
            time.sleep(0.0005)
        loading.join()
    finally:
        rounds.close()
    # A copy from the file's pageable memory held each round up for about one tensor's copy (15-20 ms on
    # the H200, 117 MB at ~6 GB/s): 9 tensors loaded in ~0.2 s left room for a dozen rounds.
    during.sort()
    assert len(during) >= 10, f"only {len(during)} rounds while three experts loaded (alone: {alone * 1e3:.2f} ms)"
    assert during[len(during) // 2] < max(5 * alone, 2e-3), \
        f"the median round took {during[len(during) // 2] * 1e3:.2f} ms while loading, {alone * 1e3:.2f} ms alone"
    for expert in (1, 2, 3):
        want = adapter.load_expert(mixtral_sized, layer, expert, torch.bfloat16, "cuda")  # torch's own copy
        got = store.get(layer, expert)
        assert torch.equal(got.gate_up, want.gate_up) and torch.equal(got.down, want.down)


def test_a_round_waits_for_its_own_stream_not_for_a_load_on_another(mixtral_sized):
    _, _, _, rounds = _serving(mixtral_sized)
    other = torch.cuda.Stream()
    try:
        rounds.run()
        with torch.cuda.stream(other):
            torch.cuda._sleep(1 << 31)  # about a second of GPU time, on another stream (as a Load's copies are)
        took = rounds.run()
        still_busy = not other.query()
        other.synchronize()
    finally:
        rounds.close()
    assert still_busy, "the other stream's work ended before the round did: make it longer"
    assert took < 0.05, f"a round took {took * 1e3:.0f} ms: it waited for another stream's work"


@pytest.mark.parametrize("nbytes, chunk", [(0, 64), (1, 64), (1000, 64), (1 << 20, 1 << 20), ((1 << 20) + 6, 1 << 16)])
def test_pinned_staging_copies_every_byte_whatever_the_chunks(nbytes, chunk):
    from kubemoe.expert_fn.staging import PinnedStaging

    staging = PinnedStaging(torch.cuda.Stream(), chunk_bytes=chunk)
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    for shaped in (source, source[: nbytes // 2 * 2].view(torch.bfloat16)):
        target = torch.empty(shaped.shape, dtype=shaped.dtype, device="cuda")
        staging.copy(target, shaped)
        staging.stream.synchronize()
        assert torch.equal(target.cpu().view(torch.uint8), shaped.view(torch.uint8))  # bytes: random bits make NaNs
    with pytest.raises(ValueError, match="cannot copy"):
        staging.copy(torch.empty(3, device="cuda"), torch.zeros(4))


def test_what_an_unload_drops_goes_back_to_the_device_once_rounds_are_done_with_it(mixtral_sized):
    """Expert functions sharing a GPU each have an allocator cache: memory one drops must become the
    device's again, for another's Load, not stay cached in the process that dropped it."""
    adapter, layer, store, rounds = _serving(mixtral_sized)
    try:
        store.load([(layer, e) for e in range(4)])
        rounds.run()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what the Load dropped (the stack of expert 0 alone): not what is measured
        held = torch.cuda.memory_reserved()
        store.unload([(layer, 1), (layer, 2), (layer, 3)])  # a new stack of expert 0; the old one of four goes
        rounds.run()  # expert 0 from its new stack
        # Three experts' worth, less what the graph of expert 0 on its new stack took (20 MiB on the H100)
        want, deadline = 3 * 3 * HIDDEN * INTERMEDIATE * 2 - (64 << 20), time.monotonic() + 10
        while held - torch.cuda.memory_reserved() < want and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held - torch.cuda.memory_reserved() >= want, \
            f"{(held - torch.cuda.memory_reserved()) / 2**20:.0f} MiB given back, not {want / 2**20:.0f}"
    finally:
        rounds.close()


def test_a_capped_allocator_frees_its_cache_at_the_cap_rather_than_run_past_it():
    """What a function keeps cached counts against its cap, and at the cap the allocator gives its cache
    back to take what it needs, as it does when the device is full."""
    cuda, block = torch.device("cuda"), 256 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    cap = base + 4 * block + (64 << 20)
    cap_device_memory(cuda, cap)
    try:
        blocks = [torch.empty(block, dtype=torch.uint8, device=cuda) for _ in range(3)]
        del blocks
        assert torch.cuda.memory_reserved() >= base + 3 * block  # cached, not the device's
        big = torch.empty(2 * block, dtype=torch.uint8, device=cuda)  # no cached block holds it: 5 blocks > cap
        assert torch.cuda.memory_reserved() <= cap and big.numel() == 2 * block
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(cap, dtype=torch.uint8, device=cuda)
    finally:
        cap_device_memory(cuda, 0)
    torch.empty(cap, dtype=torch.uint8, device=cuda)  # uncapped again


def test_a_working_memory_cap_follows_what_the_store_holds(mixtral_sized):
    """--working-memory-mib: the cap is what is allocated (the experts held, and what this process held
    before: earlier tests') plus the working memory; a Load raises it by the stack it makes and its reads
    while it runs, and once rounds are done with the old stacks it comes down again."""
    adapter = MoEAdapter(mixtral_sized.config)
    layer, cuda, working = adapter.moe_layers[0], torch.device("cuda"), 256 << 20
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    store = ExpertStore(mixtral_sized, adapter, [(layer, 0)], torch.bfloat16, cuda, working_bytes=working)
    expert = store.expert_bytes
    assert expert > working  # so that what follows could not fit under a cap that did not move

    def settled_at(nbytes: int) -> int:  # -> the cap (as the metrics read it) once it is at most nbytes, or in 10 s
        deadline = time.monotonic() + 10
        while allocator_cap(cuda) > nbytes + (1 << 20) and time.monotonic() < deadline:
            time.sleep(0.02)
        return allocator_cap(cuda)

    try:
        store.load([(layer, 0)])
        store.load([(layer, e) for e in range(1, 4)])  # a stack of four beside the old one of one: 5 experts at once
        assert store.nbytes == 4 * expert
        assert settled_at(base + 4 * expert + working) <= base + 4 * expert + working + (1 << 20)
        with pytest.raises(torch.OutOfMemoryError):  # beyond the working memory
            torch.empty(2 * working, dtype=torch.uint8, device=cuda)
        more = torch.empty(working // 2, dtype=torch.uint8, device=cuda)  # within it: fine
        assert torch.cuda.memory_reserved() <= base + 4 * expert + working + (1 << 20)
        del more
        store.unload([(layer, e) for e in range(1, 4)])
        assert settled_at(base + expert + working) <= base + expert + working + (1 << 20)
        deadline = time.monotonic() + 10
        while torch.cuda.memory_reserved() > base + expert + working and time.monotonic() < deadline:
            time.sleep(0.05)
        assert torch.cuda.memory_reserved() <= base + expert + working, "what the Unload dropped stayed cached"
    finally:
        store.working_bytes = 0  # a change still settling caps nothing now
        cap_device_memory(cuda, 0)
        store.unload(store.held())
