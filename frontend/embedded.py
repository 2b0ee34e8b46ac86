"""`kubemoe serve`: a frontend and a few local expert-function processes, on loopback.

The embedded default needs nothing but this package: it generates (or reuses) a tiny checkpoint,
splits every MoE layer's experts over N expert-function processes that talk gRPC on 127.0.0.1,
writes the routing table for them and serves the frontend's HTTP and gRPC APIs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from kubemoe.busy_poll import SHARED_CORES_BUSY_POLL_US
from kubemoe.bundles import Bundle, bundles_by_count
from kubemoe.errors import KubemoeError
from kubemoe.net import free_port

DEFAULT_ARCH = "mixtral"


def shared_cores_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """For OpenMP teams that share cores with other busy threads (other processes' event loops, or the
    thread that launches an offload frontend's GPU work): idle OpenMP threads sleep instead of spinning for
    the next parallel region (libgomp spins milliseconds), which would take those threads' cores. An
    OMP_WAIT_POLICY the environment sets wins. OpenMP reads it once, when torch loads."""
    return {"OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def kubemoe_home() -> Path:
    return Path(os.environ.get("KUBEMOE_HOME", Path.home() / ".cache" / "kubemoe"))


def default_checkpoint(arch: str = DEFAULT_ARCH) -> Path:
    """The tiny checkpoint of `arch` in kubemoe's cache, generated the first time."""
    from kubemoe.presets import get_preset
    from kubemoe.synth import make_checkpoint

    path = kubemoe_home() / "checkpoints" / f"{arch}-tiny"
    if not (path / "config.json").is_file():
        print(f"generating a tiny {arch} checkpoint in {path} ...", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=path.parent if path.parent.exists() else None))
        path.parent.mkdir(parents=True, exist_ok=True)
        make_checkpoint(get_preset(arch, "tiny"), tmp / "ckpt", progress=False)
        (tmp / "ckpt").rename(path)  # atomic: a half-written checkpoint is never reused
    return path


@dataclass
class ExpertProcesses:
    addresses: dict[str, list[str]] = field(default_factory=dict)  # bundle name -> replica addresses
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)  # address -> its process


@contextmanager
def expert_processes(checkpoint: Path, bundles: list[Bundle], model: str, replicas: int = 1,
                     ready_timeout: float = 120.0, shm_dir: Path | None = None,
                     busy_poll_us: float = SHARED_CORES_BUSY_POLL_US, gpus: Sequence[int] = (),
                     dtype: str | None = None, working_memory: int = 0, extra_args: Sequence[str] = ()):
    """Start `replicas` expert-function processes per bundle; stop them all (SIGTERM) afterwards.

    `gpus`: the i-th process started sees only GPU gpus[i % len(gpus)] (CUDA_VISIBLE_DEVICES), as a
    pod sees the GPU it was given; empty: every process sees what this one sees. `dtype`: the weights'
    (default: the checkpoint's). `working_memory`: bytes each process's allocator may hold
    beside its experts (--working-memory-mib); 0: no cap. `extra_args`: more `kubemoe expert-fn` flags, as given."""
    started = ExpertProcesses()
    # The processes share this machine's cores with each other and the frontend: without a split,
    # every OpenMP pool spins on all cores and a 1 ms expert call takes 100 ms under contention.
    threads = max(1, (os.cpu_count() or 1) // (len(bundles) * replicas + 1))
    env = {**os.environ, **shared_cores_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    try:
        for bundle in bundles:
            for _ in range(replicas):
                i = len(started.procs)
                gpu = {"CUDA_VISIBLE_DEVICES": str(gpus[i % len(gpus)])} if gpus else {}
                address = f"127.0.0.1:{free_port()}"
                started.addresses.setdefault(bundle.name, []).append(address)
                started.procs[address] = subprocess.Popen(
                    [sys.executable, "-m", "kubemoe.cli", "expert-fn", "--checkpoint", str(checkpoint),
                     "--model", model, "--bundle", bundle.spec(), "--host", "127.0.0.1",
                     "--port", address.rsplit(":", 1)[1], "--metrics-port", "-1", "--shm-dir", str(shm_dir or ""),
                     "--busy-poll-us", str(busy_poll_us), *(["--dtype", dtype] if dtype else []),
                     "--working-memory-mib", str(working_memory >> 20), *extra_args],
                    stdin=subprocess.DEVNULL, start_new_session=True, env={**env, **gpu})  # Ctrl-C reaches only the frontend
        for address, proc in started.procs.items():
            wait_serving(address, proc, ready_timeout)
        yield started
    finally:
        for proc in started.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in started.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def wait_serving(address: str, proc: subprocess.Popen | None, timeout: float) -> None:
    """Block until the gRPC health service at `address` says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise KubemoeError(f"the expert function for {address} exited with code {proc.returncode}; see its log above")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise KubemoeError(f"the expert function at {address} was not ready within {timeout:.0f}s")
            time.sleep(0.1)


def embedded_bundles(checkpoint: Path, count: int) -> list[Bundle]:
    from kubemoe.adapters import MoEAdapter

    adapter = MoEAdapter.from_checkpoint(checkpoint)
    if not 1 <= count <= adapter.num_experts:
        raise KubemoeError(f"--experts must be between 1 and {adapter.num_experts} (experts per layer), got {count}")
    return bundles_by_count(adapter.moe_layers, adapter.num_experts, count)
