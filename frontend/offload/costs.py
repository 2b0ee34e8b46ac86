"""Cost figures of the offload path: what LayerScope's Timer measures, as one JSON-serialisable profile.

Per expert size (bytes of one routed expert's gate, up and down projections):
- t_io: seconds to copy one expert host -> GPU from pinned memory, copies streaming back to back (no token term:
  the bytes are fixed);
- t_g(n): GPU seconds for one expert on n tokens, run on its own;
- the grouped line: GPU seconds per expert when a layer's experts already on the device run as one grouped
  FFN (`t_g_all`; measured where the kernels group, the group's time shared by its experts);
- t_c(n) = beta * n + C: CPU seconds for one expert on n tokens (C: reading the weights, starting threads).
And t_attn(n): one layer's attention and gate on the GPU for a batch of n tokens.

Token-dependent figures are lines (`CostLine`). The profile lies beside a checkpoint as
`offload_profile.json`, naming the device it was measured on. Pure: a Timer (later) times copies and
kernels, fits the lines offline with `fit_line` and keeps them fresh online through `ProfileRefresher`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

PROFILE_FILE = "offload_profile.json"
# A layer's experts already on the device run as one grouped FFN from this many on (where the kernels group).
# On the H200 (grouped_slots_probe at 66ed960, queued calls): four Mixtral-size experts grouped 0.35 ms, one
# FFN each 0.40 (two: 0.22 against 0.20); four Qwen3-30B-A3B-size ones 0.07 against 0.25. The executor runs
# them so, and the cost model prices them so.
GROUPED_MIN_EXPERTS = 4


@dataclass(frozen=True)
class CostLine:
    """seconds(tokens) = slope * tokens + intercept."""

    slope: float = 0.0  # seconds per token (beta, for the CPU line)
    intercept: float = 0.0  # seconds at zero tokens (C)

    def __post_init__(self) -> None:
        if self.slope < 0 or self.intercept < 0:
            raise ValueError(f"a cost line needs slope >= 0 and intercept >= 0, got {self}")

    def __call__(self, tokens: float) -> float:
        return self.slope * tokens + self.intercept

    def each(self, tokens: Iterable[float]) -> list[float]:
        """[self(n) for n in tokens], without a call per item: policies price every expert of a layer, every
        layer of every step, on the host thread that launches the GPU's work."""
        slope, intercept = self.slope, self.intercept
        return [slope * n + intercept for n in tokens]

    def total(self, tokens: Sequence[float]) -> float:
        """sum(self.each(tokens)), from the tokens' sum (builtin, no list made)."""
        return self.slope * sum(tokens) + self.intercept * len(tokens)


class LineFit:
    """Least squares of seconds on tokens, optionally exponentially weighted (the online refresh).

    `forget` is the EMA's alpha: each new sample scales the weight of all earlier ones by (1 - forget);
    0 gives the plain least-squares fit. The fit keeps the five weighted sums it needs, never the samples.
    """

    def __init__(self, forget: float = 0.0):
        if not 0 <= forget < 1:
            raise ValueError(f"forget must be in [0, 1), got {forget}")
        self.forget = forget
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        keep = 1.0 - self.forget
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + tokens * tokens
        self._xy = keep * self._xy + tokens * seconds

    def line(self) -> CostLine | None:
        """The fitted line, or None while the samples span fewer than two token counts."""
        if self._w == 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-12 * max(1.0, mean_x * mean_x):
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        intercept = mean_y - slope * mean_x
        # Costs cannot be negative: where the free fit crosses zero, fit the remaining term alone
        # (the constrained least-squares optimum lies on that boundary).
        if slope < 0:
            return CostLine(0.0, max(mean_y, 0.0))
        if intercept < 0:
            return CostLine(max(self._xy / self._xx, 0.0), 0.0)
        return CostLine(slope, intercept)


def fit_line(samples: Iterable[tuple[float, float]]) -> CostLine:
    """Least-squares (slope, intercept) from (tokens, seconds) samples, e.g. t_c's (beta, C)."""
    fit = LineFit()
    for tokens, seconds in samples:
        fit.add(tokens, seconds)
    line = fit.line()
    if line is None:
        raise ValueError("fitting a cost line needs samples at two or more different token counts")
    return line


@dataclass(frozen=True)
class ExpertCosts:
    """The figures for one expert size."""

    expert_bytes: int
    t_io: float  # seconds, host -> GPU, pinned
    gpu: CostLine  # t_g: one expert's FFN on its own
    cpu: CostLine  # t_c = beta * tokens + C
    grouped: CostLine | None = None  # t_g per expert inside one grouped FFN; None where the kernels do not group

    def t_g(self, tokens: float) -> float:
        return self.gpu(tokens)

    def groups(self, experts: int) -> bool:
        """Whether `experts` experts already on the device run as one grouped FFN."""
        return self.grouped is not None and experts >= GROUPED_MIN_EXPERTS

    def t_g_all(self, tokens: Sequence[float]) -> float:
        """GPU seconds of one layer's experts already on the device, with these token counts, run as the
        executor runs them: one grouped FFN (`groups`), else one FFN each. A Qwen3-30B-A3B-size expert's FFN
        alone is launch-bound (0.08 ms on the H200 for 2 us of weight reads); priced so, tens of resident ones
        made a busy GPU side that PreSched balanced with CPU experts."""
        return sum(self.t_g_each(tokens))

    def t_g_each(self, tokens: Sequence[float]) -> list[float]:
        """Each expert's part of `t_g_all`: its share of the grouped FFN where they group, else its FFN alone."""
        return self.shared_each(tokens) if self.groups(len(tokens)) else self.gpu.each(tokens)

    @property
    def shared(self) -> CostLine:
        """An expert's share of one grouped FFN (its FFN alone where the kernels do not group)."""
        return self.grouped or self.gpu

    def shared_each(self, tokens: Iterable[float]) -> list[float]:
        return self.shared.each(tokens)

    def t_c(self, tokens: float) -> float:
        return self.cpu(tokens)


class GroupSeconds:
    """`ExpertCosts.t_g_all` of experts that run together, kept up to date as they join one at a time: a layer's
    on-demand loads (the executor computes them in grouped batches where there are enough of them), or a later
    layer's resident experts and the prefetches that join them. Priced per expert alone, a Qwen3-30B-A3B-size
    load cost PreSched ~8x its share of a grouped FFN, and experts the GPU would have run almost for free went
    to the CPU."""

    __slots__ = ("groups_from", "experts", "alone", "shared")

    def __init__(self, costs: ExpertCosts, tokens: Sequence[float] = ()):
        self.groups_from = GROUPED_MIN_EXPERTS if costs.grouped is not None else math.inf
        self.experts = len(tokens)
        self.alone = costs.gpu.total(tokens)
        self.shared = costs.shared.total(tokens)

    @property
    def seconds(self) -> float:
        return self.shared if self.experts >= self.groups_from else self.alone

    def join(self, alone: float, shared: float) -> float:
        """One more expert, its FFN alone taking `alone` seconds and its share of a grouped one `shared`.
        -> the seconds the group grows by (PreSched's GPU queue calls this per candidate: no property calls)."""
        n = self.experts = self.experts + 1
        self.alone += alone
        self.shared += shared
        if n != self.groups_from:  # grouped before and after, or alone before and after
            return shared if n > self.groups_from else alone
        return self.shared - (self.alone - alone)  # the experts become one grouped FFN


@dataclass(frozen=True)
class OffloadProfile:
    device: str  # where the figures come from, e.g. "Tesla V100-PCIE-32GB, PCIe 3.0 x16, 2x Xeon 6248"
    experts: tuple[ExpertCosts, ...]  # one per expert size of the model
    attn: CostLine  # t_attn, one layer, by batch tokens
    source: str = "measured"  # or "assumed" / "modelled": say which, results quote it

    def __post_init__(self) -> None:
        sizes = [e.expert_bytes for e in self.experts]
        if not sizes or len(set(sizes)) != len(sizes):
            raise ValueError(f"a profile needs one entry per expert size, got sizes {sizes}")

    def costs(self, expert_bytes: int) -> ExpertCosts:
        for entry in self.experts:
            if entry.expert_bytes == expert_bytes:
                return entry
        sizes = ", ".join(str(e.expert_bytes) for e in self.experts)
        raise ValueError(f"the profile has no figures for {expert_bytes}-byte experts (it has {sizes}): "
                         "re-profile for this checkpoint")

    def t_attn(self, tokens: float) -> float:
        return self.attn(tokens)

    def at_bandwidth(self, bytes_per_s: float, label: str) -> "OffloadProfile":
        """The same profile with t_io = bytes / bandwidth: what another link (PCIe 3.0, 4.0) would give."""
        return replace(
            self,
            experts=tuple(replace(e, t_io=e.expert_bytes / bytes_per_s) for e in self.experts),
            device=f"{self.device}; t_io scaled to {label} ({bytes_per_s / 1e9:g} GB/s)",
            source="modelled",
        )

    # -- stored beside the checkpoint -----------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "OffloadProfile":
        experts = tuple(
            ExpertCosts(e["expert_bytes"], e["t_io"], CostLine(**e["gpu"]), CostLine(**e["cpu"]),
                        CostLine(**e["grouped"]) if e.get("grouped") else None)
            for e in doc["experts"]
        )
        return cls(doc["device"], experts, CostLine(**doc["attn"]), doc.get("source", "measured"))

    def save(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / PROFILE_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> "OffloadProfile":
        path = Path(checkpoint_dir) / PROFILE_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: profile the checkpoint on this machine first")
        return cls.from_dict(json.loads(path.read_text()))


class ProfileRefresher:
    """Keeps a profile fresh from online timings: EMA of t_io, exponentially weighted fits of the GPU and
    attention lines, and a scale on the CPU line.

    A fitted line keeps its stored value until the recent samples span two token counts (one token count
    cannot separate slope from intercept). The CPU line is scaled, never refitted: serving's CPU experts
    mostly see a few tokens each (decode), and a slope fitted from those is noise that would then price a
    prefill expert of hundreds of tokens; the profiled slope spans that range, and what serving changes
    (weights read from DRAM while copies stream, cores shared with the GPU's launches) moves the level.
    """

    def __init__(self, profile: OffloadProfile, alpha: float = 0.1):
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self._profile = profile
        self._fits: dict[tuple[str, int], LineFit] = {}
        self._cpu_scale: dict[int, tuple[CostLine, float]] = {}  # expert bytes -> (profiled t_c line, EMA scale)

    @property
    def profile(self) -> OffloadProfile:
        return self._profile

    def observe_io(self, expert_bytes: int, seconds: float) -> None:
        entry = self._profile.costs(expert_bytes)
        self._put(replace(entry, t_io=(1 - self.alpha) * entry.t_io + self.alpha * seconds))

    def observe_gpu(self, expert_bytes: int, tokens: int, seconds: float) -> None:
        entry = self._profile.costs(expert_bytes)
        self._put(replace(entry, gpu=self._refit(("gpu", expert_bytes), entry.gpu, tokens, seconds)))

    def observe_cpu(self, expert_bytes: int, runs: Sequence[tuple[int, float]]) -> None:
        """CPU experts' wall times, (tokens, seconds) each in the order they ran: t_c becomes the profiled
        line times an EMA of observed / profiled (one update of the profile for them all)."""
        entry = self._profile.costs(expert_bytes)
        base, scale = self._cpu_scale.get(expert_bytes, (entry.cpu, 1.0))
        for tokens, seconds in runs:
            expected = base(tokens)
            if expected > 0:
                scale = (1 - self.alpha) * scale + self.alpha * seconds / expected
        self._cpu_scale[expert_bytes] = (base, scale)
        self._put(replace(entry, cpu=CostLine(base.slope * scale, base.intercept * scale)))

    def observe_attn(self, tokens: int, seconds: float) -> None:
        self._profile = replace(self._profile, attn=self._refit(("attn", 0), self._profile.attn, tokens, seconds))

    def _refit(self, key: tuple[str, int], current: CostLine, tokens: int, seconds: float) -> CostLine:
        fit = self._fits.setdefault(key, LineFit(forget=self.alpha))
        fit.add(tokens, seconds)
        return fit.line() or current

    def _put(self, entry: ExpertCosts) -> None:
        experts = tuple(entry if e.expert_bytes == entry.expert_bytes else e for e in self._profile.experts)
        self._profile = replace(self._profile, experts=experts)
