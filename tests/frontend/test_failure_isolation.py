"""A step that fails ends only the requests it belongs to; the engine keeps serving the others.

One expert of every layer lives in a real expert function that is dead (stopped) or refuses it (a
function serving other experts); the rest run in process. Prompts are chosen by where the model
routes them when nothing fails: one never needs the dead expert, one needs it only while decoding,
one already for its prompt.
"""

import asyncio

import pytest

from kubemoe.bundles import Bundle
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.dispatch import DispatchError
from kubemoe.frontend.engine import failed_rows
from kubemoe.frontend.sampling import SamplingParams
from kubemoe.routing_table import LOCAL, table_for_bundles

from .test_remote_experts import ExpertServers

MAX_TOKENS = 4
LONG = 3 * MAX_TOKENS  # what the request that never needs the lost expert generates while the others fail


class ExpertsSeen:
    """Observer: the experts (any MoE layer) of prefill passes (several rows) and of each decode pass (one row)."""

    def __init__(self, layers):
        self.first_layer = min(layers)
        self.prefill, self.decode = set(), []

    def on_layer(self, layer, hidden, top_k_index, top_k_weights):
        experts = top_k_index.reshape(-1).tolist()
        if len(top_k_index) > 1:
            self.prefill.update(experts)
            return
        if layer == self.first_layer:
            self.decode.append(set())
        self.decode[-1].update(experts)


async def _run(fe, prompt, request_id="r", max_tokens=MAX_TOKENS, started: asyncio.Event | None = None):
    tokens, error = [], None
    async for delta in fe.engine.generate(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
        tokens += delta.token_ids
        error = delta.error or error
        if started is not None:
            started.set()
    return tokens, error


def _choose(fe):
    """(dead expert, {role: prompt}, tokens of each prompt when nothing fails): "never" needs it for none of
    LONG tokens, "decode" for one of its first MAX_TOKENS but not its prompt, "prefill" for its prompt."""
    seen = {}
    for first in range(2, 120):
        prompt = [first, 7]
        observer = ExpertsSeen(fe.adapter.moe_layers)
        fe.dispatcher.observers.append(observer)
        tokens, _ = asyncio.run(_run(fe, prompt, max_tokens=LONG))
        fe.dispatcher.observers.remove(observer)
        seen[tuple(prompt)] = (observer.prefill, observer.decode, tokens)
    for dead in range(fe.adapter.num_experts):
        roles = {}
        for prompt, (prefill, decode, _) in seen.items():
            role = ("prefill" if dead in prefill else "decode" if dead in set().union(*decode[:MAX_TOKENS - 1])
                    else "never" if dead not in set().union(*decode) else "")
            roles.setdefault(role, list(prompt))
        roles.pop("", None)
        if len(roles) == 3:
            return dead, roles, {role: seen[tuple(p)][2][:LONG if role == "never" else MAX_TOKENS]
                                 for role, p in roles.items()}
    pytest.skip("no expert separates these prompts")  # the tiny checkpoint is seeded: does not happen


@pytest.mark.parametrize("arrival", ["together", "behind a running request"])
@pytest.mark.parametrize("fault", ["stopped", "refuses"])
def test_a_failing_expert_ends_only_the_requests_that_need_it(fault, arrival, tiny_checkpoint):
    """"behind a running request": the prompts arrive while the one that never needs the lost expert
    decodes, so their first pass also carries its decode row (step_pass.py), which must survive it."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none", call_timeout=2.0, max_batch=3))
    fe.engine.eos_ids = set()
    layers, experts = fe.adapter.moe_layers, range(fe.adapter.num_experts)
    try:
        everything = Bundle("all", tuple((l, e) for l in layers for e in experts))
        fe.set_routing_table(table_for_bundles(fe.model_id, [everything], {"all": [LOCAL]}))
        dead, prompts, alone = _choose(fe)
        lost = Bundle("lost", tuple((l, dead) for l in layers))
        kept = Bundle("kept", tuple((l, e) for l in layers for e in experts if e != dead))
        # "refuses": a live function that holds every expert but the lost one (NOT_FOUND at each attempt)
        servers = ExpertServers(path, [kept])
        if fault == "stopped":
            servers.stop()
        try:
            address = next(iter(servers.addresses.values()))[0]
            fe.set_routing_table(table_for_bundles(fe.model_id, [lost, kept], {"lost": [address], "kept": [LOCAL]},
                                                   version=2))

            async def together():
                return await asyncio.gather(*(_run(fe, p, role, LONG if role == "never" else MAX_TOKENS)
                                              for role, p in prompts.items()))

            async def behind():
                started = asyncio.Event()
                running = asyncio.ensure_future(_run(fe, prompts["never"], "never", LONG, started))
                await started.wait()
                failing = await asyncio.gather(*(_run(fe, prompts[role], role) for role in ("decode", "prefill")))
                return [await running, *failing]

            if arrival == "together":
                results = dict(zip(prompts, asyncio.run(together())))
            else:
                passes = []
                fe.engine.on_forward = lambda rows: passes.append(rows.requests)
                results = dict(zip(["never", "decode", "prefill"], asyncio.run(behind())))
                assert ("never", "decode", "prefill") in passes, passes  # the running row rode in the failing pass
            again = asyncio.run(_run(fe, prompts["never"], max_tokens=LONG))  # the engine serves on
        finally:
            if fault == "refuses":
                servers.stop()
    finally:
        fe.close()
    assert results["never"] == (alone["never"], None)
    assert again == (alone["never"], None)
    for role in ("decode", "prefill"):
        tokens, error = results[role]
        assert error and "bundle lost" in error and "no replica could run" in error, error
    assert results["prefill"][0] == []  # failed before its first token
    assert 0 < len(results["decode"][0]) < MAX_TOKENS and results["decode"][0] == alone["decode"][:len(results["decode"][0])]


def test_failed_rows_name_the_sequences_of_the_tokens_an_error_names():
    assert failed_rows(DispatchError("x", [1, 4, 5]), [2, 2, 2]) == [0, 2]
    assert failed_rows(DispatchError("x", [0, 3, 10]), [1, 1, 8, 4]) == [0, 2, 3]
    assert failed_rows(DispatchError("x"), [1, 1, 1]) == range(3)
    assert failed_rows(ValueError("bad tensor"), [1, 5]) == range(2)
