"""The ports kubemoe's processes listen on in a pod: one contract between the operator, which renders
them into pods, Services and arguments, and the processes, whose CLI defaults they are.

Knative's queue-proxy runs beside the user container in every pod of a Knative Service and owns the
ports in `KNATIVE_RESERVED`; a container that binds one of them fails to start (or, for a metrics port,
silently fights the queue-proxy), so nothing kubemoe binds in a pod may be among them.
"""

from __future__ import annotations

FRONTEND_HTTP = 8000     # OpenAI-compatible HTTP API, /readyz, /healthz
FRONTEND_GRPC = 50051    # Generate over gRPC
EXPERT_GRPC = 8080       # the expert function's gRPC service (Knative's h2c container port)
EXPERT_METRICS = 9095    # the expert function's Prometheus /metrics (not a container port: Knative allows one)
# The expert function's TCP lanes (expert_fn/frames.py): frontends reach it at the pod's IP, which the
# stream's metadata names, not through a Service, so it need not be a container port either.
EXPERT_DATA = 9096

# queue-proxy: 8012 http, 8013 h2c, 8022 admin, 9090 autoscaler metrics, 9091 user metrics;
# 8008: its profiling endpoint when profiling is enabled.
KNATIVE_RESERVED = frozenset({8008, 8012, 8013, 8022, 9090, 9091})

assert not {FRONTEND_HTTP, FRONTEND_GRPC, EXPERT_GRPC, EXPERT_METRICS, EXPERT_DATA} & KNATIVE_RESERVED
