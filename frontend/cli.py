"""`kubemoe frontend` (one frontend, experts wherever its routing table says) and `kubemoe serve`."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import click

from kubemoe import logs, offload_env, pod_args, ports
from kubemoe.busy_poll import SHARED_CORES_BUSY_POLL_US
from kubemoe.expert_fn.cli import busy_poll_option, shm_dir_option
from kubemoe.frontend.embedded import shared_cores_env
from kubemoe.frontend.offload.config import POLICIES
from kubemoe.sizes import ByteSize


checkpoint_option = click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path),
                                 help="Checkpoint folder (safetensors, config.json, tokenizer).")
_SERVING_OPTIONS = (  # what both commands serve with, in --help order
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on."),
    click.option("--port", default=ports.FRONTEND_HTTP, show_default=True, help="HTTP port (OpenAI-compatible API)."),
    click.option("--grpc-port", default=ports.FRONTEND_GRPC, show_default=True, help="gRPC port (Generate)."),
    click.option("--max-batch", default=32, show_default=True, help="Sequences decoded together."),
    click.option("--max-step-tokens", type=click.IntRange(1), default=None,
                 help="Tokens one engine step computes: a decode token per running sequence, prompt chunks in "
                      "the rest (a longer prompt is prefilled over several steps, so the batch keeps decoding). "
                      "Default: 2048 on a GPU, 256 on CPU."),
    click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                 help="On a GPU, replay each decode pass as a CUDA graph captured once per batch size (not in "
                      "offload mode); off: every kernel launched one by one."),
    click.option("--lookahead/--no-lookahead", default=True, show_default=True,
                 help="On a GPU with every expert in this process, launch a greedy batch's next decode pass from "
                      "this pass's argmax before reading its tokens, so the host's work overlaps the GPU's; off: "
                      "each step's tokens are read before the next pass starts."),
    click.option("--compile/--no-compile", default=False, show_default=True,
                 help="Compile decode passes with torch.compile (TorchInductor), so each layer's norms, rotary "
                      "embedding, router and residual adds run as a few fused kernels; the routed experts stay "
                      "as they are. The first decode pass of one row and of several compile every layer (a "
                      "request waits for it); a compile that fails is logged and decoding goes on uncompiled."),
    click.option("--kv-cache-bytes", type=ByteSize(), default=None,
                 help="Memory for the running batch's KV cache (20Gi, 512Mi or bytes): requests are admitted while "
                      "it has room and the latest are preempted (recomputed later) when it runs out. Default: "
                      "--kv-cache-fraction of the GPU memory free after the first prompt; unbounded on CPU."),
    click.option("--kv-cache-fraction", type=click.FloatRange(0, 1, min_open=True), default=0.9, show_default=True,
                 help="Share of the free GPU memory the KV cache may take when --kv-cache-bytes is not given."),
    shm_dir_option("expert functions"),
    click.option("--device-links/--no-device-links", default=True, show_default=True,
                 help="Lend expert functions on this GPU (with --shm-dir) device buffers through CUDA IPC, so a "
                      "decode step's remote layers never leave the GPU and neither side's host waits within a "
                      "step (expert_fn/device_link.py); a step a function fails runs again as calls."),
    click.option("--predictor", default="router", show_default=True, metavar="router|none|FILE",
                 help="Expert-load predictor: the next layers' routers unchanged, none, or a file from "
                      "`kubemoe predictor train`. One that fails to load leaves the frontend serving without "
                      "predictions (/readyz says why)."),
    click.option("--prediction-distance", type=click.IntRange(1), default=1, show_default=True,
                 help="Predict MoE layer l+d's loads at layer l (MoEless's d)."),
    click.option("--split-min-tokens", type=click.IntRange(1), default=64, show_default=True,
                 help="Split a hot expert's tokens of one step across its bundle's replicas in parts of at least "
                      "this many tokens (below the FFN's knee a part costs a whole weight read)."),
    click.option("--record-routing", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Write routing records (hidden states entering each MoE layer and the experts chosen) "
                      "into this folder, for `kubemoe predictor train`. Off by default."),
    click.option("--record-max-mb", type=click.IntRange(1), default=1024, show_default=True,
                 help="Stop recording routing once this many MiB are written."),
    busy_poll_option("expert replies", SHARED_CORES_BUSY_POLL_US,
                     " The default is 1000 on nodes with 8 or more cores, else 0: on fewer, the expert "
                     "functions compute on the core a polling frontend would take."),
)




_OFFLOAD_OPTIONS = (  # the operator renders them as environment (kubemoe/offload_env.py)
    click.option("--offload", is_flag=True, default=offload_env.offload_mode,
                 help=f"Offload mode (LayerScope): every expert of the model in host memory, the hottest on the GPU "
                      f"within --gpu-budget, the rest copied on demand, prefetched or computed on the CPU. "
                      f"Default: on when {offload_env.MODE}={offload_env.OFFLOAD}."),
    click.option("--gpu-budget", type=ByteSize(), envvar=offload_env.GPU_BUDGET, default=None,
                 help="GPU memory for expert weights in offload mode (hot experts, two on-demand slots, two prefetch "
                      f"groups): 20Gi, 512Mi or bytes. Env: {offload_env.GPU_BUDGET}."),
    click.option("--offload-predictor", default="llapor", show_default=True, envvar=offload_env.PREDICTOR,
                 metavar="llapor|router|frequency|FILE",
                 help=f"What predicts the next layer's experts for prefetching: llapor ({offload_env.LLAPOR_FILE} in "
                      "the checkpoint folder; the next layer's router if there is none), router, frequency (no "
                      "prediction: the hot table alone), or the path of a file of `kubemoe predictor train --kind "
                      "llapor` (the operator renders spec.offload.predictorFile so). A file made for another "
                      f"checkpoint, or a named file that is missing, stops the start. Which one serves is logged. "
                      f"Env: {offload_env.PREDICTOR}."),
    click.option("--offload-policy", type=click.Choice(POLICIES), default="kubemoe", show_default=True,
                 help="Who places the experts: kubemoe (PreSched) or a baseline run by the same engine."),
)


def serving_options(command):
    for option in reversed(_SERVING_OPTIONS + _OFFLOAD_OPTIONS):
        command = option(command)
    return command


def _offload_config(offload: bool, gpu_budget: int | None, predictor: str, policy: str):
    from kubemoe.frontend.offload.config import OffloadConfig

    if not offload:
        return None
    if gpu_budget is None:
        raise click.UsageError(f"offload mode needs --gpu-budget (or {offload_env.GPU_BUDGET}): GPU memory for "
                               "expert weights, e.g. 20Gi")
    return OffloadConfig(gpu_budget, predictor=predictor, policy=policy)


def _cpu_experts_sleep_when_idle(offload: bool) -> None:
    """Offload mode's CPU experts run on an OpenMP team of every core but one, beside the thread that launches
    the GPU's work. OpenMP's threads spin for milliseconds after each parallel region by default, so with CPU
    experts in most layers the team spins through the step, and whenever anything else on the node wants a
    core (another pod, the CUDA runtime's threads) that thread and the team's stragglers wait for it
    (benchmarks/experiments/openmp_spin.py on a 2-core CPU, a team of 2 beside the launching thread and two busy
    processes: that thread 3.1x slower and each expert 8.8 ms with spinning threads, 1.4x and 3.7 ms with idle
    ones asleep; on free cores spinning was a little faster, 1.25x against 1.45x). Called before anything
    imports torch: OpenMP reads the policy once, when torch loads."""
    if offload:
        os.environ.update(shared_cores_env())


def _serve(config, host: str, port: int, grpc_port: int, banner) -> None:
    from kubemoe.frontend.app import Frontend
    from kubemoe.frontend.server import serve_frontend
    from kubemoe.gc_freeze import settle

    logs.configure()  # the pod's log says what the frontend chose (predictor, resident experts), not only warnings
    frontend = Frontend(config)
    settle()  # the model and its clients are built: out of the GC's sight (kubemoe/gc_freeze.py)
    asyncio.run(serve_frontend(frontend, host, port, grpc_port, on_ready=lambda h, g: banner(frontend, h, g)))


@click.command("frontend")
@checkpoint_option
@click.option("--routing-table", type=click.Path(dir_okay=False, path_type=Path),
              help="Routing table file (JSON kubemoe.v1.RoutingTable), re-read when it changes.")
@click.option("--routing-configmap", metavar="NAMESPACE/NAME", help="ConfigMap holding routing.json (watched).")
@serving_options
@click.option("--model", default="", help="Model id clients send (default: the checkpoint folder's name).")
@click.option("--name", default="", envvar=pod_args.FRONTEND_NAME_ENV,
              help="This frontend's name in load reports (default: the host name).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's).")
def frontend_command(host, port, grpc_port, **options):
    """Serve a model: attention and routing here, routed experts per the routing table (or, with --offload,
    every expert here from host memory through a GPU cache)."""
    _cpu_experts_sleep_when_idle(options["offload"])
    from kubemoe.expert_fn.shm import shared_folder

    # A pod's folder in the node's /dev/shm is made by whichever pod comes first.
    options["shm_dir"] = shared_folder(options["shm_dir"])
    _serve(frontend_config(**options), host, port, grpc_port, _banner)


def frontend_config(*, checkpoint, routing_table, routing_configmap, **options):
    """`kubemoe frontend`'s options but the listening ones -> its FrontendConfig (raises click.UsageError)."""
    from kubemoe.frontend.app import FrontendConfig

    if checkpoint is None:
        raise click.UsageError("--checkpoint is required")
    if bool(routing_table) and bool(routing_configmap) or not (routing_table or routing_configmap or options["offload"]):
        raise click.UsageError("give exactly one of --routing-table and --routing-configmap (in offload mode "
                               "neither is needed: every expert runs here)")
    return FrontendConfig(checkpoint=checkpoint, routing_table=routing_table, routing_configmap=routing_configmap,
                          **config_fields(options))


def config_fields(options: dict) -> dict:
    """Options as click parsed them -> FrontendConfig fields: each under its own name, the offload options
    as one OffloadConfig (None: not offloading)."""
    fields = dict(options)
    fields["offload"] = _offload_config(fields.pop("offload"), fields.pop("gpu_budget"), fields.pop("offload_predictor"),
                                        fields.pop("offload_policy"))
    return fields


@click.command("serve")
@checkpoint_option
@click.option("--arch", default="mixtral", show_default=True,
              help="Architecture of the generated tiny checkpoint used when --checkpoint is not given.")
@click.option("--experts", default=2, show_default=True, help="Local expert-function processes.")
@serving_options
def serve_command(checkpoint, arch, experts, host, port, grpc_port, **options):
    """Run everything locally: a frontend and expert functions over gRPC on loopback (with --offload: the
    frontend alone, every expert in its host memory and GPU cache).

    With no arguments it generates (or reuses) a tiny checkpoint in ~/.cache/kubemoe."""
    _cpu_experts_sleep_when_idle(options["offload"])
    from kubemoe.checkpoint import default_model_id
    from kubemoe.frontend.app import FrontendConfig
    from kubemoe.frontend.embedded import default_checkpoint, embedded_bundles, expert_processes
    from kubemoe.routing_table import table_for_bundles, to_json

    fields = config_fields(options)
    checkpoint = checkpoint or default_checkpoint(arch)
    if fields["offload"]:
        _serve(FrontendConfig(checkpoint=checkpoint, **fields), host, port, grpc_port,
               lambda fe, h, g: _banner(fe, h, g, ", experts offloaded in this process"))
        click.echo("stopped", err=True)
        return
    bundles = embedded_bundles(checkpoint, experts)
    model = default_model_id(checkpoint)
    click.echo(f"starting {len(bundles)} expert functions for {model} ...", err=True)
    with expert_processes(checkpoint, bundles, model, shm_dir=fields["shm_dir"],
                          busy_poll_us=fields["busy_poll_us"]) as experts, tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "routing.json"
        table.write_text(to_json(table_for_bundles(model, bundles, experts.addresses)))
        _serve(FrontendConfig(checkpoint=checkpoint, routing_table=table, **fields), host, port, grpc_port,
               lambda fe, h, g: _banner(fe, h, g, f", experts in {len(bundles)} local processes"))
    click.echo("stopped", err=True)


def _banner(frontend, http_port: int, grpc_port: int, extra: str = "") -> None:
    host = "127.0.0.1"
    click.echo(f"kubemoe is serving {frontend.model_id} at http://{host}:{http_port}/v1 (gRPC {host}:{grpc_port}){extra}")
    click.echo(f"try: curl http://{host}:{http_port}/v1/chat/completions -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"{frontend.model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": "
               f"\"Hello!\"}}], \"max_tokens\": 16}}'")
    click.echo("press Ctrl-C to stop", err=True)

