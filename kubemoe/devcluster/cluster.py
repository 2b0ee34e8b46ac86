"""A real Kubernetes control plane on loopback for tests: etcd, kube-apiserver and optionally
kube-scheduler, kube-controller-manager and kwok, which plays the kubelet of fake GPU nodes.

    with Cluster(ClusterConfig(nodes=2, gpus_per_node=8)) as cluster:
        cluster.kubectl("get", "nodes")
        client = cluster.api_client()  # kubernetes.client.ApiClient as cluster-admin

No process outlives the cluster: each component runs in its own process group that `stop()` kills,
`stop()` runs at interpreter exit too (atexit), and every component gets SIGKILL from the kernel when
the Python thread that started it dies (PR_SET_PDEATHSIG), which covers a SIGKILLed test runner.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import dataclasses
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from kubemoe.net import free_port

from .pki import ADMIN_USER, create_pki
from .testbin import Testbin, ensure_testbin

KWOK_ANNOTATION = {"kwok.x-k8s.io/node": "fake"}
POD_READY_STAGE = "pod-ready.yaml"
# The line of kwok's pod-ready stage that picks a pod's addresses (from its node's podCIDR, else --cidr)
KWOK_POD_IPS = ("{{ $podIPs := PodIPsWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid \"\" ) "
                "( or .metadata.name \"\" ) ( or .metadata.namespace \"\" ) }}")
SHARING_STRATEGIES = ("none", "time-slicing", "mps", "dra")
NVIDIA_DRA_DRIVER = "gpu.nvidia.com"  # the NVIDIA DRA driver's name, and the DeviceClass it installs


@dataclasses.dataclass(frozen=True)
class GpuSharing:
    """How a fake node's GPUs are shared, advertised as the NVIDIA components advertise it on a real node.

    none, time-slicing, mps: the device plugin (time-slicing/mps with `sharing.<strategy>.resources:
    [{name: nvidia.com/gpu, replicas: R}]`) advertises GPUs x R shares as nvidia.com/gpu, or as
    nvidia.com/gpu.shared with renameByDefault, and GPU feature discovery labels the node
    nvidia.com/gpu.replicas=R, nvidia.com/gpu.sharing-strategy=<strategy> and the product with -SHARED.
    dra: no device plugin; the DRA driver publishes the GPUs in a ResourceSlice (DeviceClass gpu.nvidia.com),
    which the real scheduler allocates claims from.
    """

    strategy: str = "none"
    replicas: int = 1              # shares per GPU (time-slicing, mps)
    rename: bool = False           # renameByDefault: shares advertised as nvidia.com/gpu.shared

    def __post_init__(self):
        if self.strategy not in SHARING_STRATEGIES:
            raise ValueError(f"GPU sharing strategy {self.strategy!r}: choose one of {', '.join(SHARING_STRATEGIES)}")
        if self.replicas < 1 or (self.strategy in ("none", "dra") and self.replicas != 1):
            raise ValueError(f"replicas {self.replicas}: at least 1, and 1 unless the strategy is time-slicing or mps")

    @property
    def resource_name(self) -> str | None:
        """What the device plugin advertises (None with dra: no device plugin)."""
        if self.strategy == "dra":
            return None
        return "nvidia.com/gpu.shared" if self.rename and self.strategy != "none" else "nvidia.com/gpu"
KNATIVE_NAMESPACE = "knative-serving"

# Client rate limits and worker counts as large clusters run their controllers. The defaults (20 queries/s,
# 5 workers per controller) are sized for small clusters: at a thousand nodes and ~650 Deployments made at
# once, kube-controller-manager would spend minutes in its own client's rate limiter, not in work.
# The endpoints controllers batch pod changes for a second, as their flags exist for: the experts' headless
# Service holds ~650 pods at 1000 nodes, and each pod turning Ready rewrote its whole Endpoints object
# (~70 writes of up to 1000 addresses while a plan's pods start).
CONTROLLER_MANAGER_TUNING = ("--kube-api-qps=300", "--kube-api-burst=600", "--concurrent-deployment-syncs=20",
                             "--concurrent-replicaset-syncs=20", "--endpoint-updates-batch-period=1s",
                             "--endpointslice-updates-batch-period=1s")
SCHEDULER_TUNING = ("--kube-api-qps=300", "--kube-api-burst=600")  # binds ~650 pods without queueing on the client


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """What to run. GPU defaults describe an H100 80GB node as GPU feature discovery labels it."""

    nodes: int = 0                 # fake GPU nodes created by start()
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    gpu_memory_mib: int = 81559
    gpu_sharing: GpuSharing = GpuSharing()
    scheduler: bool = True
    controller_manager: bool = True
    kwok: bool = True              # without it nodes never become Ready and pods never run
    knative_crds: bool = True      # Knative Serving's CRDs and the knative-serving namespace
    data_dir: Path | None = None   # default: a fresh temp dir, removed by stop()
    apiserver_args: tuple[str, ...] = ()
    controller_manager_args: tuple[str, ...] = ()  # after CONTROLLER_MANAGER_TUNING (a later flag wins)
    scheduler_args: tuple[str, ...] = ()           # after SCHEDULER_TUNING
    # Pod addresses. Each fake node gets a /24 of node_pod_cidrs as its spec.podCIDR (as node IPAM gives real
    # nodes one), and kwok gives its pods addresses from there: outside loopback, so Services get endpoints.
    # (With loopback addresses for every pod, the endpoints controllers' writes failed validation and were
    # retried: at 1000 nodes each failure formatted a 650-address error, ~12% of the API server's CPU.)
    # Frontend pods (app.kubernetes.io/component=frontend) get loopback addresses from pod_cidr instead, so
    # tests and the operator benchmark serve their /loads on this machine, where the operator dials them.
    node_pod_cidrs: str = "100.64.0.0/10"
    pod_cidr: str = "127.128.0.1/16"
    # ClusterIPs: allocation only (no proxy runs, so nothing routes to them); a /24 holds 254 Services.
    service_cidr: str = "10.0.0.0/24"
    timeout_s: float = 120.0       # per readiness wait
    # How long a node's Lease lasts. kwok, as the kubelet, renews it every quarter of that; the node lifecycle
    # controller marks a node NotReady when it has not been renewed for 5/4 of it (--node-monitor-grace-period,
    # the kubelet defaults' ratio: 40 s lease, 50 s grace). The lease is the only per-node write of an idle
    # cluster: the kubelet's 40 s means 1000 nodes renew 100 times a second, 0.8 of this machine's 2 cores in
    # kube-apiserver and etcd before anything is deployed (measured). 240 s renews every 60 s, 6x fewer writes,
    # and still notices a lost node within 5 minutes (the default pod eviction timeout is 5 minutes too).
    node_lease_s: int = 240
    # How many pods kwok moves through a stage at once (kwok's default: 4). A real cluster has a kubelet per
    # node, each starting its own pods; kwok plays every node's pods. With 4, the pods of a 1000-node plan
    # turned Ready 4 s after the last was scheduled (each status patch waits on this busy 2-core machine).
    pod_stage_parallelism: int = 32


class ClusterError(RuntimeError):
    pass


_live: set["Cluster"] = set()


@atexit.register
def _stop_live_clusters() -> None:
    for cluster in list(_live):
        cluster.stop()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel SIGKILLs it when our thread dies.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def wait_for(check: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2,
             detail: Callable[[], str] = lambda: "") -> object:
    """Poll `check` until it returns something truthy; raise TimeoutError naming `what` otherwise.
    Exceptions from `check` count as "not yet" and the last one is reported."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except ClusterError:
            raise  # a component died: waiting longer cannot help
        except Exception as error:  # noqa: BLE001 - any other failure means "not ready yet"
            last_error = error
        if time.monotonic() > deadline:
            message = f"timed out after {timeout_s:.0f}s waiting for {what}"
            if last_error is not None:
                message += f" (last error: {last_error!r})"
            extra = detail()
            raise TimeoutError(message + (f"\n{extra}" if extra else ""))
        time.sleep(interval_s)


def gpu_node(name: str, gpus: int, product: str, memory_mib: int, taints: Sequence[dict] = (),
             sharing: GpuSharing = GpuSharing(), pod_cidr: str | None = None) -> dict:
    """A Node that kwok manages, labelled like GPU feature discovery labels a real GPU node."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    if sharing.resource_name:
        resources[sharing.resource_name] = str(gpus * sharing.replicas)
    shared = sharing.strategy in ("time-slicing", "mps")
    labels = {
        "type": "kwok",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": f"{product}-SHARED" if shared else product,
        "nvidia.com/gpu.memory": str(memory_mib),
        "nvidia.com/gpu.count": str(gpus),
    }
    if sharing.strategy != "dra":  # the device plugin's labels
        labels |= {"nvidia.com/gpu.replicas": str(sharing.replicas), "nvidia.com/gpu.sharing-strategy": sharing.strategy}
    if sharing.strategy == "mps":
        labels["nvidia.com/mps.capable"] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {**KWOK_ANNOTATION, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": labels,
        },
        "spec": {"taints": list(taints), **({"podCIDR": pod_cidr} if pod_cidr else {})},
        # kwok's node-initialize stage keeps capacity/allocatable as created and adds the rest.
        "status": {"capacity": resources, "allocatable": resources},
    }


def gpu_device_class() -> dict:
    """The DeviceClass the NVIDIA DRA driver installs for whole GPUs."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": NVIDIA_DRA_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NVIDIA_DRA_DRIVER}' && "
                                                          f"device.attributes['{NVIDIA_DRA_DRIVER}'].type == 'gpu'"}}]}}


def gpu_resource_slice(node: str, gpus: int, product: str, memory_mib: int) -> dict:
    """A node's GPUs as the NVIDIA DRA driver publishes them: one pool per node, one device per GPU."""
    devices = [{"name": f"gpu-{i}",
                "attributes": {"type": {"string": "gpu"}, "index": {"int": i}, "productName": {"string": product},
                               "uuid": {"string": f"GPU-{node}-{i}"}},
                "capacity": {"memory": {"value": f"{memory_mib}Mi"}}} for i in range(gpus)]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{NVIDIA_DRA_DRIVER}"},
            "spec": {"driver": NVIDIA_DRA_DRIVER, "nodeName": node,
                     "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}}


class Cluster:
    def __init__(self, config: ClusterConfig = ClusterConfig(), testbin: Testbin | None = None):
        self.config = config
        self._testbin = testbin
        self._procs: dict[str, subprocess.Popen] = {}
        self._owns_data_dir = config.data_dir is None
        self.data_dir = Path(config.data_dir or tempfile.mkdtemp(prefix="kubemoe-devcluster-"))
        self.server = ""
        self.startup_seconds = 0.0
        self._node_count = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Cluster":
        started = time.monotonic()
        _live.add(self)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - started
        return self

    def _start(self) -> None:
        cfg = self.config
        self.testbin = self._testbin or ensure_testbin()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.pki = create_pki(self.data_dir / "pki")
        self._start_etcd()
        self._start_apiserver()
        self._write_kubeconfig(self.kubeconfig)
        kubeconfig = f"--kubeconfig={self.kubeconfig}"
        # Delegated authn/authz of the components' own HTTPS endpoints go through the admin identity.
        delegated = [f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}"]
        health = {}
        if cfg.scheduler:
            health["kube-scheduler"] = port = free_port()
            self._spawn("kube-scheduler", kubeconfig, *delegated, "--leader-elect=false",
                        "--bind-address=127.0.0.1", f"--secure-port={port}", *SCHEDULER_TUNING,
                        *cfg.scheduler_args)
        if cfg.controller_manager:
            health["kube-controller-manager"] = port = free_port()
            self._spawn("kube-controller-manager", kubeconfig, *delegated, "--leader-elect=false",
                        "--bind-address=127.0.0.1", f"--secure-port={port}",
                        f"--service-account-private-key-file={self.pki.key('sa')}",
                        f"--root-ca-file={self.pki.ca_cert}", "--use-service-account-credentials=false",
                        f"--node-monitor-grace-period={cfg.node_lease_s * 5 // 4}s",
                        *CONTROLLER_MANAGER_TUNING, *cfg.controller_manager_args)
        if cfg.knative_crds:
            self.kubectl("apply", "--server-side", f"--filename={self.testbin.knative_crds}")
            self.kubectl("wait", "--for=condition=Established", "crd", "--all", f"--timeout={cfg.timeout_s:.0f}s")
            self.kubectl("create", "namespace", KNATIVE_NAMESPACE)
        if cfg.kwok:
            self._start_kwok()
        for name, port in health.items():
            url = f"https://127.0.0.1:{port}/healthz"
            # wait_for calls both before the loop moves on, so they see this iteration's url and name
            wait_for(lambda: self._get(url, verify=False) == "ok", cfg.timeout_s, f"{name} {url}",  # noqa: B023
                     detail=lambda: self._log_tail(name))  # noqa: B023
        if cfg.nodes:
            self.add_gpu_nodes(cfg.nodes, cfg.gpus_per_node, cfg.gpu_product, cfg.gpu_memory_mib,
                               sharing=cfg.gpu_sharing)

    def stop(self) -> None:
        """Kill every component (SIGTERM, then SIGKILL after 10s) and remove the temp data dir."""
        for proc in reversed(list(self._procs.values())):
            _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill_group(proc, signal.SIGKILL)  # also reaps children a component may have left
            proc.wait()
        self._procs.clear()
        _live.discard(self)
        if self._owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    # -- components --------------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.data_dir / "logs" / f"{name}.log", "wb")
        proc = subprocess.Popen([self.testbin.path(name), *args], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()  # the child holds its own copy
        self._procs[name] = proc
        return proc

    def _log_tail(self, name: str, lines: int = 30) -> str:
        path = self.data_dir / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        proc = self._procs.get(name)
        state = f"exited with {proc.returncode}" if proc and proc.poll() is not None else "running"
        return f"--- {name} ({state}), last lines of {path}:\n" + "\n".join(tail)

    def _wait_up(self, name: str, check: Callable[[], object], what: str) -> None:
        def alive_and_ready():
            if self._procs[name].poll() is not None:
                raise ClusterError(f"{name} exited with code {self._procs[name].returncode}")
            return check()
        try:
            wait_for(alive_and_ready, self.config.timeout_s, what, detail=lambda: self._log_tail(name))
        except TimeoutError as error:
            raise ClusterError(str(error)) from None

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        peer_url = f"http://127.0.0.1:{peer}"
        self._spawn("etcd", "--name=default", f"--data-dir={self.data_dir / 'etcd'}",
                    f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
                    f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=default={peer_url}",
                    "--unsafe-no-fsync",  # throw-away data: durability only costs time
                    "--log-level=warn")
        self._wait_up("etcd", lambda: '"health":"true"' in self._get(f"{self.etcd_url}/health"),
                      f"etcd {self.etcd_url}/health")

    def _start_apiserver(self) -> None:
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.data_dir / 'apiserver'}",
            f"--tls-cert-file={pki.cert('apiserver')}", f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca_cert}",
            "--authorization-mode=RBAC",
            f"--service-account-key-file={pki.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={pki.key('sa')}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={self.config.service_cidr}",
            "--allow-privileged=true",
            # The `kubernetes` Service would point at 127.0.0.1, which Endpoints may not hold.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            *self.config.apiserver_args,
        )
        self._wait_up("kube-apiserver", lambda: self._get(f"{self.server}/readyz") == "ok",
                      f"kube-apiserver {self.server}/readyz")

    def _start_kwok(self) -> None:
        config = self.data_dir / "kwok.yaml"
        # A configuration file replaces kwok's defaults (none are filled in): the others as kwok's defaults.
        options = {"podPlayStageParallelism": self.config.pod_stage_parallelism, "nodePlayStageParallelism": 4,
                   "nodeLeaseParallelism": 4, "podsOnNodeSyncParallelism": 1, "enablePodsOnNodeSyncListPager": True}
        kwok_config = json.dumps({"apiVersion": "config.kwok.x-k8s.io/v1alpha1", "kind": "KwokConfiguration",
                                  "options": options})
        # The stages go in the same file, not as Stage objects (--enable-crds=Stage). With Stage objects, kwok 0.8
        # starts its node and pod controllers when its Stage informer signals, and caches the list it reads by the
        # informer's resource version, which client-go sets only after the first objects are handed out: read in
        # between, the list is cached empty, and with no later Stage event no controller ever starts (a CI run's
        # kwok logged no "Start stage controller" and its nodes never turned Ready). From the file they start
        # before kwok watches anything.
        config.write_text("\n---\n".join([kwok_config, *self._kwok_stages()]))
        selector = ",".join(f"{k}={v}" for k, v in KWOK_ANNOTATION.items())
        self._spawn("kwok", f"--config={config}", f"--kubeconfig={self.kubeconfig}",
                    "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={selector}",
                    f"--node-lease-duration-seconds={self.config.node_lease_s}",
                    f"--cidr={self.config.pod_cidr}", "--node-ip=127.0.0.1",
                    f"--server-address=127.0.0.1:{free_port()}")

    def _kwok_stages(self) -> list[str]:
        """kwokctl's default stages, the pod-ready one giving frontends loopback addresses."""
        stages = sorted(self.testbin.kwok_manifests.glob("*.yaml"))
        return [frontends_on_loopback(p.read_text()) if p.name == POD_READY_STAGE else p.read_text() for p in stages]

    # -- access ------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.data_dir / "kubeconfig"

    def _write_kubeconfig(self, path: Path) -> None:
        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()
        config = {  # JSON is YAML: kubectl, helm and the Python client all read it
            "apiVersion": "v1", "kind": "Config", "current-context": "kubemoe-dev",
            "clusters": [{"name": "kubemoe-dev", "cluster": {
                "server": self.server, "certificate-authority-data": b64(self.pki.ca_cert)}}],
            "users": [{"name": ADMIN_USER, "user": {
                "client-certificate-data": b64(self.pki.cert("admin")),
                "client-key-data": b64(self.pki.key("admin"))}}],
            "contexts": [{"name": "kubemoe-dev", "context": {"cluster": "kubemoe-dev", "user": ADMIN_USER}}],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=1))
        path.chmod(0o600)

    def write_kubeconfig(self, path: Path | str) -> Path:
        """Copy the admin kubeconfig (certificates embedded) to `path`."""
        self._write_kubeconfig(Path(path))
        return Path(path)

    def service_account_kubeconfig(self, service_account: str, namespace: str, path: Path | str) -> Path:
        """A kubeconfig at `path` that authenticates as a ServiceAccount (what a pod's mounted token gives it),
        so that its RBAC is what a process using it is allowed."""
        token = self.kubectl("create", "token", service_account, f"--namespace={namespace}",
                             "--duration=2h").stdout.strip()
        config = json.loads(self.kubeconfig.read_text())
        config["users"] = [{"name": service_account, "user": {"token": token}}]
        config["contexts"][0]["context"]["user"] = service_account
        Path(path).write_text(json.dumps(config))
        return Path(path)

    def api_client(self):
        """A kubernetes.client.ApiClient authenticated as cluster admin (system:masters)."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _get(self, url: str, verify: bool = True) -> str:
        context = None
        if url.startswith("https"):
            context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
            context.load_cert_chain(self.pki.cert("admin"), self.pki.key("admin"))
            if not verify:  # scheduler/controller-manager serve self-signed certificates
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.read().decode()

    def _run(self, binary: str, *args: str, check: bool, timeout_s: float | None, env=None) -> subprocess.CompletedProcess:
        result = subprocess.run([self.testbin.path(binary), f"--kubeconfig={self.kubeconfig}", *args],
                                capture_output=True, text=True, timeout=timeout_s or self.config.timeout_s, env=env)
        if check and result.returncode != 0:
            raise ClusterError(f"{binary} {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def kubectl(self, *args: str, check: bool = True, timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run the kubectl built with this control plane (no version skew) as cluster admin."""
        return self._run("kubectl", *args, check=check, timeout_s=timeout_s)

    def apply_objects(self, objects: Sequence[dict]) -> None:
        """Server-side apply of objects of any kind (built-in kinds the Python client has no API class for)."""
        path = self.data_dir / f"apply-{time.monotonic_ns()}.json"
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}))
        try:
            self.kubectl("apply", "--server-side", f"--filename={path}")
        finally:
            path.unlink()

    def helm(self, *args: str, check: bool = True, timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run helm against this cluster, with its config/cache/data kept inside the data dir."""
        home = self.data_dir / "helm"
        env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_DATA_HOME": str(home / "data")}
        return self._run("helm", *args, check=check, timeout_s=timeout_s, env=env)

    # -- nodes -------------------------------------------------------------------------------

    def add_gpu_nodes(self, count: int, gpus_per_node: int = 8, product: str = "NVIDIA-H100-80GB-HBM3",
                      memory_mib: int = 81559, taints: Sequence[dict] = (), wait: bool = True,
                      sharing: GpuSharing = GpuSharing()) -> list[str]:
        """Create `count` kwok-managed GPU nodes named kwok-gpu-<n> whose GPUs are shared as `sharing` says
        (with dra: the DeviceClass once and a ResourceSlice per node); wait until they are Ready."""
        from kubernetes import client
        if count < 1 or gpus_per_node < 0:
            raise ValueError(f"need count >= 1 and gpus_per_node >= 0, got {count}, {gpus_per_node}")
        core = client.CoreV1Api(self.api_client())
        names = []
        dra = []
        for _ in range(count):
            name = f"kwok-gpu-{self._node_count}"
            self._node_count += 1
            # the client serialises a plain dict body as it does a V1Node; its annotation names only the model
            node = gpu_node(name, gpus_per_node, product, memory_mib, taints, sharing,
                            pod_cidr=node_pod_cidr(self.config.node_pod_cidrs, self._node_count - 1))
            core.create_node(node)  # type: ignore[arg-type]
            names.append(name)
            if sharing.strategy == "dra":
                dra.append(gpu_resource_slice(name, gpus_per_node, product, memory_mib))
        if dra:
            self.apply_objects([gpu_device_class(), *dra])
        if wait:
            def all_ready():
                nodes = {n.metadata.name: n for n in core.list_node(label_selector="type=kwok").items if n.metadata}
                return all(_is_ready(nodes.get(name)) for name in names)
            wait_for(all_ready, self.config.timeout_s, f"nodes {names} to be Ready",
                     detail=lambda: self._log_tail("kwok"))
        return names


def node_pod_cidr(pool: str, index: int) -> str:
    """The `index`th /24 of `pool` (a node's spec.podCIDR)."""
    network = ipaddress.ip_network(pool)
    if index >= 2 ** (24 - network.prefixlen):
        raise ValueError(f"{pool} holds {2 ** (24 - network.prefixlen)} nodes' /24s; node {index} needs a larger pool")
    return str(ipaddress.ip_network((int(network.network_address) + (index << 8), 24)))


def frontends_on_loopback(stage: str) -> str:
    """kwok's pod-ready stage, with frontend pods' addresses taken from kwok's --cidr (loopback) rather than
    their node's podCIDR (see ClusterConfig.node_pod_cidrs)."""
    if KWOK_POD_IPS not in stage:
        raise RuntimeError(f"kwok's {POD_READY_STAGE} no longer picks pod addresses as this expects ({KWOK_POD_IPS}): "
                           "update frontends_on_loopback for this kwok version")
    frontend = '{{ if eq (dig "metadata" "labels" "app.kubernetes.io/component" "" .) "frontend" }}'
    by_node = KWOK_POD_IPS.replace(":=", "=")
    choice = "{{ $podIPs := list }}\n      " + frontend + "{{ $podIPs = list PodIP }}{{ else }}" + by_node + "{{ end }}"
    return stage.replace(KWOK_POD_IPS, choice)


def _is_ready(node) -> bool:
    conditions = (node.status.conditions or []) if node and node.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _kill_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
    except ProcessLookupError:
        pass
