"""Routing records: the hidden states entering each MoE layer and the experts its router chose.

They are the training data of the expert-load predictors (MoEless's speculative predictor here,
LayerScope's LLaPor on the offload path). A frontend records them while serving when asked
(`--record-routing DIR`, off by default, bounded by `--record-max-mb`); `kubemoe predictor collect`
drives a checkpoint over a text file with the same recorder.

A records folder holds safetensors shards `routing-NNNNN.safetensors`, each with, per token row:
  hidden   [N, L, H]  the router's input at each MoE layer (the model's dtype)
  experts  [N, L, K]  int32, the experts chosen, ascending per token
  weights  [N, L, K]  float32, their routing weights
  request  [N]        int64, the request the row belongs to (numbered from 0 in recording order)
  position [N]        int32, the row's position in its request
and, in its metadata, the model's shape (`ModelShape`): records only train predictors of a model
of the same shape. Rows of one forward pass are aligned across layers, which is what lets layer l's
hidden state be paired with layer l+d's choice. Shapes: N = rows, L = MoE layers, H = hidden size,
K = experts per token, T = tokens of one forward pass.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kubemoe.errors import KubemoeError
from kubemoe.frontend.model_shape import ModelShape

log = logging.getLogger(__name__)

RECORDS_FORMAT = "kubemoe.routing-records/1"
SHARD_GLOB = "routing-*.safetensors"


@dataclass(frozen=True)
class ForwardRows:
    """Whose rows one forward pass computes: sequence i has `lengths[i]` rows from `positions[i]` on."""

    requests: tuple[str, ...]
    positions: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class _Pass:  # one forward pass in progress on one thread
    rows: ForwardRows | None
    hidden: list[torch.Tensor] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)


class RoutingRecorder:
    """Writes routing records of every forward pass until `max_bytes` are written, then stops."""

    def __init__(self, out: Path, shape: ModelShape, model: str, max_bytes: int, shard_bytes: int = 64 << 20):
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.out, self.shape, self.model = Path(out), shape, model
        self.max_bytes, self.shard_bytes = max_bytes, min(shard_bytes, max_bytes)
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.glob(SHARD_GLOB)):
            raise KubemoeError(f"{self.out} already holds routing records; choose an empty folder")
        self._local = threading.local()  # the pass in progress, per thread that runs passes
        self._lock = threading.Lock()
        self._rows: list[dict[str, torch.Tensor]] = []
        self._buffered = 0
        self.written_bytes = 0
        self.rows_written = 0
        self.shards = 0
        self.full = False
        self._request_numbers: dict[str, int] = {}

    @property
    def requests_seen(self) -> int:
        return len(self._request_numbers)

    # -- what the engine and the dispatcher call -------------------------------------------------

    def start_forward(self, rows: ForwardRows | None) -> None:
        self._local.current = _Pass(rows)

    def on_layer(self, layer: int, hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> None:
        if self.full:
            return
        current: _Pass | None = getattr(self._local, "current", None)
        if current is None or layer == self.shape.moe_layers[0]:
            current = self._local.current = _Pass(current.rows if current and not current.hidden else None)
        experts, order = experts.detach().sort(-1)  # routers give them in score order; records keep ids ascending
        current.hidden.append(hidden.detach().to("cpu"))
        current.experts.append(experts.to("cpu", torch.int32))
        current.weights.append(weights.detach().gather(-1, order).to("cpu", torch.float32))
        if layer == self.shape.moe_layers[-1]:
            self._local.current = None
            if len(current.hidden) == len(self.shape.moe_layers):
                self._add(current)

    def close(self) -> None:
        with self._lock:
            self._flush()

    # -- buffering and shards --------------------------------------------------------------------

    def _add(self, done: _Pass) -> None:
        tokens = done.hidden[0].shape[0]
        rows = {"hidden": torch.stack(done.hidden, 1), "experts": torch.stack(done.experts, 1),
                "weights": torch.stack(done.weights, 1)}
        with self._lock:  # whichever thread finishes a pass: request numbers are taken in turn
            rows.update(self._row_ids(done.rows, tokens))
            size = sum(t.nbytes for t in rows.values())
            if self.written_bytes + self._buffered + size > self.max_bytes:
                self.full = True
                self._flush()
                log.warning("routing records in %s reached their limit (%d MiB, %d rows); recording stopped",
                            self.out, self.max_bytes >> 20, self.rows_written)
                return
            self._rows.append(rows)
            self._buffered += size
            if self._buffered >= self.shard_bytes:
                self._flush()

    def _row_ids(self, rows: ForwardRows | None, tokens: int) -> dict[str, torch.Tensor]:
        if rows is None or rows.tokens != tokens:  # a pass nobody described: one request of its own
            rows = ForwardRows((f"unnamed-{len(self._request_numbers)}",), (0,), (tokens,))
        request: list[int] = []
        position: list[int] = []
        for rid, start, n in zip(rows.requests, rows.positions, rows.lengths):
            number = self._request_numbers.setdefault(rid, len(self._request_numbers))
            request += [number] * n
            position += range(start, start + n)
        return {"request": torch.tensor(request, dtype=torch.int64), "position": torch.tensor(position, dtype=torch.int32)}

    def _flush(self) -> None:
        if not self._rows:
            return
        tensors = {k: torch.cat([r[k] for r in self._rows]) for k in self._rows[0]}
        path = self.out / f"routing-{self.shards:05d}.safetensors"
        save_file(tensors, path, metadata={"format": RECORDS_FORMAT, "model": self.model, **self.shape.to_metadata()})
        self.shards += 1
        self.written_bytes += self._buffered
        self.rows_written += len(tensors["request"])
        self._rows, self._buffered = [], 0


@dataclass(frozen=True)
class RoutingRecords:
    """Records read back (all shards of a folder, concatenated)."""

    shape: ModelShape
    model: str
    hidden: torch.Tensor  # [N, L, H]
    experts: torch.Tensor  # [N, L, K] int64
    weights: torch.Tensor  # [N, L, K]
    request: torch.Tensor  # [N]
    position: torch.Tensor  # [N]

    def __len__(self) -> int:
        return len(self.request)

    def layer_index(self, layer: int) -> int:
        """The column of MoE layer `layer` in hidden/experts/weights."""
        return self.shape.moe_layers.index(layer)

    def expert_counts(self) -> torch.Tensor:  # -> [L, E] int64: tokens each expert of each MoE layer got
        e = self.shape.num_experts
        return torch.stack([torch.bincount(self.experts[:, i].reshape(-1), minlength=e) for i in range(self.experts.shape[1])])

    def select(self, mask: torch.Tensor) -> "RoutingRecords":
        return RoutingRecords(self.shape, self.model, self.hidden[mask], self.experts[mask], self.weights[mask],
                              self.request[mask], self.position[mask])

    def split(self, train_fraction: float = 0.8) -> tuple["RoutingRecords", "RoutingRecords"]:
        """(first requests, last requests): whole requests on each side, so no text is seen twice."""
        requests = self.request.unique()
        cut = requests[min(len(requests) - 1, max(1, int(len(requests) * train_fraction)))]
        if len(requests) < 2:
            raise KubemoeError("the records hold a single request: collect more text to train and evaluate on")
        return self.select(self.request < cut), self.select(self.request >= cut)

    @classmethod
    def load(cls, folder: str | Path, expect: ModelShape | None = None) -> "RoutingRecords":
        folder = Path(folder)
        shards = sorted(folder.glob(SHARD_GLOB))
        if not shards:
            raise KubemoeError(f"{folder} holds no routing records ({SHARD_GLOB}); write some with "
                               "`kubemoe predictor collect` or a frontend's --record-routing")
        parts: dict[str, list[torch.Tensor]] = {}
        with safe_open(shards[0], framework="pt") as f:
            shape, model = _header(f.metadata(), shards[0])  # every shard must match the first
        for path in shards:
            with safe_open(path, framework="pt") as f:
                this, model = _header(f.metadata(), path)
                if this != shape:
                    raise KubemoeError(f"{folder} mixes records of two models ({path.name} differs); keep one model's per folder")
                for key in f.keys():
                    parts.setdefault(key, []).append(f.get_tensor(key))
        if expect is not None:
            expect.check(shape, f"the routing records in {folder}", "collect records with this checkpoint "
                                                                     "(`kubemoe predictor collect --checkpoint ...`)")
        t = {k: torch.cat(v) for k, v in parts.items()}
        return cls(shape, model, t["hidden"], t["experts"].long(), t["weights"], t["request"], t["position"])


def _header(metadata: dict[str, str] | None, path: Path) -> tuple[ModelShape, str]:  # -> (shape, model name)
    """A shard's model shape and model name, from its safetensors metadata."""
    meta = metadata or {}
    if meta.get("format") != RECORDS_FORMAT:
        raise KubemoeError(f"{path} is not a kubemoe routing record (format {meta.get('format')!r})")
    return ModelShape.from_metadata(meta, path), meta.get("model", "")
