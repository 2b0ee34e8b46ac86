"""Prometheus metrics of a frontend, in a registry of its own (several frontends can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class FrontendMetrics:
    def __init__(self, deployment: str):
        self.registry = CollectorRegistry()
        r, d = self.registry, {"deployment": deployment}
        self.requests = Counter("kubemoe_frontend_requests", "Requests by API and outcome", ["api", "status"], registry=r)
        self.prompt_tokens = Counter("kubemoe_frontend_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("kubemoe_frontend_completion_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("kubemoe_frontend_queue_depth", "Requests waiting to join the batch", registry=r)
        self.ttft = Histogram("kubemoe_frontend_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.kv_cache_used_bytes = Gauge("kubemoe_frontend_kv_cache_used_bytes",
                                         "KV cache the running batch holds (padded positions x bytes per token)", registry=r)
        self.kv_cache_budget_bytes = Gauge("kubemoe_frontend_kv_cache_budget_bytes",
                                           "KV cache budget (unset while unbounded)", registry=r)
        self.preemptions = Counter("kubemoe_frontend_preemptions", "Sequences that left the batch for lack of KV "
                                   "cache and were prefilled again later (recompute)", registry=r)
        self.prefill_chunks = Counter("kubemoe_frontend_prefill_chunks", "Prompt chunks prefilled (a prompt longer "
                                      "than a step's token budget, --max-step-tokens, takes several)", registry=r)
        self.expert_tokens = Counter("kubemoe_expert_tokens", "Tokens routed to each expert",
                                     ["deployment", "layer", "expert"], registry=r)
        self.expert_predicted_tokens = Counter(
            "kubemoe_expert_predicted_tokens", "Tokens the load predictor said each expert would get",
            ["deployment", "layer", "expert"], registry=r)
        self.predictor_accuracy = Gauge(
            "kubemoe_predictor_accuracy", "Top-k set accuracy of the load predictor per layer over its last window",
            ["deployment", "layer"], registry=r)
        self.predictor_refreshes = Counter(
            "kubemoe_predictor_refreshes", "Online refreshes of a layer's predictor that were kept",
            ["deployment", "layer"], registry=r)
        self.expert_calls = Counter("kubemoe_frontend_expert_calls", "Calls to expert functions, retries included "
                                    "(one per function and MoE layer of a step, whichever bundles it serves)", registry=r)
        self.expert_parts = Counter("kubemoe_frontend_expert_parts", "Experts' tokens sent to expert functions, one "
                                    "per expert and call (retries included): more than the experts called where a hot "
                                    "expert's tokens are split over its replicas", registry=r)
        # Pay-per-use cost, as serverless platforms (and MoEless) bill: x an expert's bytes, GPU memory x time
        self.expert_busy_seconds = Counter(
            "kubemoe_frontend_expert_busy_seconds", "Expert functions' time on this frontend's calls as each reports "
            "it (request in to reply out), once per expert the call ran (steps over device links not included)",
            registry=r)
        self.expert_retries = Counter("kubemoe_frontend_expert_retries", "Expert calls retried on another replica",
                                      ["bundle"], registry=r)
        self.linked_steps = Counter("kubemoe_frontend_linked_steps", "Decode steps handed to expert functions on "
                                    "this GPU through device links, by outcome (ok; void: run again as calls)",
                                    ["outcome"], registry=r)
        # The offload path (frontend/offload/executor.py): where each activated expert ran and what was copied.
        # Hit rate = (resident + prefetched) / all experts; prefetch accuracy = prefetches used / prefetches.
        self.offload_experts = Counter(
            "kubemoe_offload_experts", "Activated experts by where they ran: resident (hot table) or prefetched on "
            "the GPU, loaded on demand to the GPU, or computed on the CPU", ["deployment", "where"], registry=r)
        self.offload_prefetches = Counter("kubemoe_offload_prefetches", "Experts prefetched (outcome issued) and, of "
                                          "those, used by their layer (outcome used)", ["deployment", "outcome"], registry=r)
        self.offload_bytes_copied = Counter("kubemoe_offload_copied_bytes", "Expert bytes copied host to GPU",
                                            ["deployment", "kind"], registry=r)
        self.offload_expert_tokens = Counter("kubemoe_offload_expert_tokens", "Expert-token work by side (gpu, cpu)",
                                             ["deployment", "side"], registry=r)
        # Against the layers' time: a large cpu_wait is a CPU side that holds up the GPU; a large decide, the policy.
        self.offload_host_seconds = Counter(
            "kubemoe_offload_host_seconds", "Host wall time of the offload layers (phase layers), of that in the "
            "lookahead and policy (decide) and blocked on CPU experts (cpu_wait)", ["deployment", "phase"], registry=r)
        self._deployment = d["deployment"]

    def record_expert_tokens(self, layer: int, expert_counts: list[tuple[int, int]], predicted: bool = False) -> None:
        counter = self.expert_predicted_tokens if predicted else self.expert_tokens
        for expert, count in expert_counts:
            if count:
                counter.labels(self._deployment, str(layer), str(expert)).inc(count)

    def record_predictor_accuracy(self, layer: int, accuracy: float) -> None:
        self.predictor_accuracy.labels(self._deployment, str(layer)).set(accuracy)

    def record_offload(self, stats, seconds) -> None:
        """One MoE layer's `OffloadStats` and `OffloadSeconds`."""
        d = self._deployment
        for phase, value in vars(seconds).items():
            self.offload_host_seconds.labels(d, phase).inc(value)
        prefetched_used = stats.prefetch_used
        for where, count in (("resident", stats.hits - prefetched_used), ("prefetched", prefetched_used),
                             ("loaded", stats.loaded), ("cpu", stats.cpu_experts)):
            if count:
                self.offload_experts.labels(d, where).inc(count)
        if stats.prefetched:
            self.offload_prefetches.labels(d, "issued").inc(stats.prefetched)
        if prefetched_used:
            self.offload_prefetches.labels(d, "used").inc(prefetched_used)
        per_copy = stats.bytes_copied // max(stats.loaded + stats.prefetched, 1)
        for kind, count in (("load", stats.loaded), ("prefetch", stats.prefetched)):
            if count:
                self.offload_bytes_copied.labels(d, kind).inc(count * per_copy)
        for side, tokens in (("gpu", stats.gpu_tokens), ("cpu", stats.cpu_tokens)):
            if tokens:
                self.offload_expert_tokens.labels(d, side).inc(tokens)

    def record_predictor_refresh(self, layer: int) -> None:
        self.predictor_refreshes.labels(self._deployment, str(layer)).inc()
