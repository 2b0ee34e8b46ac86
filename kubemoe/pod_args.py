"""The command lines of kubemoe's pods, defined once: the operator renders them into the expert-function
and frontend containers, and `kubemoe expert-fn` / `kubemoe frontend` parse them.

Each field is the click parameter of the same name in the command (flag `--field-name`), so the two
sides cannot name an argument differently: tests/unit/test_pod_args.py parses every command line built
here with the real commands, and tests/operator/test_rendered_pods_cluster.py starts the processes the
operator rendered on a control plane and serves a request through them. The ports come from
`kubemoe/ports.py`, the offload settings travel as environment (`kubemoe/offload_env.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from kubemoe import ports

# Environment the pods get from the downward API (the kubelet resolves them; $(NAME) in args expands them).
POD_IP_ENV = "POD_IP"
FRONTEND_NAME_ENV = "KUBEMOE_FRONTEND_NAME"  # `kubemoe frontend --name`'s envvar: its name in load reports
# spec.dataPath.sameNode hostShm: the node's /dev/shm (sticky, writable by every user: a folder the
# kubelet made would be root's) is mounted here, and both pods use a folder of their own user in it.
NODE_SHM_HOST_PATH = "/dev/shm"
NODE_SHM_MOUNT = "/var/run/kubemoe/node-shm"


def node_shm_dir(deployment_uid: str) -> str:
    """The folder of one MoEDeployment in the node's /dev/shm, as its pods see it. Named by the object's uid:
    a recreated deployment (perhaps with another runAsUser) never meets the folder its predecessor made."""
    return f"{NODE_SHM_MOUNT}/kubemoe-{deployment_uid}"


def field_ref(name: str, field_path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


@dataclass(frozen=True, kw_only=True)
class _Command:  # a dataclass with no fields of its own, so that fields(self) is typed
    command: ClassVar[str]

    def args(self) -> list[str]:
        """The container's args: the subcommand, then every field as --field-name VALUE."""
        return [self.command, *(item for f in fields(self)
                                for item in (f"--{f.name.replace('_', '-')}", str(getattr(self, f.name))))]


@dataclass(frozen=True, kw_only=True)
class ExpertFnArgs(_Command):
    """`kubemoe expert-fn` in an expert-function pod."""

    command: ClassVar[str] = "expert-fn"
    checkpoint: str
    bundle: str                  # LAYER:EXPERTS[;...] (kubemoe.bundles.Bundle.spec())
    port: int = ports.EXPERT_GRPC
    metrics_port: int = ports.EXPERT_METRICS
    model: str
    dtype: str
    # Frontends on other nodes connect TCP lanes straight to this pod (expert_fn/frames.py), at its IP.
    data_port: int = ports.EXPERT_DATA
    data_host: str = f"$({POD_IP_ENV})"
    # Experts the routing table hosts here in place (operator/plan.py) are loaded and dropped by the
    # function itself; one the table stops naming stays warm for drop_after seconds (the keepAlive).
    routing_configmap: str       # NAMESPACE/NAME of the routing table, watched through the API server
    address: str                 # how the routing table names this function
    drop_after: int
    # Its allocator's cap beside the experts it holds (GpuSharing.working_memory); 0: none.
    working_memory_mib: int
    # The folder same-node frontends share with it (spec.dataPath.sameNode hostShm: node_shm_dir); "": none,
    # every frontend takes the TCP lane (a pod's own /dev/shm is shared with no other pod).
    shm_dir: str

    @staticmethod
    def env() -> list[dict]:
        return [field_ref(POD_IP_ENV, "status.podIP")]


@dataclass(frozen=True, kw_only=True)
class FrontendArgs(_Command):
    """`kubemoe frontend` in a frontend pod (its mode and offload settings: `offload_env.render`)."""

    command: ClassVar[str] = "frontend"
    checkpoint: str
    routing_configmap: str       # NAMESPACE/NAME of the routing table, watched through the API server
    host: str = "0.0.0.0"
    port: int = ports.FRONTEND_HTTP
    grpc_port: int = ports.FRONTEND_GRPC
    model: str
    dtype: str
    # The predictor's d: at layer l the frontend predicts layer l+d's loads for /loads and the split.
    prediction_distance: int
    # As ExpertFnArgs.shm_dir: with a folder, each stream offers a segment; a function on another node
    # cannot attach it and the stream takes the TCP lane instead.
    shm_dir: str

    @staticmethod
    def env() -> list[dict]:
        return [field_ref(FRONTEND_NAME_ENV, "metadata.name")]
