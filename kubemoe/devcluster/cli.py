"""`dev` commands: build the test control plane and run a throw-away cluster by hand.

    python -m kubemoe.devcluster testbin build
    python -m kubemoe.devcluster cluster up --kubeconfig /tmp/dev.kubeconfig --nodes 4 &
    kubectl --kubeconfig /tmp/dev.kubeconfig get nodes     # the file appears once the cluster is ready
    python -m kubemoe.devcluster cluster down

`cluster up` stays in the foreground until Ctrl-C or SIGTERM and then tears everything down; it
records its pid in the state dir so that `cluster down` (from another shell) can send that SIGTERM.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click

from .cluster import SHARING_STRATEGIES, Cluster, ClusterConfig, GpuSharing
from .testbin import ensure_testbin

DEFAULT_STATE_DIR = Path.home() / ".cache" / "kubemoe" / "devcluster"
state_dir_option = click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
                                default=DEFAULT_STATE_DIR, show_default=True,
                                help="Where `cluster up` records its pid for `cluster down`.")


@click.group("dev")
def dev() -> None:
    """Developer tools: a local Kubernetes control plane with fake GPU nodes."""


@dev.group()
def testbin() -> None:
    """The control-plane binaries (built from the Go module proxy, cached in ~/.cache/kubemoe)."""


@testbin.command("build")
def testbin_build() -> None:
    """Build etcd, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl, kwok and helm
    at the versions pinned in hack/testbin/versions.env; does nothing when already built."""
    started = time.monotonic()
    built = ensure_testbin(log=lambda line: click.echo(line, err=True))
    click.echo(f"{built.root} ({time.monotonic() - started:.1f}s)")


@dev.group()
def cluster() -> None:
    """Run a throw-away cluster."""


@cluster.command("up")
@click.option("--kubeconfig", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the admin kubeconfig (written once the cluster is ready).")
@click.option("--nodes", default=2, show_default=True, help="Fake GPU nodes (kwok).")
@click.option("--gpus-per-node", default=8, show_default=True)
@click.option("--gpu-product", default=ClusterConfig.gpu_product, show_default=True)
@click.option("--gpu-memory-mib", default=ClusterConfig.gpu_memory_mib, show_default=True)
@click.option("--gpu-sharing", type=click.Choice(SHARING_STRATEGIES), default="none", show_default=True,
              help="How the nodes' GPUs are shared: the NVIDIA device plugin's strategies, or dra (ResourceSlices).")
@click.option("--gpu-replicas", default=1, show_default=True, help="Shares per GPU (time-slicing, mps).")
@click.option("--gpu-rename/--no-gpu-rename", default=False, show_default=True,
              help="Advertise shares as nvidia.com/gpu.shared (the device plugin's renameByDefault).")
@state_dir_option
def cluster_up(kubeconfig: Path, nodes: int, gpus_per_node: int, gpu_product: str, gpu_memory_mib: int,
               gpu_sharing: str, gpu_replicas: int, gpu_rename: bool, state_dir: Path) -> None:
    """Start a cluster and keep it running in the foreground until Ctrl-C or `cluster down`."""
    pid_file = state_dir / "up.pid"
    if pid_file.exists() and _alive(int(pid_file.read_text())):
        raise click.ClickException(f"a cluster is already up (pid {pid_file.read_text()}); run `cluster down` first")
    # SIGTERM (from `cluster down`) unwinds like Ctrl-C, so the `with` block stops every component.
    signal.signal(signal.SIGTERM, _interrupt)
    state_dir.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(str(os.getpid()))
    config = ClusterConfig(nodes=nodes, gpus_per_node=gpus_per_node, gpu_product=gpu_product,
                           gpu_memory_mib=gpu_memory_mib,
                           gpu_sharing=GpuSharing(gpu_sharing, gpu_replicas, gpu_rename))
    try:
        with Cluster(config) as running:
            running.write_kubeconfig(kubeconfig)
            click.echo(f"cluster ready in {running.startup_seconds:.1f}s: {running.server}, {nodes} GPU nodes; "
                       f"kubeconfig {kubeconfig}; logs in {running.data_dir / 'logs'}. Ctrl-C to stop.", err=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("stopping the cluster", err=True)
    finally:
        pid_file.unlink(missing_ok=True)
        kubeconfig.unlink(missing_ok=True)  # it points at a server that is gone


@cluster.command("down")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds to wait for `cluster up` to exit.")
@state_dir_option
def cluster_down(timeout: float, state_dir: Path) -> None:
    """Stop the cluster that `cluster up` runs."""
    pid_file = state_dir / "up.pid"
    if not pid_file.exists():
        click.echo("no cluster is up", err=True)
        return
    pid = int(pid_file.read_text())
    if _alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                raise click.ClickException(f"`cluster up` (pid {pid}) still running after {timeout:.0f}s")
            time.sleep(0.2)
    pid_file.unlink(missing_ok=True)
    click.echo("cluster stopped", err=True)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
