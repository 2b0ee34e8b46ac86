"""Checks a checkpoint against `transformers`: expert FFNs, routers, and a whole forward pass.

`kubemoe checkpoint verify DIR` runs this, so an operator can check that kubemoe computes a model
(a generated one, or a downloaded one) exactly as `transformers` does before serving it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kubemoe.adapters import MoEAdapter, install_routed_experts
from kubemoe.checkpoint import Checkpoint
from kubemoe.moe import LocalExperts


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest expected magnitude."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def reference_expert(adapter: MoEAdapter, model, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' own experts module applied to x [T, H] through one expert with weight 1."""
    experts = adapter.experts_module(model, layer)
    if adapter.routing.weight_on_input:  # Llama-4: a dense [E * T, H] input, one block per expert
        routed_in = torch.zeros(adapter.num_experts, *x.shape, dtype=x.dtype)
        routed_in[expert] = x
        return experts(routed_in.view(-1, x.shape[-1])).view(adapter.num_experts, *x.shape)[expert]
    index = torch.full((x.shape[0], 1), expert, dtype=torch.long)
    return experts(x, index, torch.ones(x.shape[0], 1, dtype=x.dtype))


def reference_route(adapter: MoEAdapter, model, layer: int, hidden: torch.Tensor):
    """transformers' router on hidden [T, H] -> (weights [T, K], experts [T, K]) sorted by expert."""
    router = getattr(adapter.moe_block(model, layer), adapter.arch.router_attr)
    out = router(hidden)
    if adapter.routing.weight_on_input:  # Llama-4's router returns dense scores and the logits
        scores, logits = out
        experts = logits.topk(adapter.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    else:
        _, weights, experts = out
    order = experts.argsort(dim=-1)
    return weights.float().gather(1, order), experts.gather(1, order)


@dataclass
class LayerCheck:
    layer: int
    expert_rel_err: float  # worst over all experts of the layer
    router_same_experts: bool
    router_weight_rel_err: float


@dataclass
class VerifyReport:
    arch: str
    layers: list[LayerCheck] = field(default_factory=list)
    logits_rel_err: float = float("nan")
    load_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(l.router_same_experts and l.expert_rel_err < 1e-5 and l.router_weight_rel_err < 1e-5
                   for l in self.layers) and self.logits_rel_err < 1e-4


def verify_checkpoint(path: str | Path, tokens: int = 32, seed: int = 0) -> VerifyReport:
    from transformers import AutoModelForCausalLM

    ckpt = Checkpoint(path)
    adapter = MoEAdapter(ckpt.config)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    report = VerifyReport(adapter.arch.name, load_seconds=time.perf_counter() - start)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ckpt.config.vocab_size, (2, tokens // 2), generator=gen)
    with torch.no_grad():
        expected = model(ids).logits
        for layer in adapter.moe_layers:
            x = torch.randn(tokens, adapter.hidden_size, generator=gen)
            worst = max(
                rel_err(LocalExperts({e: adapter.load_expert(ckpt, layer, e)}, adapter.act, False)(
                    x, torch.full((tokens, 1), e), torch.ones(tokens, 1)), reference_expert(adapter, model, layer, e, x))
                for e in range(adapter.num_experts)
            )
            router = adapter.router_tensors(layer)
            bias = ckpt.read(router.bias) if router.bias else None
            weights, experts = adapter.route(x, ckpt.read(router.weight), bias)
            ref_weights, ref_experts = reference_route(adapter, model, layer, x)
            report.layers.append(LayerCheck(layer, worst, bool((experts == ref_experts).all()), rel_err(weights, ref_weights)))
        for layer in adapter.moe_layers:
            experts = {e: adapter.load_expert(ckpt, layer, e) for e in range(adapter.num_experts)}
            install_routed_experts(adapter, model, layer, LocalExperts(experts, adapter.act, adapter.routing.weight_on_input))
        report.logits_rel_err = rel_err(model(ids).logits, expected)
    return report
