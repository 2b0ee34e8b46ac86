"""Re-planning in place: experts move between running expert functions (Load, switch, Unload) while
the frontend serves, and no call fails or computes anything else than the in-process experts."""

import threading
import time

import grpc
import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.bundles import Bundle
from kubemoe.checkpoint import default_model_id
from kubemoe.frontend.app import Frontend, FrontendConfig
from kubemoe.frontend.loop_thread import LoopThread
from kubemoe.frontend.replan import Replanner, repoint
from kubemoe.routing_table import LOCAL, Moves, held_by_address, moves_between, table_for_bundles

from .test_remote_experts import ExpertServers


def per_expert(layers, experts):
    return [Bundle(f"l{layer}-e{e}", ((layer, e),)) for layer in layers for e in range(experts)]


def test_moves_load_where_the_new_table_sends_first_and_unload_where_no_table_sends_any_more():
    bundles = per_expert([1], 3)
    before = table_for_bundles("m", bundles, {"l1-e0": ["a"], "l1-e1": ["a", "b"], "l1-e2": [LOCAL]})
    after = table_for_bundles("m", bundles, {"l1-e0": ["b"], "l1-e1": ["b"], "l1-e2": ["a"]}, version=2)
    assert held_by_address(before) == {"a": {(1, 0), (1, 1)}, "b": {(1, 1)}}
    assert moves_between(before, after) == Moves(load={"a": ((1, 2),), "b": ((1, 0),)}, unload={"a": ((1, 0), (1, 1))})
    assert moves_between(after, after).empty and moves_between(None, before).load == {"a": ((1, 0), (1, 1)), "b": ((1, 1),)}


def test_an_expert_moves_between_running_functions_while_the_frontend_serves(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none"))
    layer, experts = fe.adapter.moe_layers[0], fe.adapter.num_experts
    bundles = per_expert(fe.adapter.moe_layers, experts)
    half = experts // 2
    # Two functions, each started with half of every layer's experts.
    starts = [Bundle("a", tuple(k for b in bundles for k in b.experts if k[1] < half)),
              Bundle("b", tuple(k for b in bundles for k in b.experts if k[1] >= half))]
    servers = ExpertServers(path, starts)
    a, b = servers.addresses["a"][0], servers.addresses["b"][0]
    home = {bundle.name: [a if bundle.experts[0][1] < half else b] for bundle in bundles}
    moved = dict(home, **{f"l{layer}-e0": [b], f"l{layer}-e{half}": [a, b]})  # e0 moves, e_half gains a replica
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, fe.adapter.hidden_size, generator=generator)
    weights, index = torch.randn(40, experts, generator=generator).softmax(-1).topk(2, dim=-1)
    index[:8, 0] = 0  # expert 0 and expert `half` get tokens in every step
    index[8:16, 0] = half
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {n: [LOCAL] for n in home}))
        fe.dispatcher.apply_pending()
        reference = fe.dispatcher.run_layer(layer, hidden, index, weights)
        before = table_for_bundles(fe.model_id, bundles, home, version=2)
        after = table_for_bundles(fe.model_id, bundles, moved, version=3)
        fe.set_routing_table(before)
        serving, outputs, stop = [], [], threading.Event()

        def steps():  # the engine's loop: a table applies between steps
            while not stop.is_set():
                fe.dispatcher.apply_pending()
                serving.append(fe.dispatcher.routes_version)
                outputs.append(fe.dispatcher.run_layer(layer, hidden, index, weights))

        worker = threading.Thread(target=steps)
        worker.start()

        async def switch():
            fe.set_routing_table(after)
            while not serving or serving[-1] != 3:
                await __import__("asyncio").sleep(0.005)

        try:
            done = servers.loop.run(repoint(fe.model_id, before, after, switch), timeout=60)
            for _ in range(3):  # a few steps on the new table, the old homes unloaded
                n = len(outputs)
                while len(outputs) == n:
                    stop.wait(0.01)
        finally:
            stop.set()
            worker.join(timeout=30)
        assert done.moves.load == {a: ((layer, half),), b: ((layer, 0),)} and done.moves.unload == {a: ((layer, 0),)}
        assert done.bytes_loaded > 0 and done.bytes_freed > 0
        assert 2 in serving and serving[-1] == 3 and len(outputs) >= 3
        for out in outputs:
            torch.testing.assert_close(out, reference, rtol=1.3e-6, atol=1e-5)
        held = {built.port: set(built.servicer.store.held()) for built in servers.servers}
        port = {address: int(address.rsplit(":", 1)[1]) for address in (a, b)}
        assert (layer, 0) not in held[port[a]] and (layer, half) in held[port[a]] and (layer, 0) in held[port[b]]
        stores = {built.port: built.servicer.store for built in servers.servers}
        assert done.device_bytes == {address: stores[port[address]].device_bytes for address in (a, b)}
    finally:
        fe.close()
        servers.stop()


def test_a_replica_the_table_names_before_it_has_loaded_loses_no_token(tiny_checkpoint):
    """The cluster's in-place path: a function named for an expert it is still loading answers
    NOT_FOUND or UNAVAILABLE; the dispatcher retries that part on the expert's loaded replica and
    puts the function aside for that expert only: it keeps serving the expert it holds."""
    path = tiny_checkpoint("mixtral")
    fe = Frontend(FrontendConfig(checkpoint=path, predictor="none", split_min_tokens=1))
    layer, experts = fe.adapter.moe_layers[0], fe.adapter.num_experts
    bundles = per_expert(fe.adapter.moe_layers, experts)
    servers = ExpertServers(path, [Bundle("all", tuple(k for b in bundles for k in b.experts)),
                                   Bundle("one", ((layer, experts - 1),))])
    loaded, empty = servers.addresses["all"][0], servers.addresses["one"][0]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(32, fe.adapter.hidden_size, generator=generator)
    weights, index = torch.randn(32, experts, generator=generator).softmax(-1).topk(2, dim=-1)
    index[:, 0] = 0  # every token at expert 0: split over both replicas, one of which lacks it
    index[:8, 1] = experts - 1  # and some at the expert only the other function holds: one call carries both
    retries = fe.metrics.registry.get_sample_value
    try:
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, {b.name: [LOCAL] for b in bundles}))
        fe.dispatcher.apply_pending()
        reference = fe.dispatcher.run_layer(layer, hidden, index, weights)
        addresses = {b.name: [empty, loaded] if b.experts[0] == (layer, 0) else [empty] if b.experts[0] == (layer, experts - 1)
                     else [loaded] for b in bundles}
        fe.set_routing_table(table_for_bundles(fe.model_id, bundles, addresses, version=2))
        fe.dispatcher.apply_pending()
        out = fe.dispatcher.run_layer(layer, hidden, index, weights)
        lacks = fe.dispatcher._replicas[empty]
        assert lacks.picks >= 2 and lacks.failed_until == 0  # refused, retried with what it holds, never put aside
        assert (empty, layer, 0) in fe.dispatcher._lacking and (empty, layer, experts - 1) not in fe.dispatcher._lacking
        picks, retried = lacks.picks, retries("kubemoe_frontend_expert_retries_total", {"bundle": f"l{layer}-e0"})
        again = fe.dispatcher.run_layer(layer, hidden, index, weights)  # within the cooldown
        assert lacks.picks == picks + 1  # its own expert's call only: expert 0 goes to the loaded replica
        assert retries("kubemoe_frontend_expert_retries_total", {"bundle": f"l{layer}-e0"}) == retried
    finally:
        fe.close()
        servers.stop()
    torch.testing.assert_close(out, reference, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(again, reference, rtol=1.3e-6, atol=1e-5)


def test_a_replanner_opens_one_channel_per_function_for_all_its_replans(tiny_checkpoint, monkeypatch):
    """Re-plans come every window while steps are served: a channel per function and re-plan cost the
    frontend's GIL and each function an accept every time."""
    path = tiny_checkpoint("mixtral")
    adapter = MoEAdapter.from_checkpoint(path)
    layer, model = adapter.moe_layers[0], default_model_id(path)
    bundles = per_expert(adapter.moe_layers, adapter.num_experts)
    servers = ExpertServers(path, [Bundle("a", tuple(k for b in bundles for k in b.experts)), Bundle("b", ((layer, 1),))])
    a, b = servers.addresses["a"][0], servers.addresses["b"][0]
    opened = []
    real = grpc.aio.insecure_channel
    monkeypatch.setattr(grpc.aio, "insecure_channel", lambda address, **kw: opened.append(address) or real(address, **kw))
    tables = [table_for_bundles(model, bundles, {bundle.name: [b if bundle.experts[0] == (layer, 0) and v % 2 else a]
                                                 for bundle in bundles}, version=v) for v in range(1, 5)]
    mover, replanner = LoopThread("replan-test"), Replanner(model)

    async def switch():
        pass

    try:
        moved = [mover.run(replanner.repoint(before, after, switch), timeout=60) for before, after in zip(tables, tables[1:])]
        held = [set(built.servicer.store.held()) for built in servers.servers]
    finally:
        mover.run(replanner.close(), timeout=30)
        mover.stop()
        servers.stop()
    assert [m.moves.load for m in moved] == [{a: ((layer, 0),)}, {b: ((layer, 0),)}, {a: ((layer, 0),)}]
    assert (layer, 0) in held[0] and held[1] == {(layer, 1)}  # it went to b and back, and was unloaded there
    assert sorted(opened) == sorted([a, b]), f"channels opened: {opened}"


def test_a_replanner_lets_only_loads_at_once_functions_load_at_the_same_time(tiny_checkpoint):
    """Functions sharing a host share its memory bandwidth and its link to the GPUs with the steps'
    calls: `loads_at_once` bounds how many Load together; by default all do."""
    path = tiny_checkpoint("mixtral")
    adapter = MoEAdapter.from_checkpoint(path)
    layer, model = adapter.moe_layers[0], default_model_id(path)
    bundles = per_expert([layer], 3)  # the tables name only these
    names = ["a", "b", "c"]
    servers = ExpertServers(path, [Bundle(n, ((layer, i),)) for i, n in enumerate(names)])
    addresses = [servers.addresses[n][0] for n in names]
    loading, most = [0], [0]
    lock = threading.Lock()
    for built in servers.servers:
        def slow_load(keys, load=built.servicer.store.load):
            with lock:
                loading[0] += 1
                most[0] = max(most[0], loading[0])
            try:
                time.sleep(0.3)  # long enough that Loads let go together overlap
                return load(keys)
            finally:
                with lock:
                    loading[0] -= 1
        built.servicer.store.load = slow_load
    before = table_for_bundles(model, bundles, {f"l{layer}-e{i}": [a] for i, a in enumerate(addresses)})
    after = table_for_bundles(model, bundles, {f"l{layer}-e{i}": [a, addresses[(i + 1) % 3]]
                                               for i, a in enumerate(addresses)}, version=2)
    mover = LoopThread("replan-test")

    async def switch():
        pass

    try:
        concurrency, spans = {}, {}
        for at_once in (1, None):
            most[0] = 0
            replanner = Replanner(model, loads_at_once=at_once)
            moved = mover.run(replanner.repoint(before, after, switch), timeout=60)
            mover.run(replanner.repoint(after, before, switch), timeout=60)  # back, for the next pass
            mover.run(replanner.close(), timeout=30)
            assert len(moved.moves.load) == 3
            concurrency[at_once] = most[0]
            spans[at_once] = sorted(moved.load_spans.values())
    finally:
        mover.stop()
        servers.stop()
    assert concurrency == {1: 1, None: 3}
    one_by_one = spans[1]  # as the frontend saw them: each Load began once the one before it had ended
    assert len(one_by_one) == 3 and all(ended <= begun for (_, ended), (begun, _) in zip(one_by_one, one_by_one[1:]))
    assert all(begun < 0.1 for begun, _ in spans[None])
    with pytest.raises(ValueError, match="loads_at_once must be at least 1"):
        Replanner(model, loads_at_once=0)
