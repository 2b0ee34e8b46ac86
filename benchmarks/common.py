"""Shared by the benchmarks: what machine ran them, at which commit, and the results file with its goals.

A results file is benchmarks/results/<benchmark>_<machine>.json:
{"machine": ..., "date": ..., "commit": ..., "device": ..., "raw": [rows], "goals": {name: {"value", "goal", "met"}}}
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Goal:
    value: float
    goal: str  # "<= 1.0", ">= 2.0", "< 0.2" or "> 0"

    @property
    def met(self) -> bool:  # a value that is no number (NaN: not measured; inf: a division by zero) never meets it
        op, bound = self.goal.split()
        if not math.isfinite(self.value):
            return False
        return {"<=": float.__le__, ">=": float.__ge__, "<": float.__lt__, ">": float.__gt__}[op](float(self.value), float(bound))

    def as_dict(self) -> dict:
        return {"value": round(self.value, 4), "goal": self.goal, "met": self.met}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_slug(device: torch.device) -> str:
    """A short file-name part: the GPU model (`h200`) on CUDA, `cpu<cores>` otherwise."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        match = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
        return match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return f"cpu{os.cpu_count()}"


def cpu_list_size(text: str) -> int:
    """How many CPUs a kernel CPU list names ("0-3,8,10-11" -> 7)."""
    size = 0
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        size += int(last or first) - int(first) + 1
    return size


def threads_per_core() -> int | None:
    """Logical CPUs sharing the first one's core (2 with SMT: `cores` then counts each twice)."""
    try:
        return cpu_list_size(Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text())
    except (OSError, ValueError):
        return None


def cpu_mhz() -> float | None:
    """The highest clock /proc/cpuinfo reports now: lent hosts of one model ran host-bound work 2x apart."""
    try:
        clocks = [float(line.split(":", 1)[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        return None
    return max(clocks, default=None)


def describe_machine(device: torch.device) -> dict:
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads_per_core": threads_per_core(), "cpu_mhz": cpu_mhz(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0]}  # other work on the machine skews latencies: say so
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def gpu_sharing(device: torch.device) -> str:
    """How the processes of a run share its GPU: "mps" where run_h200.sh started the MPS daemon
    (KUBEMOE_MPS=1: its pipe is in the environment every process inherits), else "time-slicing"; "none"
    off a GPU."""
    if device.type != "cuda":
        return "none"
    return "mps" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "time-slicing"


def git_commit() -> str:
    """HEAD here; on a machine that got the tree without .git (the lent GPU), KUBEMOE_COMMIT."""
    if os.environ.get("KUBEMOE_COMMIT"):
        return os.environ["KUBEMOE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def strict_json(value):
    """`value` with every float that is no number (NaN: a figure a run could not measure, e.g. a goal whose baseline
    was not run; inf: a division by zero) as None: json.dumps would write NaN or Infinity, which strict JSON readers
    (jq, JavaScript) refuse. Such a goal stays in the file, as null and unmet."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_results(benchmark: str, device: torch.device, raw: list[dict], goals: dict[str, Goal],
                  out: Path = RESULTS, **extra) -> Path:
    """Writes the results file, printing each goal as it goes into it (every run shows its ratios) and where
    the file went."""
    for name, goal in goals.items():
        print(f"goal {name}: {goal.value:.4f} {goal.goal} ({'met' if goal.met else 'NOT met'})")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}_{machine_slug(device)}.json"
    doc = {
        "machine": machine_slug(device),
        "machine_info": describe_machine(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": str(device),
        **extra,
        "raw": raw,
        "goals": {name: goal.as_dict() for name, goal in goals.items()},
    }
    path.write_text(json.dumps(strict_json(doc), indent=2, allow_nan=False) + "\n")
    print(f"wrote {path}" + (f" in {extra['seconds']:.0f} s" if "seconds" in extra else ""))
    return path


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    widths = [max(len(h), 8) for _, h, _ in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        print("  ".join(format(row[k], f).rjust(w) for (k, _, f), w in zip(columns, widths)))


def mixtral_layout_checkpoint(out: Path, hidden: int, intermediate: int, dtype: str, layers: int = 1,
                              experts: int = 2, top_k: int = 1) -> Path:
    """A generated Mixtral-architecture checkpoint with experts of a bench size (random weights,
    a token embedding of 512 words: only the experts matter to the benchmarks that use it).

    At least two experts: MoEAdapter reads a single per-expert tensor name as a fused 3-D layout.
    """
    from kubemoe.presets import Preset
    from kubemoe.synth import make_checkpoint

    preset = Preset("mixtral", f"bench-{hidden}x{intermediate}", dict(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_local_experts=experts,
        num_experts_per_tok=top_k, vocab_size=512, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=False), dtype=dtype, shard_bytes=4 << 30)
    return make_checkpoint(preset, out, progress=False)
