"""The frontend with its experts in expert functions over real gRPC channels."""

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from kubemoe.bundles import Bundle, bundles_by_count
from kubemoe.expert_fn.config import ExpertFnConfig
from kubemoe.expert_fn.server import build_server
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.embedded import embedded_bundles, expert_processes
from kubemoe.frontend.loop_thread import LoopThread
from kubemoe.routing_table import LOCAL, table_for_bundles
from kubemoe.frontend.sampling import SamplingParams

from .test_correctness import ARCHS, PROMPTS, generate_all, reference_greedy


@pytest.fixture
def replies_in_place(monkeypatch):
    """Per expert call the frontend makes: whether its reply was copied straight into the layer's
    buffer (`out=`: its rows are one run of the sorted rows) or handed back to be put in place."""
    from kubemoe.expert_fn.client import ExpertClient

    seen: list[bool] = []
    call = ExpertClient.call

    async def recorded(self, *args, out=None, **kwargs):
        seen.append(out is not None)
        return await call(self, *args, out=out, **kwargs)

    monkeypatch.setattr(ExpertClient, "call", recorded)
    return seen


class ExpertServers:
    """Expert-function servers for a checkpoint's bundles, in this process, on a loop thread of their own."""

    def __init__(self, path, bundles, replicas=1, shm_dir=None):
        self.loop = LoopThread("expert-servers")
        self.servers, self.addresses = [], {}
        for bundle in bundles:
            config = ExpertFnConfig.build(path, bundle.spec(), device="cpu", metrics_port=None, shm_dir=shm_dir)
            for _ in range(replicas):
                built = self.loop.run(build_server("127.0.0.1:0", config))
                self.loop.run(built.server.start())
                self.servers.append(built)
                self.addresses.setdefault(bundle.name, []).append(f"127.0.0.1:{built.port}")
        from kubemoe.frontend.embedded import wait_serving

        for addresses in self.addresses.values():
            for address in addresses:
                wait_serving(address, None, timeout=60)

    def stop(self):
        for built in self.servers:
            self.loop.run(built.stop(0))
        self.loop.stop()


@pytest.mark.parametrize("transport", ["stream", "unary", "shm"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_over_grpc_matches_transformers(arch, transport, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(arch)
    shm_dir = tmp_path if transport == "shm" else None  # the folder frontend and expert functions share
    fe = Frontend(FrontendConfig(checkpoint=path, streaming=transport != "unary", shm_dir=shm_dir))
    bundles = bundles_by_count(fe.adapter.moe_layers, fe.adapter.num_experts, 2)
    servers = ExpertServers(path, bundles, shm_dir=shm_dir)
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, servers.addresses))
        fe.engine.eos_ids = set()
        ours = asyncio.run(generate_all(fe, PROMPTS))
        assert all(c.shared_memory == (transport == "shm") for c in fe.dispatcher._clients.values())
    finally:
        fe.close()
        servers.stop()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert ours == reference_greedy(reference, PROMPTS)


@pytest.mark.parametrize("split_min_tokens", [64, 1])  # 1: every step's tokens split over both replicas
def test_a_killed_replica_loses_no_request(split_min_tokens, tiny_checkpoint, tmp_path):
    """Two replica processes of one bundle; one is SIGKILLed while requests are decoding (tensors in shared memory)."""
    path = tiny_checkpoint("mixtral")
    bundles = embedded_bundles(path, 1)
    fe = Frontend(FrontendConfig(checkpoint=path, call_timeout=5.0, shm_dir=tmp_path, split_min_tokens=split_min_tokens))
    fe.engine.eos_ids = set()
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        expected = asyncio.run(generate_all(fe, PROMPTS, max_tokens=40))
        with expert_processes(path, bundles, fe.model_id, replicas=2, shm_dir=tmp_path) as experts:
            table = table_for_bundles(fe.model_id, bundles, experts.addresses, version=2)
            fe.set_routing_table(table)
            victims = [addresses[0] for addresses in experts.addresses.values()]

            async def run():
                first = asyncio.Event()

                async def one(i, prompt):
                    tokens = []
                    async for delta in fe.engine.generate(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=40)):
                        assert delta.error is None, delta.error
                        tokens += delta.token_ids
                        first.set()
                    return tokens

                tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(PROMPTS)]
                await first.wait()
                for address in victims:
                    os.kill(experts.procs[address].pid, signal.SIGKILL)
                return await asyncio.gather(*tasks)

            after_kill = asyncio.run(run())
            assert all(experts.procs[a].poll() is not None for a in victims)
            assert any(c.shared_memory for c in fe.dispatcher._clients.values())
    finally:
        fe.close()
    assert after_kill == expected
    retries = fe.metrics.registry.get_sample_value
    assert sum(retries("kubemoe_frontend_expert_retries_total", {"bundle": b.name}) or 0 for b in bundles) >= 1
    # A dead process is put aside whole (for every expert it serves), never one expert at a time.
    assert any(fe.dispatcher._replicas[a].failed_until > 0 for a in victims) and not fe.dispatcher._lacking


def test_a_call_tries_every_replica_of_its_expert_when_more_than_max_attempts_lack_it(tiny_checkpoint):
    """Replicas added in place are in the table before their weights are in (they answer that they lack the
    expert): four such ahead of the one that holds every expert, one more than the frontend's max_attempts."""
    path = tiny_checkpoint("mixtral")
    bundles = embedded_bundles(path, 1)
    fe = Frontend(FrontendConfig(checkpoint=path, call_timeout=5.0))
    fe.engine.eos_ids = set()
    assert fe.dispatcher.config.max_attempts < 5
    lacking = ExpertServers(path, [Bundle("other", ((0, 0),))], replicas=4)  # hold one expert, lack the rest
    holding = ExpertServers(path, bundles)
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        expected = asyncio.run(generate_all(fe, PROMPTS, max_tokens=8))
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {
            b.name: lacking.addresses["other"] + holding.addresses[b.name] for b in bundles}, version=2))
        assert asyncio.run(generate_all(fe, PROMPTS, max_tokens=8)) == expected
    finally:
        fe.close()
        lacking.stop()
        holding.stop()


class FixedPrediction:
    """Stands in for the online predictor: every expert of every layer predicted hot."""

    def __init__(self, tokens):
        self.tokens = tokens

    def predicted_counts(self, layer):
        return [self.tokens] * 64


@pytest.mark.parametrize("prediction", [None, 1000])
def test_a_hot_experts_tokens_split_across_two_replicas_equal_the_in_process_path(prediction, tiny_checkpoint,
                                                                                   replies_in_place):
    """One bundle, two real expert-function replicas: every expert's tokens of one step split over
    both, and the combined output equal to the in-process experts' within float32 rounding (a call
    carrying parts of several experts is not one run of the sorted rows: its reply is scattered)."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none", split_min_tokens=1))
    bundles = embedded_bundles(path, 1)
    servers = ExpertServers(path, bundles, replicas=2)
    try:
        layer = fe.adapter.moe_layers[0]
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn(48, fe.adapter.hidden_size, generator=generator)  # [T, H]
        logits = torch.randn(48, fe.adapter.num_experts, generator=generator)
        weights, index = logits.softmax(-1).topk(2, dim=-1)  # [T, K], [T, K]
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        in_process = fe.dispatcher.run_layer(layer, hidden, index, weights)
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, servers.addresses, version=2))
        fe.dispatcher.apply_pending()
        fe.dispatcher.predictions = FixedPrediction(prediction) if prediction else None
        split = fe.dispatcher.run_layer(layer, hidden, index, weights)
        replicas = fe.dispatcher._replicas
        assert len(replicas) == 2 and all(r.picks == 1 and r.inflight_tokens == 0 for r in replicas.values())
        parts = fe.metrics.registry.get_sample_value("kubemoe_frontend_expert_parts_total")
        assert len(index.unique()) < parts <= 2 * len(index.unique())  # some experts' tokens went to both replicas
        assert replies_in_place == [False, False]
    finally:
        fe.close()
        servers.stop()
    torch.testing.assert_close(split, in_process, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("calls_per_bundle", [False, True])
def test_a_function_serving_many_bundles_gets_one_call_per_layer_equal_to_the_in_process_path(calls_per_bundle,
                                                                                             tiny_checkpoint,
                                                                                             replies_in_place):
    """Every expert its own bundle (as the planner makes them), all in one real expert function: one
    call per MoE layer carries them all; the per-bundle baseline makes one per expert. Both compute
    what the in-process experts compute, and each call's rows are one run of the layer's sorted rows:
    its reply goes straight into place."""
    import dataclasses

    from kubemoe.bundles import Bundle

    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none"))
    fe.dispatcher.config = dataclasses.replace(fe.dispatcher.config, calls_per_bundle=calls_per_bundle)
    layer, experts = fe.adapter.moe_layers[0], fe.adapter.num_experts
    bundles = [Bundle(f"l{l}-e{e}", ((l, e),)) for l in fe.adapter.moe_layers for e in range(experts)]
    servers = ExpertServers(path, [Bundle("all", tuple(k for b in bundles for k in b.experts))])
    address = servers.addresses["all"][0]
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, fe.adapter.hidden_size, generator=generator)  # [T, H]
    weights, index = torch.randn(40, experts, generator=generator).softmax(-1).topk(2, dim=-1)  # [T, K]
    calls = fe.metrics.registry.get_sample_value
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        in_process = fe.dispatcher.run_layer(layer, hidden, index, weights)
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [address] for b in bundles}, version=2))
        fe.dispatcher.apply_pending()
        before = calls("kubemoe_frontend_expert_calls_total") or 0
        began = time.perf_counter()
        remote = fe.dispatcher.run_layer(layer, hidden, index, weights)
        wall = time.perf_counter() - began
        made = calls("kubemoe_frontend_expert_calls_total") - before
        parts = calls("kubemoe_frontend_expert_parts_total")
        busy = calls("kubemoe_frontend_expert_busy_seconds_total")
    finally:
        fe.close()
        servers.stop()
    assert made == (len(index.unique()) if calls_per_bundle else 1)
    assert parts == len(index.unique())  # one replica each: every expert's tokens in one part, however they are called
    assert 0 < busy < parts * wall  # the function's reported time on each call, once per expert: within the frontend's
    assert replies_in_place == [True] * int(made)
    assert fe.dispatcher._replicas[address].picks == made
    torch.testing.assert_close(remote, in_process, rtol=1.3e-6, atol=1e-5)


def test_plan_calls_sends_every_token_to_one_replica_of_its_expert_in_one_call_per_address():
    from kubemoe.frontend.dispatch import plan_calls

    experts, counts = [0, 3, 5], [7, 1, 4]
    candidates = [["a", "b", "c"], ["a"], ["b", "c"]]  # expert 3 lives on a only, 5 on b and c
    calls = plan_calls(experts, counts, candidates, {"b": 2}, None, 2)
    assert len(calls) == len({address for address, _ in calls}) == 3  # one call per address
    for e, count, where in zip(experts, counts, candidates):
        pieces = [(address, p) for (address, _), ps in calls.items() for p in ps if p.expert == e]
        rows = sorted(r for _, p in pieces for r in range(p.start, p.start + p.count))
        assert rows == list(range(count))  # each of its tokens once, none of another expert's
        assert {address for address, _ in pieces} <= set(where)
    # The prediction decides how many replicas: one predicted token keeps expert 0 on one replica.
    assert len(plan_calls([0], [7], [["a", "b", "c"]], {}, [1], 1)) == 1
    assert len(plan_calls([0], [7], [["a", "b", "c"]], {}, [100], 1)) == 3
    # The baseline: experts of different bundles on one address go as separate calls.
    assert len(plan_calls([0, 1], [3, 3], [["a"], ["a"]], {}, None, 64)) == 1
    assert len(plan_calls([0, 1], [3, 3], [["a"], ["a"]], {}, None, 64, tags=["x", "y"])) == 2


def test_a_layer_split_between_in_process_and_remote_experts_equals_the_in_process_path(tiny_checkpoint):
    """Half of a layer's experts here, half in an expert function: the remote calls' pairs are added to
    what the in-process experts left (rows of the pairs they ran stay zero in the gathered buffer)."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none"))
    here, there = embedded_bundles(path, 2)
    servers = ExpertServers(path, [there])
    try:
        layer = fe.adapter.moe_layers[0]
        generator = torch.Generator().manual_seed(1)
        hidden = torch.randn(40, fe.adapter.hidden_size, generator=generator)  # [T, H]
        weights, index = torch.randn(40, fe.adapter.num_experts, generator=generator).softmax(-1).topk(2, dim=-1)
        fe.set_routing_table(table_for_bundles(fe.model_id, [here, there], {here.name: [LOCAL], there.name: [LOCAL]}))
        fe.dispatcher.apply_pending()
        in_process = fe.dispatcher.run_layer(layer, hidden, index, weights)
        fe.set_routing_table(table_for_bundles(fe.model_id, [here, there], {here.name: [LOCAL], **servers.addresses},
                                               version=2))
        fe.dispatcher.apply_pending()
        mixed = fe.dispatcher.run_layer(layer, hidden, index, weights)
        assert fe.metrics.registry.get_sample_value("kubemoe_frontend_expert_calls_total") == 1
    finally:
        fe.close()
        servers.stop()
    torch.testing.assert_close(mixed, in_process, rtol=1.3e-6, atol=1e-5)


def test_expert_processes_each_see_their_own_gpu(tiny_checkpoint, tmp_path):
    """gpus=[3, 5] over three processes: the first sees GPU 3, the second 5, the third 3 again (issue 18's
    one process per GPU); here, without GPUs, they still serve on the CPU."""
    path = tiny_checkpoint("mixtral")
    bundles = embedded_bundles(path, 3)
    with expert_processes(path, bundles, "m", shm_dir=tmp_path, gpus=[3, 5]) as experts:
        seen = []
        for proc in experts.procs.values():
            environ = dict(item.split("=", 1) for item in
                           open(f"/proc/{proc.pid}/environ").read().split("\0") if "=" in item)
            seen.append(environ.get("CUDA_VISIBLE_DEVICES"))
    assert seen == ["3", "5", "3"]
