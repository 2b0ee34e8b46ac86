"""A real Kubernetes control plane for tests and demos: etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and kwok (fake GPU nodes), built from the Go module proxy and cached.

Standalone on purpose: stdlib, the `kubernetes` client and the stdlib-only `kubemoe.net`; no other kubemoe module.
"""

from .cluster import (Cluster, ClusterConfig, ClusterError, GpuSharing, gpu_device_class, gpu_node,
                      gpu_resource_slice, wait_for)
from .testbin import Testbin, ensure_testbin, find_testbin

__all__ = ["Cluster", "ClusterConfig", "ClusterError", "GpuSharing", "Testbin", "ensure_testbin", "find_testbin", "gpu_device_class",
           "gpu_node", "gpu_resource_slice", "wait_for"]
