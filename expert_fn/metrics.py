"""Prometheus metrics of one expert function, in a registry of its own.

A registry per server (not prometheus_client's global one) lets several servers live in one
process, as they do in tests and in the embedded mode. Names carry the `kubemoe_expert_fn_`
prefix; labels follow DESIGN.md (`bundle`, `layer`, `expert`).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kubemoe.bundles import ExpertKey

PREFIX = "kubemoe_expert_fn_"
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class ExpertFnMetrics:
    def __init__(self, bundle: str):
        self.registry = CollectorRegistry()
        self.bundle = bundle

        def make(kind, name, doc, labels=(), **kw):
            return kind(PREFIX + name, doc, ["bundle", *labels], registry=self.registry, **kw)

        self._calls = make(Counter, "calls", "RPCs handled, by method and status code", ("method", "code"))
        self._tokens = make(Counter, "tokens", "Tokens run through each expert", ("layer", "expert"))
        self._runs = make(Counter, "expert_runs", "Expert FFN invocations after micro-batching", ("layer", "expert"))
        self._rounds = make(Counter, "batches", "Micro-batch rounds run")
        self._compute = make(Histogram, "compute_seconds", "Expert FFN time per micro-batch round",
                             buckets=_LATENCY_BUCKETS)
        self._queue = make(Histogram, "queue_seconds", "Time a request waited to join a round",
                           buckets=_LATENCY_BUCKETS)
        self.queue_depth = make(Gauge, "queue_depth", "Requests waiting for a round").labels(bundle)
        self.bytes_loaded = make(Gauge, "bytes_loaded", "Bytes of expert weights held").labels(bundle)
        self.experts_held = make(Gauge, "experts_held", "Experts held").labels(bundle)
        # Where functions time-slice a GPU, what each keeps cached is what another's Load cannot have
        self.device_reserved = make(Gauge, "device_memory_reserved_bytes",
                                    "GPU memory this function's allocator holds, its cache included").labels(bundle)
        self.device_cap = make(Gauge, "device_memory_cap_bytes", "The most GPU memory its allocator may hold "
                               "(its experts' stacks plus --working-memory-mib); 0: no cap").labels(bundle)
        self._load = make(Histogram, "load_seconds", "Time to load experts from the checkpoint",
                          buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self._shm = make(Counter, "shared_memory_streams",
                         "ForwardStreams that offered a shared-memory segment, by outcome", ("result",))
        self._tcp = make(Counter, "tcp_lane_streams",
                         "ForwardStreams that offered a TCP lane where no shared memory attached, by outcome",
                         ("result",))
        self._per_key: dict[ExpertKey, tuple] = {}  # labelled children, looked up once per expert
        # labels() costs ~6 us a call: resolve the bundle-only children once.
        self._rounds, self._compute, self._queue, self._load = (
            m.labels(bundle) for m in (self._rounds, self._compute, self._queue, self._load))

    def call(self, method: str, code: str) -> None:
        self._calls.labels(self.bundle, method, code).inc()

    def round(self, tokens_per_key: dict[ExpertKey, int], compute_seconds: float, queue_seconds: list[float]) -> None:
        self._rounds.inc()
        self._compute.observe(compute_seconds)
        for seconds in queue_seconds:
            self._queue.observe(seconds)
        for key, tokens in tokens_per_key.items():
            children = self._per_key.get(key)
            if children is None:
                labels = (self.bundle, str(key[0]), str(key[1]))
                children = self._per_key[key] = (self._tokens.labels(*labels), self._runs.labels(*labels))
            children[0].inc(tokens)
            children[1].inc()

    def shared_memory(self, attached: bool) -> None:
        self._shm.labels(self.bundle, "attached" if attached else "refused").inc()

    def tcp_lane(self, opened: bool) -> None:
        self._tcp.labels(self.bundle, "opened" if opened else "refused").inc()

    def watch_device(self, reserved: Callable[[], float], cap: Callable[[], float]) -> None:
        """The device memory gauges read these at each scrape (a GPU's allocator: devices.py)."""
        self.device_reserved.set_function(reserved)
        self.device_cap.set_function(cap)

    def loaded(self, seconds: float, held_bytes: int, held_experts: int) -> None:
        self._load.observe(seconds)
        self.held(held_bytes, held_experts)

    def held(self, held_bytes: int, held_experts: int) -> None:
        self.bytes_loaded.set(held_bytes)
        self.experts_held.set(held_experts)

    def value(self, name: str, **labels) -> float:
        """A sample's current value (0 when absent): for tests and the benchmark."""
        return self.registry.get_sample_value(PREFIX + name, {"bundle": self.bundle, **labels}) or 0.0

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics on `port` (0: any free port) in a daemon thread; returns the port."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
