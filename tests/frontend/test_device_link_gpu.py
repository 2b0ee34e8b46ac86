"""On a GPU (-m gpu, the lent H200): expert functions on the frontend's GPU linked through CUDA IPC
(expert_fn/device_link.py) compute what their calls compute, a replayed step never waits for the GPU
within it, and a link that breaks costs no request: its step runs again as calls."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kubemoe.bundles import bundles_by_count
from kubemoe.expert_fn.client import ExpertClient
from kubemoe.expert_fn.device_link import ClientLink, LinkError
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.embedded import expert_processes
from kubemoe.frontend.graphs import DecodeGraphs, padded_rows
from kubemoe.routing_table import table_for_bundles

from .test_correctness import PROMPTS
from .test_graphs_gpu import _joined
from .test_lookahead import counting, with_late_join

pytestmark = pytest.mark.gpu


@pytest.fixture
def linked(tiny_checkpoint, tmp_path):
    """A bfloat16 frontend on the GPU with its experts in two expert-function processes on that GPU."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, device="cuda", dtype="bfloat16", predictor="none",
                                 shm_dir=tmp_path, cuda_graphs=False, device_links=True))
    bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
    with expert_processes(path, bundles, fe.model_id, shm_dir=tmp_path, dtype="bfloat16") as experts:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, experts.addresses))
        fe.dispatcher.apply_pending()
        try:
            yield fe
        finally:
            fe.close()


def _decode(fe: Frontend, steps: int, sync_free_replay: bool) -> DecodeGraphs:
    """Decode steps of 3 sequences in a program of 4 rows (the eager first run, as calls, then replays
    through the links), each against the same step as ordinary passes, whose remote layers go as calls."""
    graphs = DecodeGraphs(fe.model, lambda: fe.dispatcher.generation, links=fe.dispatcher.link_step)
    plain, graphed = _joined(fe, PROMPTS[:3]), _joined(fe, PROMPTS[:3])
    tokens, padded = [5, 6, 7], padded_rows(3)
    with torch.inference_mode():
        for step in range(steps):
            expected = fe.model(**plain.decode_inputs(tokens), use_cache=True).logits[:, -1]
            graphed.advance(tokens, padded)
            torch.cuda.synchronize()
            if step and sync_free_replay:
                torch.cuda.set_sync_debug_mode("error")  # the replay waits for the step's end, never within it
            try:
                got = graphs.decode(graphed, padded, 3)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            # Triton's grouped kernel in the functions against their per-expert graphs: bfloat16 rounding
            torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)
            tokens = expected.argmax(-1).tolist()
    return graphs


def test_linked_steps_equal_their_calls_and_the_replay_never_waits_for_the_gpu_within_it(linked):
    fe = linked
    graphs = _decode(fe, 3, sync_free_replay=True)
    moe_layers = len(fe.adapter.moe_layers)
    assert fe.dispatcher.linked_layers == 2 * moe_layers  # every remote layer of both replays went through links
    assert len(fe.dispatcher._links) == 2 and graphs.captures == 1 and graphs.enabled


def test_a_link_that_breaks_voids_its_step_which_runs_again_as_calls(linked, monkeypatch):
    fe = linked
    broken = []

    def receive(self, timeout):
        broken.append(self)
        raise LinkError("device link: the expert function closed it")

    monkeypatch.setattr(ClientLink, "receive", receive)
    graphs = _decode(fe, 3, sync_free_replay=False)
    assert broken and fe.dispatcher.linked_layers == 0 and not fe.dispatcher._links
    assert set(fe.dispatcher._link_retry) == set(fe.dispatcher._replicas)  # each tried again only later
    assert graphs.captures == 2 and graphs.enabled  # captured again, with cuts: its layers go as calls


def test_the_engine_launches_linked_passes_ahead_and_a_void_one_runs_again_as_calls(tiny_checkpoint, tmp_path,
                                                                                       monkeypatch):
    """Served through the engine, greedy, requests of different lengths and one joining late, with the
    router predictor: linked passes launched ahead give the tokens of the same links read step by step;
    links whose every step is void (each answer lost) give the tokens of calls alone: each pass launched
    ahead was undone and ran again, as calls."""
    path = tiny_checkpoint("mixtral")

    def served(addresses, bundles, links: bool, look_ahead: bool):
        fe = Frontend(FrontendConfig(checkpoint=path, device="cuda", dtype="bfloat16", predictor="router",
                                     shm_dir=tmp_path, device_links=links, lookahead=look_ahead))
        fe.engine.eos_ids = set()
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, addresses))
        launched = counting(fe, force=False)
        try:
            return with_late_join(fe), launched[0], fe.dispatcher.linked_layers
        finally:
            fe.close()

    probe = Frontend(FrontendConfig(checkpoint=path, device="cpu", predictor="none"))
    bundles = bundles_by_count(probe.adapter.moe_layers, probe.adapter.num_experts, 2)
    with expert_processes(path, bundles, probe.model_id, shm_dir=tmp_path, dtype="bfloat16") as experts:
        stepwise, _, linked_stepwise = served(experts.addresses, bundles, links=True, look_ahead=False)
        ahead, launched, linked_ahead = served(experts.addresses, bundles, links=True, look_ahead=True)
        calls, _, _ = served(experts.addresses, bundles, links=False, look_ahead=True)
        lost = []

        def receive(self, timeout):
            lost.append(self)
            raise LinkError("device link: no answer in time")

        monkeypatch.setattr(ClientLink, "receive", receive)
        void, _, linked_void = served(experts.addresses, bundles, links=True, look_ahead=True)
    assert linked_stepwise > 0 and linked_ahead > 0 and launched > 0
    assert ahead == stepwise
    assert lost and linked_void == 0 and void == calls


def test_a_slot_an_unload_emptied_is_loaded_into_and_linked_steps_stay_right(tiny_checkpoint, tmp_path):
    """A function's experts moved in place while a device link runs steps on them: the link's programs of
    the old stack map go when it captures the new one, so the next Load reads into the emptied slot
    (nothing allocated: device_bytes), and linked steps still equal the model's."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, device="cuda", dtype="bfloat16", predictor="none",
                                 shm_dir=tmp_path, cuda_graphs=False, device_links=True))
    bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
    layer = fe.adapter.moe_layers[0]
    spare = [e for l, e in bundles[1].experts if l == layer][:2]  # the other function's: not routed to this one

    def change(address: str, method: str, expert: int):
        async def call():
            client = ExpertClient(address, model=fe.model_id, streaming=False)
            try:
                return await getattr(client, method)([(layer, expert)])
            finally:
                await client.close()
        return asyncio.run(call())

    with expert_processes(path, bundles, fe.model_id, shm_dir=tmp_path, dtype="bfloat16") as experts:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, experts.addresses))
        fe.dispatcher.apply_pending()
        a = experts.addresses[bundles[0].name][0]
        try:
            grown = change(a, "load", spare[0])  # no empty slot: a new stack, one slot more
            _decode(fe, 2, sync_free_replay=False)  # the link's programs hold the stack map that names it
            emptied = change(a, "unload", spare[0])
            assert emptied.device_bytes == grown.device_bytes  # its slot stays
            linked = fe.dispatcher.linked_layers
            _decode(fe, 2, sync_free_replay=False)  # the link captures the new map; its old programs go
            assert fe.dispatcher.linked_layers > linked
            refilled = change(a, "load", spare[1])
            assert refilled.device_bytes == grown.device_bytes, "the Load took a new stack, not the emptied slot"
            linked = fe.dispatcher.linked_layers
            _decode(fe, 2, sync_free_replay=False)
            assert fe.dispatcher.linked_layers > linked
        finally:
            fe.close()
