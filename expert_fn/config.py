"""The expert function's configuration: one frozen object, built once from flags, passed down whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kubemoe import ports
from kubemoe.adapters import MoEAdapter
from kubemoe.bundles import ExpertKey, format_bundle_spec, parse_bundle_spec
from kubemoe.checkpoint import Checkpoint, default_model_id
from kubemoe.devices import resolve_device, resolve_dtype
from kubemoe.errors import KubemoeError
from kubemoe.expert_fn.graphs import DEFAULT_MAX_TOKENS as DEFAULT_GRAPH_TOKENS
from kubemoe.expert_fn.transport import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class ExpertFnConfig:
    checkpoint: Path
    bundle: tuple[ExpertKey, ...]  # the (layer, expert) pairs this function loads at start
    model: str  # model id requests must name; defaults to the checkpoint folder's name
    device: torch.device
    dtype: torch.dtype  # weights and compute; requests in another dtype are converted
    host: str = "0.0.0.0"
    port: int = ports.EXPERT_GRPC
    metrics_port: int | None = ports.EXPERT_METRICS  # None: no HTTP metrics endpoint
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # How long a micro-batch waits for more requests, and only under concurrency (see batcher.py).
    batch_wait_ms: float = 0.5
    max_batch_tokens: int = 8192  # a batch stops waiting once it holds this many tokens
    # On a GPU, an expert's call of up to this many tokens replays a CUDA graph (graphs.py); 0: never.
    cuda_graph_tokens: int = DEFAULT_GRAPH_TOKENS
    # A round runs a layer's experts as one grouped computation from this many of them (batcher.py); fewer
    # run one graph each. On the H200 (dispatch_calls at 5cbc93c) grouping 2 Mixtral experts cost more than
    # their 2 graphs (5.4 against 4.6 ms a layer at 32 tokens) and grouping ~32 Qwen3-30B-A3B experts a
    # third of their graphs (8.8 against 25.9); 8 lies between, not measured.
    group_min_experts: int = 8
    grace_seconds: float = 25.0  # below Knative's default 30 s terminationGracePeriod
    # A tmpfs folder shared with same-node frontends (see shm.py); None: tensors always travel inline.
    shm_dir: Path | None = None
    # Where frontends without that folder connect a TCP lane (frames.py): a port (0: any free one) and
    # the address to advertise (a pod's IP; None: the host the frontend dialled). None: no TCP lanes.
    data_port: int | None = None
    data_host: str | None = None
    # Follow the routing table (a file, or a ConfigMap `namespace/name`) and hold, besides the bundle,
    # what it sends to `address` (follow.py); None: the bundle only.
    routing_table: str | None = None
    routing_configmap: str | None = None
    address: str | None = None
    drop_after: float = 30.0  # seconds an expert the table no longer sends here stays loaded
    # On a GPU, the allocator is capped at the experts held plus this (store.py); 0: no cap.
    working_memory_bytes: int = 0
    arch: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if (self.routing_table or self.routing_configmap) and not self.address:
            raise KubemoeError("following the routing table needs --address: how the table names this expert "
                               "function (host:port), so it knows which experts are its own")
        if self.working_memory_bytes < 0:
            raise KubemoeError(f"--working-memory-mib must be 0 (no cap) or more, got {self.working_memory_bytes >> 20}")
        if self.routing_configmap and self.routing_configmap.count("/") != 1:
            raise KubemoeError(f"--routing-configmap must be NAMESPACE/NAME, got {self.routing_configmap!r}")

    @property
    def bundle_spec(self) -> str:
        """The bundle in canonical spec form, e.g. `1:0-3;3:0-7`; names the bundle in metrics and errors."""
        return format_bundle_spec(self.bundle)

    @classmethod
    def build(
        cls,
        checkpoint: str | Path,
        bundle: str = "*",
        *,
        model: str | None = None,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        **settings,
    ) -> "ExpertFnConfig":
        """Resolve defaults against the checkpoint: bundle spec -> keys, device `auto`, dtype, model id."""
        ckpt = Checkpoint(checkpoint)
        adapter = MoEAdapter(ckpt.config)
        try:
            keys = parse_bundle_spec(bundle, adapter.moe_layers, adapter.num_experts)
        except ValueError as e:
            raise KubemoeError(f"bad --bundle: {e}") from None
        return cls(
            checkpoint=ckpt.path,
            bundle=keys,
            model=model or default_model_id(ckpt.path),
            device=resolve_device(device),
            dtype=resolve_dtype(dtype, ckpt.config),
            arch=adapter.arch.name,
            **settings,
        )
