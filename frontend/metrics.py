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
        self.expert_retries = Counter("kubemoe_frontend_expert_retries", "Expert calls retried on another replica",
                                      ["bundle"], registry=r)
        self._deployment = d["deployment"]

    def record_expert_tokens(self, layer: int, expert_counts: list[tuple[int, int]], predicted: bool = False) -> None:
        counter = self.expert_predicted_tokens if predicted else self.expert_tokens
        for expert, count in expert_counts:
            if count:
                counter.labels(self._deployment, str(layer), str(expert)).inc(count)

    def record_predictor_accuracy(self, layer: int, accuracy: float) -> None:
        self.predictor_accuracy.labels(self._deployment, str(layer)).set(accuracy)

    def record_predictor_refresh(self, layer: int) -> None:
        self.predictor_refreshes.labels(self._deployment, str(layer)).inc()
