"""`kubemoe plan`: the plan kubemoe's scaler and placer make for a checkpoint under given loads, for people.

    kubemoe plan --checkpoint DIR --loads loads.json --nodes 2 [--gpus-per-node 8] [--gpu-memory 80Gi] [--cv 0.2]

`--loads` is a frontend's /loads (a JSON kubemoe.v1.LoadReport) or a list of them; the plan uses
each expert's predicted tokens/s where the report has it, else the observed one. It prints per
layer the replicas, the busiest expert's replicas and the CV of per-replica loads before (one
replica each) and after scaling, then GPUs used and what did not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import click

from kubemoe.errors import KubemoeError
from kubemoe.planning.placer import GPU, Placement, place
from kubemoe.planning.scaler import layer_cv, scale
from kubemoe.sizes import ByteSize


@dataclass(frozen=True)
class LayerRow:
    layer: int
    experts: int
    replicas: int
    max_replicas: int
    cv_before: float
    cv_after: float


@dataclass(frozen=True)
class PlanSummary:
    rows: list[LayerRow]
    placement: Placement
    gpus: int
    layers: tuple[int, ...]


def loads_matrix(rates: Mapping[tuple[int, int], float], moe_layers: Sequence[int], num_experts: int) -> list[list[float]]:
    """{(layer, expert): tokens/s} -> [L][E] in `moe_layers` order; refuses experts the model lacks."""
    index = {layer: i for i, layer in enumerate(moe_layers)}
    matrix = [[0.0] * num_experts for _ in moe_layers]
    for (layer, expert), rate in rates.items():
        if layer not in index or not 0 <= expert < num_experts:
            raise KubemoeError(f"the loads name expert {expert} of layer {layer}, which this checkpoint does not have "
                               f"(MoE layers {list(moe_layers)}, experts 0..{num_experts - 1}): pass the loads of "
                               "the model this checkpoint holds")
        matrix[index[layer]][expert] += rate
    return matrix


def summarize(loads: Sequence[Sequence[float]], moe_layers: Sequence[int], expert_bytes: int, gpus: Sequence[GPU],
              cv: float, max_per_expert: int, layer_memory_cap: int | None, min_replica_load: float = 0.0) -> PlanSummary:
    """Pure: scale, then place, and what a person wants to see of it."""
    replicas = scale(loads, expert_bytes, cv, layer_memory_cap, max_per_expert, min_replica_load)
    placement = place(replicas, loads, gpus, expert_bytes, min_replica_load=min_replica_load)
    rows = [LayerRow(layer, len(row), sum(counts), max(counts), layer_cv(row, [1] * len(row)), layer_cv(row, counts))
            for layer, row, counts in zip(moe_layers, loads, replicas)]
    return PlanSummary(rows, placement, len(gpus), tuple(moe_layers))


def render(summary: PlanSummary, expert_bytes: int) -> list[str]:
    lines = [f"{'layer':>6} {'experts':>8} {'replicas':>9} {'max/expert':>11} {'CV before':>10} {'CV after':>9}"]
    lines += [f"{r.layer:>6} {r.experts:>8} {r.replicas:>9} {r.max_replicas:>11} {r.cv_before:>10.3f} {r.cv_after:>9.3f}"
              for r in summary.rows]
    p = summary.placement
    placed = len(p.gpu_of)
    peak = max(p.gpu_memory.values(), default=0)
    lines.append(f"{placed} replicas ({_size(placed * expert_bytes)}) on {p.gpus_used()} of {summary.gpus} GPUs; "
                 f"fullest GPU {_size(peak)}")
    if p.unplaced:
        shown = ", ".join(f"layer {summary.layers[l]} expert {e} #{i}" for l, e, i in p.unplaced[:10])
        more = f" and {len(p.unplaced) - 10} more" if len(p.unplaced) > 10 else ""
        lines.append(f"UNPLACED: {len(p.unplaced)} replicas fit no GPU ({shown}{more}): add nodes or GPU memory, "
                     "or raise --cv")
    else:
        lines.append("unplaced: none")
    return lines


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@click.command("plan")
@click.option("--checkpoint", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True,
              help="Checkpoint folder: its MoE layers, experts and expert size.")
@click.option("--loads", "loads_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), required=True,
              help="A frontend's /loads (JSON LoadReport), or a JSON list of them.")
@click.option("--nodes", type=click.IntRange(1), required=True, help="GPU nodes to plan for.")
@click.option("--gpus-per-node", type=click.IntRange(1), default=8, show_default=True)
@click.option("--gpu-memory", type=ByteSize(), default="80Gi", show_default=True,
              help="Memory per GPU for expert replicas.")
@click.option("--cv", type=click.FloatRange(min=0), default=0.2, show_default=True,
              help="Scale until the CV of per-replica loads in a layer is at most this.")
@click.option("--max-per-expert", type=click.IntRange(1), default=8, show_default=True)
@click.option("--layer-memory-cap", type=ByteSize(), default=None,
              help="Memory cap per layer's replicas, e.g. 16Gi [default: none].")
def plan_command(checkpoint: Path, loads_file: Path, nodes: int, gpus_per_node: int, gpu_memory: int, cv: float,
                 max_per_expert: int, layer_memory_cap: int | None) -> None:
    """Print the replicas and GPUs kubemoe would plan for these loads."""
    from kubemoe.adapters import MoEAdapter
    from kubemoe.checkpoint import Checkpoint
    from kubemoe.devices import resolve_dtype
    from kubemoe.load_report import LoadReportError, parse_reports, passes_per_second, rates
    from kubemoe.planning.latency import min_replica_load

    ckpt = Checkpoint(checkpoint)
    adapter = MoEAdapter(ckpt.config)
    dtype = resolve_dtype(None, ckpt.config)
    expert_bytes = adapter.expert_bytes(dtype)
    try:
        reports = parse_reports(loads_file.read_text())
    except LoadReportError as e:
        raise KubemoeError(f"{loads_file}: {e}") from None
    loads = loads_matrix(rates(reports), adapter.moe_layers, adapter.num_experts)
    gpus = [GPU(f"node{n}/gpu{g}", f"node{n}", gpu_memory) for n in range(nodes) for g in range(gpus_per_node)]
    least = min_replica_load(expert_bytes, dtype.itemsize, passes_per_second(reports))
    summary = summarize(loads, adapter.moe_layers, expert_bytes, gpus, cv, max_per_expert, layer_memory_cap, least)
    click.echo(f"{adapter.arch.name}: {len(adapter.moe_layers)} MoE layers x {adapter.num_experts} experts of "
               f"{expert_bytes / 2**20:.1f} MiB; {sum(map(sum, loads)):.1f} tokens/s routed (from {len(reports)} "
               f"report{'s' if len(reports) != 1 else ''})")
    for line in render(summary, expert_bytes):
        click.echo(line)
