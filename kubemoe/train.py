"""Train kubemoe's own small MoE on the standard library's text, so routing is learned, not random.

Random weights route almost uniformly; nothing that predicts or balances expert loads can be judged
on them. This trains `transformers`' own Mixtral class (8 MoE layers, 16 experts, top-2) on text
already on the machine (`kubemoe.corpus`), seeded end to end, and writes a normal checkpoint folder
(safetensors as `save_pretrained` writes them, the tokenizer trained on the same text, a
generation config) that every other kubemoe command loads. `training.json` beside the weights keeps
the recipe, the corpus fingerprint and the loss curve.

The load-balancing loss is kept small on purpose: with Mixtral's 0.02 a small model learns near
uniform routing, with none a few experts take everything; real models sit in between (skewed,
input-dependent), and so does this one. Sizes: `small` trains in under two minutes on a 2-core
CPU (tests, CI), `base` in under three on one H200 (benchmarks; a lent machine retrains it from the
same seed instead of carrying weights).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kubemoe.corpus import Corpus, stdlib_corpus
from kubemoe.errors import KubemoeError
from kubemoe.tokenizer import END_OF_TEXT, IM_END, save_tokenizer

TRAINING_FILE = "training.json"


@dataclass(frozen=True)
class TrainRecipe:
    name: str
    config: dict = field(hash=False)  # MixtralConfig keyword arguments
    vocab_size: int = 1024
    seq_len: int = 128
    batch: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    aux_loss_coef: float = 1e-3  # see the module docstring
    corpus_chars: int = 1_500_000  # of the standard library, whole files
    tokenizer_chars: int = 4_000_000  # the tokenizer learns its merges from this much of the training text
    dtype: str = "float32"  # of the saved weights


_MIXTRAL_MOE = dict(num_hidden_layers=8, num_local_experts=16, num_experts_per_tok=2, tie_word_embeddings=False,
                    rope_theta=10000.0, router_jitter_noise=0.0)

RECIPES: dict[str, TrainRecipe] = {
    r.name: r
    for r in [
        TrainRecipe("small", dict(_MIXTRAL_MOE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512),
),
        TrainRecipe("base", dict(_MIXTRAL_MOE, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                 num_key_value_heads=4, max_position_embeddings=2048),
                    vocab_size=8192, seq_len=256, batch=64, steps=1200, lr=1.5e-3, warmup=100,
                    corpus_chars=40_000_000, dtype="bfloat16"),
    ]
}


def get_recipe(name: str) -> TrainRecipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise KubemoeError(f"no training recipe {name!r}; choose one of: {', '.join(RECIPES)}") from None


@dataclass
class TrainReport:
    recipe: str
    seed: int
    steps: int
    tokens_seen: int
    seconds: float
    device: str
    corpus: dict
    losses: list[tuple[int, float]]  # (step, training loss incl. the balancing term)
    held_out_loss: float

    def as_dict(self) -> dict:
        return asdict(self)


def tokenize(tokenizer, texts: list[str], eos: int) -> torch.Tensor:  # -> [N] int64, documents joined by eos
    ids: list[int] = []
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def _prefix(texts: list[str], chars: int) -> list[str]:
    """Whole texts from the start until `chars` characters (at least one text)."""
    kept: list[str] = []
    total = 0
    for text in texts:
        if kept and total + len(text) > chars:
            break
        kept.append(text)
        total += len(text)
    return kept


def _lr(step: int, recipe: TrainRecipe) -> float:
    return recipe.lr * warmup_cosine(step, recipe.warmup, recipe.steps)


def warmup_cosine(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """The learning-rate factor at `step`: linear warm-up over `warmup` steps, then cosine annealing
    from 1 down to `floor` at `total` steps (also LLaPor's schedule, frontend/offload/llapor_train.py)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _windows(stream: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator) -> torch.Tensor:  # [B, S+1]
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def _held_out_loss(model, stream: torch.Tensor, seq_len: int, device, autocast, max_windows: int = 32) -> float:
    n = min(max_windows, (len(stream) - 1) // seq_len)
    x = stream[: n * seq_len + 1]
    inputs = torch.stack([x[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)]).to(device)
    with autocast:
        out = model(input_ids=inputs[:, :-1], labels=inputs[:, :-1])
    # transformers shifts labels itself: the loss is next-token over each window
    return float(out.loss)


def train_moe(recipe: TrainRecipe, out: str | Path, seed: int = 0, device: str | torch.device = "cpu",
              steps: int | None = None, progress: bool = True, corpus: Corpus | None = None) -> TrainReport:
    """Train `recipe` from `seed` and write the checkpoint folder `out`. `steps=0` saves the model at
    initialisation: the same architecture and tokenizer with random weights, the baseline of skew reports."""
    from tqdm import tqdm
    from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        raise KubemoeError(f"{out} already holds a checkpoint; pass --force to overwrite it or choose another --out")
    steps = recipe.steps if steps is None else steps
    device = torch.device(device)
    random.seed(seed)
    torch.manual_seed(seed)
    corpus = corpus or stdlib_corpus(recipe.corpus_chars)

    out.mkdir(parents=True, exist_ok=True)
    special = save_tokenizer(recipe.vocab_size, out, _prefix(corpus.train, recipe.tokenizer_chars))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    eos = special[END_OF_TEXT]
    train_ids = tokenize(tokenizer, corpus.train, eos)
    held_ids = tokenize(tokenizer, corpus.held_out, eos)

    config = MixtralConfig(**recipe.config, vocab_size=len(tokenizer), router_aux_loss_coef=recipe.aux_loss_coef,
                           eos_token_id=[special[END_OF_TEXT], special[IM_END]], pad_token_id=eos, bos_token_id=eos)
    config._experts_implementation = "grouped_mm"  # one kernel per layer instead of a loop over experts (CPU too)
    model = MixtralForCausalLM(config).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    losses: list[tuple[int, float]] = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=f"training {recipe.name} MoE", unit="step", disable=not progress)
    model.train()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, recipe)
        batch = _windows(train_ids, recipe.seq_len, recipe.batch, gen).to(device)
        with autocast:
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1], output_router_logits=True).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            losses.append((step, round(loss.item(), 4)))
            bar.set_postfix(loss=f"{losses[-1][1]:.3f}")
    model.eval()
    seconds = time.perf_counter() - start
    held_out = _held_out_loss(model, held_ids, recipe.seq_len, device, autocast)

    model.to(getattr(torch, recipe.dtype)).save_pretrained(out)
    GenerationConfig(bos_token_id=eos, eos_token_id=config.eos_token_id, pad_token_id=eos).save_pretrained(out)
    report = TrainReport(recipe.name, seed, steps, steps * recipe.batch * recipe.seq_len, round(seconds, 2),
                         str(device), {"source": "python standard library", "fingerprint": corpus.fingerprint,
                                       "chars": corpus.chars, "train_tokens": len(train_ids),
                                       "held_out_tokens": len(held_ids)},
                         losses, round(held_out, 4))
    (out / TRAINING_FILE).write_text(json.dumps({**report.as_dict(), "settings": asdict(recipe)}, indent=2) + "\n")
    return report
