"""The load predictor while serving: predicted loads and accuracy per window, online refresh, and a
predictor that fails (to load, or at run time) never stopping the frontend."""

from __future__ import annotations

import aiohttp
import pytest
import torch

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.frontend.loads import LoadRecorder
from kubemoe.frontend.prediction import OnlinePredictor, RefreshConfig
from kubemoe.frontend.predictor import LoadPredictor
from kubemoe.routing import route


@pytest.fixture(scope="module")
def qwen(tiny_checkpoint):
    ckpt = Checkpoint(tiny_checkpoint("qwen3_moe"))
    return ckpt, MoEAdapter(ckpt.config)


def _forward(online: OnlinePredictor, adapter, hidden: torch.Tensor, planted: torch.Tensor) -> torch.Tensor:
    """One forward pass as the dispatcher shows it: layer 0, then layer 1 routing by the planted router."""
    experts0 = route(hidden @ planted.T, adapter.routing)[1]
    online.on_layer(0, hidden, experts0, torch.ones_like(experts0, dtype=torch.float32))
    experts1 = route(hidden @ planted.T, adapter.routing)[1]
    online.on_layer(1, hidden, experts1, torch.ones_like(experts1, dtype=torch.float32))
    return experts1


def test_predicted_loads_and_accuracy_are_what_the_predictor_said_and_how_it_did(qwen):
    ckpt, adapter = qwen
    loads = LoadRecorder("m", "f", window_seconds=60)
    predictor = LoadPredictor.from_routers(adapter, ckpt, 1)
    online = OnlinePredictor(predictor, loads, refresh=None, flush_every=1000)
    hidden = torch.randn(40, adapter.hidden_size)
    weight = ckpt.read(adapter.router_tensors(1).weight, dtype=torch.float32)
    expected = adapter.route(hidden, weight)[1]  # the router predictor's answer
    true = _forward(online, adapter, hidden, weight)  # layer 1 routes exactly as predicted
    report = loads.report()  # flushes the predictor's tallies first
    assert report.predictor == "router" and report.prediction_distance == 1
    predicted = {l.expert: l.predicted_tokens for l in report.loads if l.layer == 1 and l.predicted_tokens}
    assert predicted == {int(e): int(c) for e, c in zip(*torch.unique(expected, return_counts=True))}
    (layer1,) = report.predictions
    assert (layer1.layer, layer1.source_layer, layer1.tokens, layer1.accuracy) == (1, 0, 40, 1.0)
    assert torch.equal(true.sort(-1).values, expected.sort(-1).values)


def test_a_layer_below_threshold_is_refreshed_online_and_gets_better(qwen):
    ckpt, adapter = qwen
    loads = LoadRecorder("m", "f", window_seconds=60)
    config = RefreshConfig(threshold=0.8, window_tokens=256, buffer_rows=512, keep_every=1, steps=200, lr=1e-2,
                           max_refreshes=3)
    online = OnlinePredictor(LoadPredictor.from_routers(adapter, ckpt, 1), loads, refresh=config, flush_every=1)
    planted = torch.randn(adapter.num_experts, adapter.hidden_size, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    before = online.predictor.heads[1].weight.detach().clone()
    for _ in range(24):  # 64 rows kept per pass: the buffer fills, windows of 256 tokens score low
        _forward(online, adapter, torch.randn(64, adapter.hidden_size, generator=gen), planted)
    online._pool.shutdown(wait=True)
    layer = online._layers[1]
    assert layer.refreshes >= 1 and not layer.busy
    assert not torch.equal(online.predictor.heads[1].weight, before)  # a better head was swapped in
    hidden = torch.randn(512, adapter.hidden_size, generator=gen)
    truth = route(hidden @ planted.T, adapter.routing)[1]
    from kubemoe.frontend.predictor_train import topk_accuracy

    router_acc = topk_accuracy(LoadPredictor.from_routers(adapter, ckpt, 1).predict(0, hidden)[1], truth)
    assert topk_accuracy(online.predictor.predict(0, hidden)[1], truth) > router_acc + 0.1


def test_a_refresh_that_does_not_help_makes_the_next_wait_longer(qwen):
    """A layer its head cannot learn (here: no gradient steps, so no refresh ever scores better) waits 1,
    2, 4 windows after each refresh that was discarded, capped, instead of retraining every window."""
    ckpt, adapter = qwen
    config = RefreshConfig(window_tokens=8, buffer_rows=16, keep_every=1, steps=0, max_backoff_windows=4)
    online = OnlinePredictor(LoadPredictor.from_routers(adapter, ckpt, 1), LoadRecorder("m", "f", window_seconds=60),
                             refresh=config, flush_every=1000)

    class AtOnce:  # the refresh runs inside _judge_window, so its outcome is known before the next window
        def submit(self, fn, *args):
            fn(*args)

    online._pool.shutdown()
    online._pool = AtOnce()  # type: ignore[assignment]
    layer = online._layers[1]
    gen = torch.Generator().manual_seed(5)
    layer.keep(torch.randn(16, adapter.hidden_size, generator=gen),
               torch.randint(0, adapter.num_experts, (16, adapter.top_k), generator=gen), 16)
    refreshed = []
    for window in range(12):
        layer.window_hits, layer.window_choices = 0, 100  # accuracy 0: below the threshold every window
        before = layer.refreshes
        online._judge_window(1, layer)
        if layer.refreshes > before:
            refreshed.append(window)
    assert refreshed == [0, 2, 5, 10]


async def test_a_predictor_that_cannot_load_leaves_the_frontend_serving_and_readyz_says_why(
        make_frontend, http_server, openai_client, tmp_path):
    frontend = make_frontend(predictor=str(tmp_path / "missing.safetensors"))
    assert frontend.online_predictor is None
    async with http_server(frontend) as url, openai_client(url) as client:
        answer = await client.completions.create(model=frontend.model_id, prompt="x = ", max_tokens=2)
        assert answer.choices[0].text is not None
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/readyz") as response:
                body = await response.json()
    assert response.status == 200 and body["status"] == "ready"
    assert body["predictor"]["kind"] == "none" and "no predictor file" in body["predictor"]["problem"]

    beyond = make_frontend(prediction_distance=2)  # the tiny Mixtral has 2 MoE layers
    assert beyond.online_predictor is None and "at most 1" in beyond.readiness()["predictor"]["problem"]


async def test_an_observer_that_fails_is_dropped_and_the_request_still_completes(make_frontend, openai_client, http_server):
    frontend = make_frontend()

    class Broken:
        def on_layer(self, *args):
            raise RuntimeError("boom")

    frontend.dispatcher.observers.append(Broken())
    async with http_server(frontend) as url, openai_client(url) as client:
        answer = await client.completions.create(model=frontend.model_id, prompt="y = ", max_tokens=3)
    assert answer.usage.completion_tokens >= 1
    assert not any(isinstance(o, Broken) for o in frontend.dispatcher.observers)
    assert frontend.online_predictor in frontend.dispatcher.observers
