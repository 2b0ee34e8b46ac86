"""The weights an expert function holds: ExpertWeights per (layer, expert), read lazily from the checkpoint.

Only the bundle's own tensors are read (safetensors memory-maps the shards), straight into the
serving dtype on the serving device. Load and Unload change the held set at run time; the function
is ready (health SERVING) while it holds its whole bundle.

On a GPU, loads run on a CUDA stream of their own. On the serving stream (the device's default one,
which every round uses), a Load's copies (tens of milliseconds per Mixtral expert) would queue ahead
of the rounds that arrive meanwhile: a re-plan that loads experts in place would stall every call to
this function until its copies were done. And they go through pinned memory (staging.py): a copy
from the mapped file's pageable memory held up the function's rounds until it was done, stream or not.

Where a layer's experts can run as one grouped computation (moe.can_group), the experts held of
each layer are one stack (`LayerStack`) and each ExpertWeights handed out is a view of one of its
slots: a round runs a layer's experts at once from the stack (batcher.py), anything else (graphs, a
lone expert) from the views. A re-plan moves a few experts per layer in and out of each function, so
a stack keeps the slots an Unload empties, and a later Load of that layer reads its experts into them:
neither copies the experts kept, allocates or frees device memory, or gives the experts kept new
weights (their CUDA graphs, captured by address, stay valid). A slot is reused once nothing can
still read it (the stack map that named it and the expert's views are gone), after the work queued
by then. A Load with too few such slots makes the layer a new stack of exactly what it will hold (the
experts kept copied from the old one: meanwhile that layer is held twice and the old stack serves the
rounds), and so does an Unload that would leave more slots empty than held (empty slots are memory
the function keeps: at most as much as it serves). Reads take no lock: the store replaces its dicts
and stacks' maps, never mutates them.

With `working_bytes` (--working-memory-mib) the allocator is capped at the stacks held plus that much,
and a change raises the cap by what it allocates (new stacks, the experts it reads) for as long as it
takes: functions that time-slice a GPU each keep an allocator cache, and what one keeps cached another's
plan cannot have (kubemoe.devices.cap_device_memory). The cap comes down to what is held once the rounds
queued by the end of a change are done with what it replaced.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterable

import grpc
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.bundles import ExpertKey, format_bundle_spec
from kubemoe.checkpoint import Checkpoint
from kubemoe.devices import cap_device_memory, empty_cache
from kubemoe.expert import ExpertWeights
from kubemoe.expert_fn.errors import ExpertFnError, invalid, not_found
from kubemoe.expert_fn.staging import PinnedStaging
from kubemoe.moe import StackedExperts, can_group


SETTLE_WAIT_S = 10.0  # the longest a change's settling waits for rounds still holding what it replaced
# A read that assembles an expert on the device from its tensors as stored (MoEAdapter.load_expert: gate
# and up apart, or transposed) takes up to 5/3 of an expert at once (the GPU test on the H100 ran out of
# memory beside a cap that counted the stack alone). A stack's slot is read into in place
# (MoEAdapter.read_expert_into) and needs none of it, unless the layout is transposed or the dtype is not the
# checkpoint's; the cap and a follower's need keep the room for those.
READ_EXPERTS = 2


@dataclass(frozen=True)
class LayerStack:
    """The experts held of one layer, in the slots of one StackedExperts; a slot in neither map is unused."""

    experts: StackedExperts
    local: dict[int, int]  # expert id -> slot; replaced, never mutated
    # Empty slots -> what could still read the expert that left it (weak references: the map that named
    # it, the expert's views); reused for a Load once all are gone
    emptied: dict[int, tuple[weakref.ref, ...]] = field(default_factory=dict)
    # The map that replaced this one, if any: a round holding this map keeps it alive, and so keeps an emptied
    # slot's reader (the map current when the slot was emptied, perhaps a later one than this) alive too.
    successor: list["LayerStack"] = field(default_factory=list, compare=False, repr=False)

    def reusable(self) -> list[int]:
        """Empty slots nothing can read any more, ascending."""
        return sorted(slot for slot, readers in self.emptied.items() if all(r() is None for r in readers))

    @property
    def nbytes(self) -> int:  # what the stack holds on the device, empty slots included
        return self.experts.gate_up.nbytes + self.experts.down.nbytes


class ExpertStore:
    def __init__(self, checkpoint: Checkpoint, adapter: MoEAdapter, bundle: Iterable[ExpertKey],
                 dtype: torch.dtype, device: torch.device, working_bytes: int = 0):
        self.checkpoint, self.adapter = checkpoint, adapter
        self.bundle = frozenset(bundle)
        self.bundle_spec = format_bundle_spec(self.bundle)
        self.dtype, self.device = dtype, device
        self.working_bytes = working_bytes  # the allocator's cap beside the experts held (the module docstring); 0: none
        self.expert_bytes = adapter.expert_bytes(dtype)
        self._weights: dict[ExpertKey, ExpertWeights] = {}  # replaced, never mutated: readers need no lock
        self._stacks: dict[int, LayerStack] = {}  # by layer, where `stacked`; replaced, never mutated
        self.stacked = can_group(dtype, device, adapter.hidden_size, adapter.expert_intermediate_size)
        self._lock = threading.Lock()  # one load/unload at a time
        self._loading: frozenset[ExpertKey] = frozenset()
        self._serving = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._load_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staging = PinnedStaging(self._load_stream) if self._load_stream is not None else None
        self._copy = self._staging.copy if self._staging is not None else None  # how a read reaches the device
        self._cap()

    # -- reads (hot path) ---------------------------------------------------------------------

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """The weights of a held expert; a request error naming what is wrong otherwise."""
        weights = self._weights.get((layer, expert))
        if weights is None:
            raise self._refusal(layer, [(layer, expert)])
        return weights

    def stack(self, layer: int) -> LayerStack | None:
        """The experts held of `layer` as one stack; None if none are, or this store does not stack them."""
        return self._stacks.get(layer)

    def check_held(self, layer: int, experts: Iterable[int]) -> None:
        """Refuse, in one error that names them all (`lacking`), the experts of `layer` not held."""
        keys = [(layer, e) for e in dict.fromkeys(experts) if (layer, e) not in self._weights]
        if keys:
            raise self._refusal(layer, keys)

    def _refusal(self, layer: int, keys: list[ExpertKey]) -> ExpertFnError:
        """Why `keys` (of `layer`, not held) cannot run: UNAVAILABLE while every one of them is loading,
        NOT_FOUND otherwise; raises INVALID_ARGUMENT for one that is not in the model."""
        for key in keys:
            self.check_in_model(*key)
        named = (f"expert {keys[0][1]}" if len(keys) == 1 else f"experts {', '.join(str(e) for _, e in keys)}") + \
            f" of layer {layer}"
        if all(key in self._loading for key in keys):
            return ExpertFnError(grpc.StatusCode.UNAVAILABLE, f"{named} still loading; retry shortly "
                                 "(health turns SERVING when the bundle is in)", lacking=keys)
        return not_found(
            f"{named} not held by this expert function (bundle {self.bundle_spec}, holding "
            f"{format_bundle_spec(self._weights) or 'nothing'}); send them to the endpoint the routing table "
            "names for them, or Load them here", lacking=keys)

    def check_in_model(self, layer: int, expert: int) -> None:
        if layer not in self.adapter.moe_layers:
            raise invalid(f"layer {layer} is not an MoE layer of this {self.adapter.arch.name} model "
                          f"(MoE layers: {', '.join(map(str, self.adapter.moe_layers))})")
        if not 0 <= expert < self.adapter.num_experts:
            raise invalid(f"expert {expert} does not exist: layer {layer} has experts 0..{self.adapter.num_experts - 1}")

    def held_weights(self, keys: Iterable[ExpertKey]) -> list[tuple[ExpertKey, ExpertWeights]]:
        """(key, weights) of those of `keys` held now."""
        weights = self._weights
        return [(key, weights[key]) for key in keys if key in weights]

    def held(self) -> list[ExpertKey]:
        return sorted(self._weights)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self._weights.values())

    @property
    def ready(self) -> bool:
        return self.bundle <= self._weights.keys()

    # -- changes (blocking: run them off the event loop) ----------------------------------------

    def load(self, keys: Iterable[ExpertKey]) -> tuple[int, float]:
        """Read the given experts not held yet; returns (bytes loaded, seconds)."""
        keys = list(dict.fromkeys(keys))
        for layer, expert in keys:
            self.check_in_model(layer, expert)
        start = time.perf_counter()
        with self._lock:
            self._loading = frozenset(keys) - self._weights.keys()
            replaced: list[weakref.ref] = []  # the tensors of the stacks this Load replaces
            self._cap(self.load_bytes(self._loading))
            try:
                if self.stacked:
                    for layer, experts in _by_layer(self._loading).items():
                        self._hold(layer, self._held_of(layer) | experts, replaced)
                else:
                    with self._on_load_stream():
                        new = {key: self._read(key) for key in self._loading}
                    self._ready_for_serving(*(t for w in new.values() for t in (w.gate_up, w.down)))
                    self._weights = {**self._weights, **new}
                loaded = sum(self._weights[key].nbytes for key in self._loading)
            except torch.OutOfMemoryError as e:  # what was held still serves; layers restacked before it keep theirs
                raise ExpertFnError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                    f"loading {format_bundle_spec(self._loading)} ran out of device memory beside the "
                    f"{self.nbytes >> 20} MiB of experts held (a Load holds each layer it changes twice meanwhile): "
                    "unload experts first, or put fewer functions on its GPU; "
                    f"{str(e).splitlines()[0]}")) from None
            finally:
                self._loading = frozenset()
                self._settle(give_back=False, replaced=replaced)
        return loaded, time.perf_counter() - start

    def unload(self, keys: Iterable[ExpertKey]) -> int:
        """Drop the given experts (those not held are ignored); returns their bytes (their slots may stay,
        for the layer's next Load: the module docstring)."""
        keys = set(keys)
        for layer, expert in keys:
            self.check_in_model(layer, expert)
        with self._lock:
            held = self._weights
            replaced: list[weakref.ref] = []  # the tensors of the stacks or experts this Unload drops
            gone = keys & held.keys()
            freed = sum(held[key].nbytes for key in gone)
            if self.stacked:
                left = {layer: self._held_of(layer) - experts for layer, experts in _by_layer(gone).items()}
                self._cap(self._new_bytes(left))
                for layer, experts in left.items():
                    self._hold(layer, experts, replaced)
            else:
                replaced.extend(weakref.ref(t) for key in gone for t in (held[key].gate_up, held[key].down))
                self._weights = {k: w for k, w in held.items() if k not in gone}
            del held
        if gone:
            self._settle(give_back=bool(replaced), replaced=replaced)  # nothing to give back where slots stay
        return freed

    def load_bytes(self, keys: Iterable[ExpertKey]) -> int:
        """What Loading `keys` allocates beside what is held."""
        layers = _by_layer(set(keys) - self._weights.keys())
        return self._new_bytes({layer: self._held_of(layer) | experts for layer, experts in layers.items()})

    def _new_bytes(self, layers: dict[int, set[int]]) -> int:
        """What a change allocates to hold `layers` (layer -> every expert it will hold of it) beside what is
        held: where stacked, a new stack of each layer that takes one (nothing where the slots do), else the
        experts not held; and while it reads experts from the checkpoint, READ_EXPERTS more."""
        read = sum(len(experts - self._held_of(layer)) for layer, experts in layers.items())
        reading = READ_EXPERTS * self.expert_bytes if read else 0
        if self.stacked:
            restacked = (experts for layer, experts in layers.items() if self._restacks(layer, experts))
            return sum(len(experts) for experts in restacked) * self.expert_bytes + reading
        return read * self.expert_bytes + reading

    @property
    def device_bytes(self) -> int:
        """What the experts held take on the device: their stacks, empty slots included."""
        return sum(s.nbytes for s in self._stacks.values()) if self.stacked else self.nbytes

    def _held_of(self, layer: int) -> set[int]:
        return {e for l, e in self._weights if l == layer}

    def _restacks(self, layer: int, experts: set[int]) -> bool:
        """Whether holding exactly `experts` of `layer` makes it a new stack: its stack has fewer reusable
        empty slots than the experts it adds, or would be left with more slots empty than held, or none."""
        stack = self._stacks.get(layer)
        if stack is None or not experts:
            return True
        adding = len(experts - stack.local.keys())
        return adding > len(stack.reusable()) or stack.experts.num_experts - len(experts) > len(experts)

    def _hold(self, layer: int, experts: set[int], replaced: list[weakref.ref]) -> None:
        """Hold exactly `experts` of `layer`: in its stack's slots where they do (the module docstring),
        else as a new stack."""
        if self._restacks(layer, experts):
            self._restack(layer, experts, replaced)
        else:
            self._reslot(layer, experts)

    def _reslot(self, layer: int, experts: set[int]) -> None:
        """Hold exactly `experts` of `layer` in its stack: the experts it adds read into reusable empty
        slots, the slots of those it drops emptied. The experts kept are untouched, views and all."""
        stack, held = self._stacks[layer], self._weights
        leaving = stack.local.keys() - experts
        adding = sorted(experts - stack.local.keys())
        slots = stack.reusable()[:len(adding)]
        if adding:
            if self._load_stream is not None:  # what this process queued on what those slots held (rounds on the
                torch.cuda.synchronize(self.device)  # serving stream, device links' steps on theirs) comes first
            with self._on_load_stream():
                for slot, expert in zip(slots, adding):
                    self._fill(stack.experts, slot, (layer, expert))
            self._ready_for_serving()
        emptied = {slot: readers for slot, readers in stack.emptied.items() if slot not in slots}
        emptied.update({stack.local[e]: (weakref.ref(stack), weakref.ref(held[(layer, e)])) for e in leaving})
        local = {e: slot for e, slot in stack.local.items() if e not in leaving} | dict(zip(adding, slots))
        weights = {k: w for k, w in held.items() if k[0] != layer or k[1] not in leaving}
        weights.update({(layer, e): stack.experts.expert(slot) for e, slot in zip(adding, slots)})
        replacement = LayerStack(stack.experts, local, emptied)
        stack.successor.append(replacement)
        # Each read alone is consistent: the new experts' slots are named once their weights are in
        self._stacks, self._weights = {**self._stacks, layer: replacement}, weights

    def _restack(self, layer: int, experts: set[int], replaced: list[weakref.ref]) -> None:
        """Hold exactly `experts` of `layer`, as a new stack: those held are copied from the old one, the
        others read from the checkpoint. Rounds meanwhile use the old stack; it goes once they are done
        (its tensors' weak references go into `replaced`, for the change's settling)."""
        ids = sorted(experts)
        held = self._weights
        stack = None
        if ids:
            with self._on_load_stream():
                stack = StackedExperts.empty(len(ids), self.adapter.hidden_size, self.adapter.expert_intermediate_size,
                                             self.dtype, self.device)
                for i, expert in enumerate(ids):
                    self._fill(stack, i, (layer, expert), held.get((layer, expert)))
            self._ready_for_serving(stack.gate_up, stack.down)
        weights = {k: w for k, w in held.items() if k[0] != layer}
        stacks = {k: s for k, s in self._stacks.items() if k != layer}
        old = self._stacks.get(layer)
        if old is not None:  # its views' bases: gone once no round holds one
            replaced.extend([weakref.ref(old.experts.gate_up), weakref.ref(old.experts.down)])
        if stack is not None:
            weights.update({(layer, e): stack.expert(i) for i, e in enumerate(ids)})
            stacks[layer] = LayerStack(stack, {e: i for i, e in enumerate(ids)})
        # Each read alone is consistent: a round takes a layer's experts from its stack, or from the weights
        self._stacks, self._weights = stacks, weights

    def _cap(self, changing: int = 0) -> None:
        """Cap the allocator at what the experts held take (device_bytes), or what it has allocated if that
        is more (a round still running on a stack a change replaced, its activations), plus `changing` bytes a
        change is about to allocate, plus the working memory (nothing without `working_bytes`). Never below what is allocated:
        every allocation of a round would fail until that came down (the H100's did, moeless_live.py)."""
        if self.working_bytes and self._serving is not None:
            held = max(self.device_bytes, torch.cuda.memory_allocated(self.device))
            cap_device_memory(self.device, held + changing + self.working_bytes)

    def _settle(self, give_back: bool, replaced: list[weakref.ref]) -> None:
        """Once the rounds queued by now, and any the host began before the change, are done with what it
        `replaced` (freed, or SETTLE_WAIT_S at most; not what an earlier change replaced, which something may
        still hold: a GPU test's finished event loop did, until a garbage collection), in the background:
        the cap comes down to what is held, and after an Unload (`give_back`) the device gets back what it
        dropped, for the other functions sharing the GPU (kubemoe.devices.cap_device_memory tells why).
        Not after a Load (its restack's old stack stays cached, for the next restack; under a cap it is
        freed as soon as an allocation needs the room): empty_cache() holds the allocator's lock while
        cudaFree waits for the whole device, so an allocation meanwhile, a Load's included, waits for the
        serving stream. A re-plan unloads last, after re-pointing."""
        if self._serving is None or not (give_back or self.working_bytes):
            return
        passed = torch.cuda.Event()
        passed.record(self._serving)

        def settle() -> None:
            passed.synchronize()
            deadline = time.monotonic() + SETTLE_WAIT_S  # rounds the host began on a replaced stack end soon
            while any(ref() is not None for ref in replaced) and time.monotonic() < deadline:
                time.sleep(0.01)
            with self._lock:  # not while the next change runs: its cap counts the stacks it makes
                self._cap()
            if give_back:
                empty_cache()  # not while a round captures a graph (kubemoe.devices.CAPTURING)

        threading.Thread(target=settle, name="settle", daemon=True).start()

    def _read(self, key: ExpertKey) -> ExpertWeights:
        """One expert from the checkpoint; on a GPU queued on the load stream (_ready_for_serving() them)."""
        return self.adapter.load_expert(self.checkpoint, *key, self.dtype, self.device, self._copy)

    def _fill(self, stack: StackedExperts, slot: int, key: ExpertKey, held: ExpertWeights | None = None) -> None:
        """Slot `slot` of `stack` <- expert `key`: copied from where it is `held`, else read from the
        checkpoint straight into the slot (no expert-sized tensor allocated on the device, nor copied there
        once more); on a GPU queued on the load stream."""
        if held is None:
            self.adapter.read_expert_into(self.checkpoint, *key, stack.expert(slot), self._copy)
        else:
            stack.expert(slot).copy_(held)

    def _on_load_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._load_stream) if self._load_stream is not None else contextlib.nullcontext()

    def _ready_for_serving(self, *tensors: torch.Tensor) -> None:
        """Wait for the load stream's copies into `tensors`, which the serving stream will read."""
        if self._load_stream is None or self._serving is None:
            return
        self._load_stream.synchronize()  # in before anyone can call it
        for tensor in tensors:
            # Allocated on the load stream, read on the serving one: once dropped, their memory is reused
            # only after the rounds queued on the serving stream by then are done with it.
            tensor.record_stream(self._serving)


def _by_layer(keys: Iterable[ExpertKey]) -> dict[int, set[int]]:
    layers: dict[int, set[int]] = {}
    for layer, expert in keys:
        layers.setdefault(layer, set()).add(expert)
    return layers
