"""The store without a server: each layer's experts held as one stack, handed out as views of its slots;
a Load reads into slots an Unload emptied, else makes the layer a new stack; per-expert weights where a
layer cannot be grouped."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.expert import expert_ffn
from kubemoe.expert_fn.batcher import Job, run_round
from kubemoe.expert_fn import store as store_module
from kubemoe.expert_fn.errors import ExpertFnError
from kubemoe.expert_fn.store import ExpertStore

ARCH = "qwen3_moe"  # tiny: MoE layers 0 and 1, 16 experts each, hidden 128


def _store(tiny_checkpoint) -> tuple[Checkpoint, MoEAdapter, ExpertStore]:
    checkpoint = Checkpoint(tiny_checkpoint(ARCH))
    adapter = MoEAdapter(checkpoint.config)
    return checkpoint, adapter, ExpertStore(checkpoint, adapter, [], torch.float32, torch.device("cpu"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _assert_holds(store: ExpertStore, checkpoint: Checkpoint, keys: list[tuple[int, int]]) -> None:
    """`store` holds exactly `keys`, each with the checkpoint's weights."""
    assert store.held() == sorted(keys)
    for layer, expert in keys:
        want, got = store.adapter.load_expert(checkpoint, layer, expert), store.get(layer, expert)
        assert torch.equal(got.gate_up, want.gate_up) and torch.equal(got.down, want.down), (layer, expert)


def test_a_layers_experts_are_views_of_one_stack_that_load_and_unload_make_anew(tiny_checkpoint):
    checkpoint, adapter, store = _store(tiny_checkpoint)
    first, second = adapter.moe_layers[:2]
    assert store.stacked
    store.load([(first, 5), (first, 1), (second, 2)])
    stack = store.stack(first)
    assert stack is not None and stack.local == {1: 0, 5: 1} and stack.experts.num_experts == 2
    for expert, i in stack.local.items():
        weights = store.get(first, expert)
        assert _storage(weights.gate_up) == _storage(stack.experts.gate_up)
        assert _storage(weights.down) == _storage(stack.experts.down)
        assert torch.equal(weights.gate_up, stack.experts.gate_up[i])
    _assert_holds(store, checkpoint, [(first, 1), (first, 5), (second, 2)])

    untouched = store.stack(second)
    old_one = store.get(first, 1)
    assert store.load([(first, 3), (first, 1)])[0] == adapter.expert_bytes(torch.float32)  # 1 is held already
    stack = store.stack(first)
    assert stack is not None and stack.local == {1: 0, 3: 1, 5: 2}
    assert _storage(store.get(first, 1).gate_up) == _storage(stack.experts.gate_up) != _storage(old_one.gate_up)
    assert store.stack(second) is untouched  # only the layers a Load changes are made anew
    _assert_holds(store, checkpoint, [(first, 1), (first, 3), (first, 5), (second, 2)])

    assert store.unload([(first, 1), (first, 5), (first, 9)]) == 2 * adapter.expert_bytes(torch.float32)
    stack = store.stack(first)
    assert stack is not None and stack.local == {3: 0} and _storage(store.get(first, 3).down) == _storage(stack.experts.down)
    _assert_holds(store, checkpoint, [(first, 3), (second, 2)])
    with pytest.raises(ExpertFnError) as refused:
        store.get(first, 5)
    assert refused.value.code == grpc.StatusCode.NOT_FOUND

    store.unload([(first, 3)])
    assert store.stack(first) is None and store.nbytes == adapter.expert_bytes(torch.float32)


def test_a_load_reads_into_the_slots_an_unload_emptied_once_nothing_can_read_them(tiny_checkpoint):
    """A re-plan's moves: no copy of the experts kept, no new stack, the kept experts' views (and so
    their CUDA graphs) unchanged; a slot something may still read is not written."""
    checkpoint, adapter, store = _store(tiny_checkpoint)
    layer = adapter.moe_layers[0]
    store.load([(layer, e) for e in (2, 4, 6, 8)])
    stack = store.stack(layer)
    kept = {e: store.get(layer, e) for e in (2, 8)}
    assert store.unload([(layer, 4), (layer, 6)]) == 2 * store.expert_bytes
    after = store.stack(layer)
    assert after is not None and after.experts is stack.experts and after.local == {2: 0, 8: 3}
    assert all(store.get(layer, e) is kept[e] for e in (2, 8))
    assert store.device_bytes == 4 * store.expert_bytes  # the empty slots stay the function's
    assert after.reusable() == []  # `stack`, the map that named them, is alive here
    store.load([(layer, 10)])  # so it takes a new stack
    assert store.stack(layer).experts is not stack.experts and store.stack(layer).local == {2: 0, 8: 1, 10: 2}
    _assert_holds(store, checkpoint, [(layer, 2), (layer, 8), (layer, 10)])

    del stack, after
    store.load([(layer, 12)])  # three slots (no empty one): a new stack of four
    experts, kept = store.stack(layer).experts, {e: store.get(layer, e) for e in (2, 10, 12)}
    store.unload([(layer, 8)])
    assert store.stack(layer).local == {2: 0, 10: 2, 12: 3} and store.stack(layer).reusable() == [1]
    store.load([(layer, 14)])
    assert store.stack(layer).experts is experts and store.stack(layer).local == {2: 0, 10: 2, 12: 3, 14: 1}
    assert all(store.get(layer, e) is kept[e] for e in (2, 10, 12))  # same views: their graphs stay valid
    _assert_holds(store, checkpoint, [(layer, 2), (layer, 10), (layer, 12), (layer, 14)])
    assert store.load_bytes([(layer, 3)]) == 5 * store.expert_bytes + store_module.READ_EXPERTS * store.expert_bytes

    store.unload([(layer, 2), (layer, 10), (layer, 12)])  # three of four slots empty: a new stack of one
    assert store.stack(layer).experts.num_experts == 1 and store.device_bytes == store.expert_bytes
    _assert_holds(store, checkpoint, [(layer, 14)])


def test_a_slot_a_running_grouped_round_reads_is_not_reused_after_two_more_changes_of_its_layer(tiny_checkpoint):
    """The round holds the layer's map as it began; an Unload after another change of the layer empties a slot
    whose readers named only the newer map: a Load reused it mid-round, and expert 1's row came out with
    expert 13's weights."""
    checkpoint = Checkpoint(tiny_checkpoint("qwen3_moe"))
    adapter = MoEAdapter(checkpoint.config)
    layer = adapter.moe_layers[1]
    store = ExpertStore(checkpoint, adapter, [], torch.float32, torch.device("cpu"))
    assert store.stacked
    store.load([(layer, e) for e in range(12)])
    x = torch.randn(8, adapter.hidden_size, generator=torch.Generator().manual_seed(0))
    want = torch.stack([expert_ffn(x[e:e + 1], store.get(layer, e), adapter.act)[0] for e in range(8)])
    job = Job(x, [((layer, e), 1) for e in range(8)])  # eight experts of one layer: one grouped computation
    started, changed = threading.Event(), threading.Event()

    def act(t):  # the round, between its two grouped GEMMs, while the layer changes on another thread
        started.set()
        assert changed.wait(30)
        return adapter.act(t)

    def changes():  # as Unload and Load RPCs run, in threads, while the round runs
        started.wait(30)
        store.unload([(layer, 11)])  # the layer's map is replaced
        store.unload([(layer, 1)])   # expert 1's slot is emptied
        store.load([(layer, 13)])    # a Load wants a slot
        changed.set()

    thread = threading.Thread(target=changes)
    thread.start()
    run_round([job], lambda key: store.get(*key), act, torch.device("cpu"), torch.float32, None, store.stack, 8)
    thread.join()
    assert job.error is None and torch.allclose(job.out, want, atol=1e-5)


def test_where_a_layer_cannot_be_grouped_each_expert_is_held_alone(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(store_module, "can_group", lambda *_: False)  # as float32 on a GPU
    checkpoint, adapter, store = _store(tiny_checkpoint)
    layer = adapter.moe_layers[0]
    assert not store.stacked
    assert store.load([(layer, 4), (layer, 6)])[0] == 2 * adapter.expert_bytes(torch.float32)
    assert store.stack(layer) is None
    assert _storage(store.get(layer, 4).gate_up) != _storage(store.get(layer, 6).gate_up)
    assert store.unload([(layer, 6)]) == adapter.expert_bytes(torch.float32)
    _assert_holds(store, checkpoint, [(layer, 4)])


def test_a_load_that_runs_out_of_device_memory_is_resource_exhausted_and_what_was_held_still_serves(
        tiny_checkpoint, monkeypatch):
    checkpoint, adapter, store = _store(tiny_checkpoint)
    layer = adapter.moe_layers[0]
    store.load([(layer, 1)])

    def full(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.31 GiB.\nmore detail")

    monkeypatch.setattr(store_module.StackedExperts, "empty", full)
    with pytest.raises(ExpertFnError) as refused:
        store.load([(layer, 2)])
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = str(refused.value)
    assert f"loading {layer}:2 ran out of device memory" in message and "fewer functions on its GPU" in message
    assert message.endswith("Tried to allocate 1.31 GiB.")
    monkeypatch.undo()
    _assert_holds(store, checkpoint, [(layer, 1)])
    store.load([(layer, 2)])  # and it loads once there is room
    _assert_holds(store, checkpoint, [(layer, 1), (layer, 2)])


def test_a_load_needs_a_new_stack_of_each_layer_it_changes_or_its_new_experts(tiny_checkpoint):
    """What a Load allocates beside what is held: where a layer's experts are one stack, the layer's new
    stack, its old experts included; where they cannot be grouped, only the experts it adds; and room for
    assembling the experts it reads (READ_EXPERTS)."""
    checkpoint, adapter, store = _store(tiny_checkpoint)
    layer = adapter.moe_layers[0]
    store.load([(layer, 0), (layer, 1)])
    expert = adapter.expert_bytes(torch.float32)
    assert store.expert_bytes == expert and store.stacked
    reading = store_module.READ_EXPERTS * expert
    assert store.load_bytes([(layer, 1), (layer, 2), (layer, 3)]) == 4 * expert + reading
    assert store.load_bytes([(layer, 1)]) == 0
    store.stacked = False  # the count of a store whose layers cannot be grouped
    assert store.load_bytes([(layer, 1), (layer, 2), (layer, 3)]) == 2 * expert + reading


def test_the_cap_is_what_is_held_or_allocated_plus_a_changes_new_stacks_plus_the_working_memory(tiny_checkpoint,
                                                                                                monkeypatch):
    """--working-memory-mib's arithmetic (the GPU test in test_load_gpu.py runs it on a device): never below
    what the allocator has allocated, which a round on a replaced stack still holds."""
    checkpoint, adapter, store = _store(tiny_checkpoint)
    caps, allocated = [], [0]
    monkeypatch.setattr(store_module, "cap_device_memory", lambda device, nbytes: caps.append(nbytes))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(store, "_settle", lambda give_back, replaced: None)  # a CUDA event and a thread: the GPU test's
    store.working_bytes, store._serving = 100, object()  # as on a GPU
    layer, expert = adapter.moe_layers[0], store.expert_bytes
    reading = store_module.READ_EXPERTS * expert
    store.load([(layer, 0), (layer, 1)])
    assert caps == [2 * expert + reading + 100]  # nothing held: the new stack of two, and the reads
    store.load([(layer, 2)])
    assert caps[-1] == 2 * expert + 3 * expert + reading + 100  # the two held, beside a new stack of three
    allocated[0] = 5 * expert  # the old stack of two still held by a round
    store._cap()
    assert caps[-1] == 5 * expert + 100
    allocated[0] = 0
    store._cap()
    assert caps[-1] == 3 * expert + 100
    store.unload([(layer, 0)])
    assert caps[-1] == 3 * expert + 100  # its slot stays (the stack of three): nothing allocated
    store.load([(layer, 5)])
    assert caps[-1] == 3 * expert + reading + 100  # into that slot: only the read
    store.unload([(layer, 1), (layer, 2)])
    assert caps[-1] == 3 * expert + expert + 100  # two of three slots empty: a new stack of one
