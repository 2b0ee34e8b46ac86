"""The `kubemoe` command line. Each component adds its own subcommand group here."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import click

from kubemoe import __version__
from kubemoe.errors import KubemoeError
from kubemoe.presets import PRESETS


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kubemoe")
def cli() -> None:
    """kubemoe: serve Mixture-of-Experts models on Kubernetes with serverless expert functions."""


@cli.group()
def checkpoint() -> None:
    """Make, inspect and verify safetensors checkpoints."""


@checkpoint.command("make")
@click.option("--arch", type=click.Choice(sorted({arch for arch, _ in PRESETS})), required=True, help="Model architecture.")
@click.option("--preset", default="tiny", show_default=True,
              help="Size preset: " + ", ".join(sorted({p for _, p in PRESETS})) + ".")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in --out.")
def checkpoint_make(arch: str, preset: str, out: Path, seed: int, force: bool) -> None:
    """Write a random-weight checkpoint laid out like a downloaded model."""
    from kubemoe.presets import get_preset
    from kubemoe.synth import make_checkpoint

    spec = get_preset(arch, preset)
    if force and out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    make_checkpoint(spec, out, seed=seed, progress=sys.stderr.isatty())
    size = sum(f.stat().st_size for f in out.iterdir())
    click.echo(f"wrote {arch}/{preset} checkpoint to {out} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f}s")


@checkpoint.command("train")
@click.option("--size", type=click.Choice(["small", "base"]), default="small", show_default=True,
              help="small: trains in under 2 minutes on a 2-core CPU; base: in under 3 minutes on one H200.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder to write.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of initialisation and data order.")
@click.option("--steps", type=click.IntRange(0), default=None,
              help="Optimiser steps (default: the size's; 0 writes the untrained model, a random-weight baseline).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in --out.")
def checkpoint_train(size: str, out: Path, seed: int, steps: int | None, device: str, force: bool) -> None:
    """Train kubemoe's own small Mixtral-style MoE on the Python standard library's text."""
    from kubemoe.devices import resolve_device
    from kubemoe.train import get_recipe, train_moe

    if force and out.exists():
        shutil.rmtree(out)
    report = train_moe(get_recipe(size), out, seed=seed, device=resolve_device(device), steps=steps,
                       progress=sys.stderr.isatty())
    final = report.losses[-1][1] if report.losses else float("nan")
    click.echo(f"trained {size} MoE for {report.steps} steps ({report.tokens_seen:,} tokens) in {report.seconds:.1f}s "
               f"on {report.device}: loss {final:.3f}, held-out loss {report.held_out_loss:.3f}; wrote {out}")


@checkpoint.command("inspect")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
def checkpoint_inspect(path: Path) -> None:
    """Print what kubemoe sees in a checkpoint: MoE layers, experts, routing, sizes."""
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.devices import resolve_dtype

    ckpt = Checkpoint(path)
    adapter = MoEAdapter(ckpt.config)
    dtype = resolve_dtype(None, ckpt.config)
    rows = [
        ("architecture", adapter.arch.name),
        ("layers", adapter.num_layers),
        ("moe layers", ",".join(map(str, adapter.moe_layers))),
        ("experts per layer", adapter.num_experts),
        ("experts per token", adapter.top_k),
        ("routing", adapter.routing),
        ("shared experts", adapter.has_shared_experts),
        ("hidden / expert size", f"{adapter.hidden_size} / {adapter.expert_intermediate_size}"),
        ("bytes per expert", f"{adapter.expert_bytes(dtype):,} ({dtype})"),
        ("checkpoint bytes", f"{ckpt.nbytes():,} in {len(set(ckpt.weight_map.values()))} shards"),
    ]
    for key, value in rows:
        click.echo(f"{key:>22}: {value}")


@checkpoint.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
def checkpoint_verify(path: Path) -> None:
    """Check kubemoe's experts and routers against transformers on this checkpoint (float32)."""
    from kubemoe.verify import verify_checkpoint

    report = verify_checkpoint(path)
    click.echo(f"{report.arch}: transformers model loaded in {report.load_seconds:.2f}s")
    for row in report.layers:
        click.echo(f"  layer {row.layer:>2}: expert FFN rel err {row.expert_rel_err:.1e}, router "
                   f"{'same experts' if row.router_same_experts else 'DIFFERENT experts'}, weights rel err "
                   f"{row.router_weight_rel_err:.1e}")
    click.echo(f"  forward pass with kubemoe experts: logits rel err {report.logits_rel_err:.1e}")
    if not report.ok:
        raise KubemoeError("kubemoe does not reproduce transformers on this checkpoint (limits: 1e-5 per expert, 1e-4 logits)")
    click.echo("OK")


def _add_component_commands() -> None:
    # Each component owns its commands; importing them is cheap (heavy imports happen inside).
    from kubemoe.devcluster.cli import dev
    from kubemoe.expert_fn.cli import command as expert_fn
    from kubemoe.frontend.cli import frontend_command, serve_command
    from kubemoe.frontend.predictor_cli import command as predictor
    from kubemoe.operator.cli import command as operator_command
    from kubemoe.plan_cli import plan_command

    for command in (serve_command, frontend_command, expert_fn, predictor, operator_command, plan_command, dev):
        cli.add_command(command)


_add_component_commands()


def main() -> None:
    """Entry point: user-facing errors are one line on stderr; KUBEMOE_DEBUG=1 shows tracebacks."""
    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KubemoeError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - the promise is one line, whatever went wrong
        if os.environ.get("KUBEMOE_DEBUG"):
            raise
        click.echo(f"error: {type(e).__name__}: {e} (set KUBEMOE_DEBUG=1 for a traceback)", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
