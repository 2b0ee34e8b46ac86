"""Shared fixtures: small generated checkpoints, and one real control plane (etcd, kube-apiserver,
scheduler, controller-manager, kwok) for the tests marked `cluster`, both made once per session.

The control-plane binaries are built on first use (`kubemoe dev testbin build`); the cluster is torn
down at the end of the session, also when tests fail.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from kubernetes import client

from kubemoe import busy_poll
from kubemoe.devcluster import Cluster, ClusterConfig, wait_for

from kubemoe.adapters import arch_names
from kubemoe.presets import get_preset
from kubemoe.synth import make_checkpoint

ARCHS = arch_names()
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def benchmark_module():
    """benchmark_module(name): benchmarks/<name>.py imported as a module, for tests of a benchmark's
    own pieces. Its folder is on sys.path meanwhile (scripts import `common`); both are undone at the end."""
    loaded: list[str] = []
    sys.path.insert(0, str(BENCHMARKS))

    def load(name: str):
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while it loads
            loaded.append(name)
            spec.loader.exec_module(module)
        return sys.modules[name]

    try:
        yield load
    finally:
        for name in loaded:
            sys.modules.pop(name, None)
        sys.path.remove(str(BENCHMARKS))


def pytest_asyncio_loop_factories(config, item):
    """Async tests run on the kind of loop kubemoe's processes run (busy_poll.new_event_loop: its
    callbacks know what else woke the loop), without the spin."""
    return {"kubemoe": lambda: busy_poll.new_event_loop(0)}


@pytest.fixture(scope="session")
def triton_interpreted():
    """Run a Python snippet under Triton's CPU interpreter (TRITON_INTERPRET=1, read when a kernel is
    made, so in a process of its own): GPU kernels checked against torch ops on a machine without a
    GPU. The snippet prints "equal" when its checks pass."""
    pytest.importorskip("triton")

    def run(script: str) -> None:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                              env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-2000:]

    return run


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> path of that architecture's tiny checkpoint (seed 0), made once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_checkpoint(get_preset(arch, "tiny"), tmp_path_factory.mktemp(arch) / "ckpt", progress=False)
        return made[arch]

    return get


# A session fixture is made inside the first test that asks for it, under that test's time limit (pytest-timeout's
# covers setup). Training took 134 s on an idle 2-core machine and over 300 s (the limit) beside busy processes:
# the first test that asks for it gets this much more.
SESSION_FIXTURE_SECONDS = {"trained_checkpoint": 300}


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the first test that runs, not the first collected
def pytest_collection_modifyitems(config, items):
    try:
        limit = float(config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not loaded
        return
    if not limit:  # no time limit to extend
        return
    for fixture, seconds in SESSION_FIXTURE_SECONDS.items():
        first = next((item for item in items if fixture in getattr(item, "fixturenames", ())), None)
        if first is not None:
            marker = first.get_closest_marker("timeout")
            first.add_marker(pytest.mark.timeout((marker.args[0] if marker and marker.args else limit) + seconds))


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory):
    """The `small` recipe of kubemoe's own MoE, trained once per session (seed 0, about a minute on 2 cores):
    the checkpoint whose routing is learned, for everything judged on real routing."""
    from kubemoe.train import get_recipe, train_moe

    out = tmp_path_factory.mktemp("trained") / "moe-small"
    train_moe(get_recipe("small"), out, seed=0, progress=False)
    return out


# -- the session's control plane -------------------------------------------------------------------

H100 = dict(gpus_per_node=8, product="NVIDIA-H100-80GB-HBM3", memory_mib=81559)
A10 = dict(gpus_per_node=1, product="NVIDIA-A10", memory_mib=23028)
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

_stats: dict[str, float] = {}


@pytest.fixture(scope="session")
def cluster():
    started = time.monotonic()
    with Cluster(ClusterConfig(nodes=2, gpus_per_node=H100["gpus_per_node"], gpu_product=H100["product"],
                               gpu_memory_mib=H100["memory_mib"])) as running:
        # A third, different node (one small GPU, tainted like many GPU pools) to choose between.
        running.add_gpu_nodes(1, A10["gpus_per_node"], A10["product"], A10["memory_mib"], taints=[GPU_TAINT])
        _stats["startup_s"] = time.monotonic() - started
        yield running
        core = client.CoreV1Api(running.api_client())
        _stats["nodes"] = len(core.list_node().items)
        _stats["pods"] = len(core.list_pod_for_all_namespaces().items)


@pytest.fixture(scope="session")
def gpu_nodes(cluster) -> dict[str, dict]:
    """What the session cluster's fake nodes were created with, by node name."""
    return {"kwok-gpu-0": H100, "kwok-gpu-1": H100, "kwok-gpu-2": A10}


@pytest.fixture(scope="session")
def api(cluster):
    return cluster.api_client()


@pytest.fixture
def namespace(cluster, api):
    """A fresh namespace whose `default` service account exists (pods need it to be admitted)."""
    core = client.CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), 30,
             f"service account default in namespace {name} (kube-controller-manager creates it)")
    yield name
    core.delete_namespace(name)


def pytest_terminal_summary(terminalreporter):
    if _stats:
        terminalreporter.write_line(
            "devcluster: start-up {:.1f}s, {:.0f} nodes, {:.0f} pods at teardown".format(
                _stats["startup_s"], _stats.get("nodes", 0), _stats.get("pods", 0)))
