"""A frontend assembled from its config: checkpoint, model shell, dispatcher, engine, routing watch."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from kubemoe.adapters import MoEAdapter
from kubemoe.busy_poll import SHARED_CORES_BUSY_POLL_US
from kubemoe.checkpoint import Checkpoint, default_model_id
from kubemoe.devices import resolve_device, resolve_dtype, serving_attention
from kubemoe.frontend.compiled import CompiledDecode
from kubemoe.frontend.dispatch import DispatchConfig, Dispatcher
from kubemoe.frontend.engine import Engine
from kubemoe.frontend.graphs import DecodeGraphs
from kubemoe.frontend.kv_cache import KVCacheConfig
from kubemoe.frontend.loads import LoadRecorder
from kubemoe.frontend.metrics import FrontendMetrics
from kubemoe.frontend.offload.config import OffloadConfig
from kubemoe.frontend.prediction import OnlinePredictor, RefreshConfig
from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.frontend.model_shape import ModelShape
from kubemoe.frontend.records import RoutingRecorder
from kubemoe.routing_watch import watch_configmap, watch_file
from kubemoe.bundles import bundles_by_count
from kubemoe.routing_table import LOCAL, RoutingTableError, build_route_map, table_for_bundles
from kubemoe.frontend.scheduler import DEFAULT_STEP_TOKENS, SchedulerConfig
from kubemoe.proto import kubemoe_pb2 as pb

log = logging.getLogger(__name__)

NOT_READY = "the frontend has no routing table yet, so no expert can run; retry in a few seconds"


@dataclass(frozen=True)
class FrontendConfig:
    checkpoint: Path
    model: str = ""  # model id clients send; default: the checkpoint folder's name
    name: str = ""  # this frontend in load reports; default: the host name (a pod's name in Kubernetes)
    routing_table: Path | None = None  # a file (JSON RoutingTable), or ...
    routing_configmap: str | None = None  # ... NAMESPACE/NAME of a ConfigMap with key routing.json
    dtype: str | None = None  # default: the checkpoint's
    device: str = "auto"
    max_batch: int = 32
    max_waiting: int = 256
    max_step_tokens: int | None = None  # tokens one engine step computes (decode + prompt chunks); None: by device
    cuda_graphs: bool = True  # on a GPU, decode passes replayed as CUDA graphs (graphs.py; not in offload mode)
    lookahead: bool = True  # on a GPU with every expert here, a greedy batch's next pass launched ahead (engine.py)
    compile: bool = False  # decode passes through torch.compile, norms, rotary and routers fused (compiled.py)
    kv_cache_bytes: int | None = None  # the KV cache's budget; None: a fraction of free GPU memory, unbounded on CPU
    kv_cache_fraction: float = 0.9  # see frontend/kv_cache.py
    load_window_seconds: float = 30.0
    streaming: bool = True
    call_timeout: float = 30.0
    split_min_tokens: int = 64  # smallest part of an expert's tokens sent to a replica of its own (dispatch.py)
    shm_dir: Path | None = None  # see DispatchConfig
    device_links: bool = True  # see DispatchConfig
    busy_poll_us: float = SHARED_CORES_BUSY_POLL_US  # see DispatchConfig
    predictor: str = "router"  # "router" (the next layers' routers), "none", or a file from `kubemoe predictor train`
    prediction_distance: int = 1  # predict MoE layer l+d at layer l
    predictor_refresh: bool = True  # fine-tune layers online when their accuracy drops (prediction.py)
    record_routing: Path | None = None  # write routing records here (records.py); None: off
    record_max_mb: int = 1024
    offload: OffloadConfig | None = None  # offload mode: every local expert from host memory through a GPU cache

    @property
    def model_id(self) -> str:
        return self.model or default_model_id(self.checkpoint)


class Frontend:
    def __init__(self, config: FrontendConfig):
        from transformers import AutoTokenizer, GenerationConfig

        self.config = config
        self.checkpoint = Checkpoint(config.checkpoint)
        self.adapter = MoEAdapter(self.checkpoint.config)
        self.device = resolve_device(config.device)
        serving_attention(self.device)
        self.dtype = resolve_dtype(config.dtype, self.checkpoint.config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint.path)
        self.metrics = FrontendMetrics(config.model_id)
        self.loads = LoadRecorder(config.model_id, config.name or socket.gethostname(), config.load_window_seconds)
        self.dispatcher = Dispatcher(
            self.adapter, self.checkpoint,
            DispatchConfig(config.model_id, config.streaming, config.call_timeout, shm_dir=config.shm_dir,
                           busy_poll_us=config.busy_poll_us, split_min_tokens=config.split_min_tokens,
                           device_links=config.device_links),
            self.loads, self.dtype, self.device, self.metrics)
        self.offload = None
        if config.offload:
            self.offload = self.dispatcher.offload = self._start_offload(config.offload)
        self.predictor_problem: str | None = None
        self.online_predictor = self._start_predictor()
        self.recorder = None
        if config.record_routing:
            self.recorder = RoutingRecorder(config.record_routing, ModelShape.of(self.adapter), config.model_id,
                                            config.record_max_mb << 20)
            self.dispatcher.observers.append(self.recorder)
        from kubemoe.frontend.shell import build_shell

        self.model = build_shell(self.checkpoint, self.adapter, self.dispatcher.layer_module, self.dtype, self.device)
        # What decode passes call (graph programs and eager passes alike); prefill calls the model itself.
        self.decode_model = CompiledDecode(self.model) if config.compile else self.model
        eos = GenerationConfig.from_pretrained(self.checkpoint.path).eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.max_context = self.checkpoint.config.max_position_embeddings
        step_tokens = config.max_step_tokens or DEFAULT_STEP_TOKENS.get(self.device.type, DEFAULT_STEP_TOKENS["cpu"])
        self.engine = Engine(self.model, self.tokenizer, eos_ids, self.max_context,
                             SchedulerConfig(config.max_batch, config.max_waiting, step_tokens),
                             before_step=self.dispatcher.before_step, metrics=self.metrics, loads=self.loads,
                             kv_cache=KVCacheConfig(config.kv_cache_bytes, config.kv_cache_fraction),
                             on_forward=self.recorder.start_forward if self.recorder else None,
                             graphs=self._decode_graphs(), decode_model=self.decode_model,
                             lookahead=(lambda: self.dispatcher.launches_ahead)
                             if config.lookahead and self.device.type == "cuda" else None)
        self._watch: asyncio.Task | None = None
        if self.offload and not (config.routing_table or config.routing_configmap):
            # Offload mode alone: every expert runs here. (The operator renders that table in a ConfigMap.)
            bundles = bundles_by_count(self.adapter.moe_layers, self.adapter.num_experts, 1)
            self.set_routing_table(table_for_bundles(self.model_id, bundles, {b.name: [LOCAL] for b in bundles}))

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs where they apply: on a GPU, experts not offloaded (the offload executor's streams
        and copies are decided on the host per layer)."""
        config = self.config
        if not config.cuda_graphs or self.device.type != "cuda" or self.offload:
            return None
        return DecodeGraphs(self.decode_model, lambda: self.dispatcher.generation, links=self.dispatcher.link_step)

    def _start_offload(self, offload: OffloadConfig):
        """The offload executor; bad settings (budget, predictor of another model) stop the start with a message."""
        from kubemoe.frontend.offload.lookahead import load_lookahead
        from kubemoe.frontend.offload.runtime import build_executor, check_budget, prefetch_slots_of
        from kubemoe.frontend.offload.store import HostExperts

        # Settings first, before minutes of reading expert weights.
        check_budget(offload, self.adapter.expert_bytes(self.dtype),
                     prefetch_slots_of(offload, self.adapter.num_experts, self.adapter.top_k), self.device)
        lookahead = load_lookahead(offload.predictor, self.adapter, self.checkpoint, self.device)

        def on_layer(stats, seconds) -> None:
            self.metrics.record_offload(stats, seconds)
            self.loads.record_offload(stats)

        host = HostExperts(self.adapter.moe_layers, self.adapter.num_experts, self.adapter.hidden_size,
                           self.adapter.expert_intermediate_size, self.dtype,
                           lambda layer, expert: self.adapter.load_expert(self.checkpoint, layer, expert, self.dtype),
                           pin_memory=self.device.type == "cuda")
        try:
            executor = build_executor(offload, host, self.adapter.top_k, self.device, self.adapter.act,
                                      self.adapter.routing.weight_on_input, lookahead, on_layer=on_layer)
        except BaseException:
            host.close()
            raise
        self.loads.offload_policy = executor.policy.name
        return executor

    def _start_predictor(self) -> OnlinePredictor | None:
        """The load predictor, or None; a predictor that cannot load leaves the frontend serving without one."""
        choice = self.config.predictor
        if choice == "none":
            return None
        try:
            if choice == "router":
                predictor = LoadPredictor.from_routers(self.adapter, self.checkpoint, self.config.prediction_distance)
            else:
                predictor = LoadPredictor.load(choice, self.adapter, self.config.prediction_distance)
        except Exception as e:  # noqa: BLE001 - any failure here must leave serving untouched
            self.predictor_problem = f"no load predictions: {e}"
            log.error("the load predictor did not load, serving without predictions: %s", e)
            return None
        online = OnlinePredictor(predictor, self.loads, self.metrics,
                                 RefreshConfig() if self.config.predictor_refresh else None, self.device)
        self.dispatcher.observers.append(online)
        self.dispatcher.predictions = online  # how many replicas a hot expert's tokens are split across
        log.info("load predictor: %s, %d MoE layers ahead, %d parameters", predictor.kind, predictor.distance,
                 predictor.parameters_count())
        return online

    def readiness(self) -> dict:
        """What /readyz says beside ready or not: the load predictor's state, and the offload path's."""
        if self.online_predictor:
            p = self.online_predictor.predictor
            details = {"predictor": {"kind": p.kind, "distance": p.distance}}
        else:
            details = {"predictor": {"kind": "none",
                                     **({"problem": self.predictor_problem} if self.predictor_problem else {})}}
        if self.offload:
            details["offload"] = {"policy": self.offload.policy.name, "lookahead": self.offload.lookahead.name,
                                  "lookahead_source": self.offload.lookahead.source,
                                  "resident_experts": len(self.offload.resident_slot),
                                  "pinned": self.offload.store.pinned}
        return details

    @property
    def model_id(self) -> str:
        return self.config.model_id

    @property
    def ready(self) -> bool:
        return self.dispatcher.ready

    def set_routing_table(self, table: pb.RoutingTable) -> None:
        """Validate a table and hand it to the dispatcher; raises RoutingTableError."""
        self.dispatcher.set_routes(build_route_map(table, self.model_id, self.adapter.moe_layers, self.adapter.num_experts))

    async def _on_table(self, table: pb.RoutingTable) -> None:
        try:
            self.set_routing_table(table)
        except RoutingTableError as e:
            log.error("routing table version %d rejected: %s", table.version, e)

    def start_watching(self) -> None:
        """Follow the configured routing table source (call from the serving event loop)."""
        if self.config.routing_table:
            self._watch = asyncio.create_task(watch_file(Path(self.config.routing_table), self._on_table))
        elif self.config.routing_configmap:
            namespace, _, name = self.config.routing_configmap.partition("/")
            self._watch = asyncio.create_task(watch_configmap(namespace, name, self._on_table))

    def close(self) -> None:
        if self._watch:
            self._watch.cancel()
        self.engine.stop()
        self.dispatcher.close()
        if self.offload:
            self.offload.close()
            self.offload.store.host.close()
        if self.online_predictor:
            self.online_predictor.close()
        if self.recorder:
            self.recorder.close()
