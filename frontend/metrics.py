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
        self.expert_retries = Counter("kubemoe_frontend_expert_retries", "Expert calls retried on another replica",
                                      ["bundle"], registry=r)
        self._deployment = d["deployment"]

    def record_expert_tokens(self, layer: int, expert_counts: list[tuple[int, int]]) -> None:
        for expert, count in expert_counts:
            self.expert_tokens.labels(self._deployment, str(layer), str(expert)).inc(count)
