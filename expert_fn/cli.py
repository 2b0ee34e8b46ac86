"""`kubemoe expert-fn`: run an expert function for one bundle of a checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from kubemoe import busy_poll, logs, ports
from kubemoe.devices import DTYPE_CHOICES
from kubemoe.expert_fn.transport import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_SHM_DIR


def shm_dir_option(peers: str):
    """--shm-dir, as frontends and expert functions both take it: a Path, or None for ''."""
    return click.option("--shm-dir", default=DEFAULT_SHM_DIR, show_default=True,
                        callback=lambda ctx, param, value: Path(value) if value else None,
                        help=f"tmpfs folder shared with {peers} on this node: tensors then skip the socket "
                             "('' : always inline).")


def busy_poll_option(waits_for: str, default: float = busy_poll.DEFAULT_BUSY_POLL_US, why_default: str = ""):
    """--busy-poll-us, as frontends and expert functions both take it (see kubemoe/busy_poll.py)."""
    return click.option("--busy-poll-us", type=float, default=default, show_default=True,
                        help=f"Poll for {waits_for} this long before sleeping: no wake-up latency, at the cost "
                             f"of that much of a core after each burst of work (0: off).{why_default}")


@click.command("expert-fn")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Safetensors checkpoint folder.")
@click.option("--bundle", default="*", show_default=True, help="Experts to serve: LAYER:EXPERTS[;...], e.g. '1:0-3;3:*'.")
@click.option("--port", type=int, default=ports.EXPERT_GRPC, show_default=True, help="gRPC port (0: any free port).")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--model", default=None, help="Model id requests must name [default: the checkpoint folder's name].")
@click.option("--device", default="auto", show_default=True, help="auto (cuda when there is one), cpu, cuda, cuda:N.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None, help="Weight dtype [default: the checkpoint's].")
@click.option("--metrics-port", type=int, default=ports.EXPERT_METRICS, show_default=True,
              help="Prometheus /metrics port; -1: none. Never one of Knative's reserved ports (kubemoe/ports.py).")
@click.option("--batch-wait-ms", type=float, default=0.5, show_default=True,
              help="Longest wait for more requests to merge into one expert call, under concurrency only.")
@click.option("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, show_default=True,
              help="Largest gRPC message accepted or sent.")
@click.option("--grace-seconds", type=float, default=25.0, show_default=True,
              help="On SIGTERM, how long in-flight calls may take to finish.")
@click.option("--cuda-graph-tokens", type=click.IntRange(min=0), default=None,
              help="On a GPU, run an expert's calls of up to this many tokens as CUDA graphs (one launch instead "
                   "of five; captured as experts load); 0: always eager [default: 256, graphs.py's].")
@click.option("--data-port", type=int, default=0, show_default=True,
              help="TCP port for lanes from frontends that share no --shm-dir folder with this function (their "
                   "tensors then skip gRPC; kubemoe/expert_fn/frames.py); 0: any free port, -1: none.")
@click.option("--data-host", default=None,
              help="Address frontends connect lanes to, e.g. the pod's IP [default: the one they dialled].")
@click.option("--routing-table", default=None, help="Follow this routing-table file: also hold the experts it "
              "sends to --address, loaded and dropped in place.")
@click.option("--routing-configmap", default=None, help="The same from a ConfigMap, NAMESPACE/NAME (key routing.json).")
@click.option("--address", default=None, help="How the routing table names this function (host:port).")
@click.option("--drop-after", type=float, default=30.0, show_default=True,
              help="Seconds an expert the table no longer sends here stays loaded (frontends switch tables a "
                   "moment apart).")
@click.option("--working-memory-mib", type=click.IntRange(min=0), default=0, show_default=True,
              help="On a GPU, cap this function's allocator at the experts it holds plus this many MiB (activations, "
                   "CUDA graphs; a Load or Unload adds the stacks it makes while it runs); 0: no cap. Where "
                   "functions time-slice a GPU: at the cap it frees its cache rather than keep memory another "
                   "function's plan counts on (the operator renders it; MPS caps its clients itself).")
@shm_dir_option("frontends")
@busy_poll_option("the next request")
def command(checkpoint: Path, bundle: str, port: int, host: str, model: str | None, device: str, dtype: str | None,
            metrics_port: int, batch_wait_ms: float, max_message_bytes: int, grace_seconds: float,
            cuda_graph_tokens: int | None, data_port: int, data_host: str | None,
            routing_table: str | None, routing_configmap: str | None, address: str | None,
            drop_after: float, working_memory_mib: int, shm_dir: Path | None, busy_poll_us: float) -> None:
    """Serve a bundle of experts over gRPC until SIGTERM."""
    from kubemoe.expert_fn.config import ExpertFnConfig
    from kubemoe.expert_fn.server import serve
    from kubemoe.expert_fn.shm import shared_folder

    logs.configure()
    shm_dir = shared_folder(shm_dir)  # a pod's folder in the node's /dev/shm is made by whichever pod comes first
    config = ExpertFnConfig.build(
        checkpoint, bundle, model=model, device=device, dtype=dtype, host=host, port=port,
        metrics_port=None if metrics_port < 0 else metrics_port, batch_wait_ms=batch_wait_ms,
        max_message_bytes=max_message_bytes, grace_seconds=grace_seconds, shm_dir=shm_dir,
        data_port=None if data_port < 0 else data_port, data_host=data_host or None,
        routing_table=routing_table, routing_configmap=routing_configmap, address=address, drop_after=drop_after,
        working_memory_bytes=working_memory_mib << 20,
        **({} if cuda_graph_tokens is None else {"cuda_graph_tokens": cuda_graph_tokens}),
    )
    busy_poll.run(serve(config), busy_poll_us)


if __name__ == "__main__":
    command()
