"""The OpenAI-compatible HTTP API, through the official `openai` client against the real aiohttp server."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from google.protobuf import json_format

from kubemoe.frontend.server import serve_frontend
from kubemoe.proto import kubemoe_pb2 as pb

PROMPT = "The quick brown fox"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


async def stream_text(stream) -> tuple[str, list]:
    chunks = [chunk async for chunk in stream]
    texts = [(c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
             for c in chunks if c.choices]
    return "".join(texts), chunks


def counter(frontend, name: str, **labels) -> float:
    return frontend.metrics.registry.get_sample_value(name, labels) or 0.0


# -- generation ---------------------------------------------------------------------------------


async def test_completion_streamed_and_not_agree(client, frontend):
    done = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.id.startswith("cmpl-") and done.object == "text_completion" and abs(done.created - time.time()) < 60
    assert done.model == frontend.model_id
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert done.usage.prompt_tokens == len(frontend.tokenizer.encode(PROMPT))
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12

    stream = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=12, temperature=0,
                                             stream=True, stream_options={"include_usage": True})
    text, chunks = await stream_text(stream)
    assert text == choice.text
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("cmpl-")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == done.usage  # the usage chunk comes last


async def test_chat_completion_streamed_and_not_agree(client, frontend):
    done = await client.chat.completions.create(model=frontend.model_id, messages=CHAT, max_completion_tokens=10,
                                                temperature=0)
    assert done.id.startswith("chatcmpl-") and done.object == "chat.completion"
    message = done.choices[0].message
    assert message.role == "assistant" and message.content and done.choices[0].finish_reason == "length"
    prompt = frontend.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt), 10)

    stream = await client.chat.completions.create(model=frontend.model_id, messages=CHAT, max_tokens=10,
                                                  temperature=0, stream=True)
    text, chunks = await stream_text(stream)
    assert text == message.content
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


async def test_prompt_as_token_ids_matches_text(client, frontend):
    by_text = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = await client.completions.create(model=frontend.model_id, prompt=frontend.tokenizer.encode(PROMPT),
                                             max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


async def test_seed_makes_sampling_reproducible(client, frontend):
    async def sample(seed):
        done = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=16,
                                               temperature=1.5, seed=seed, extra_body={"top_k": 50})
        return done.choices[0].text

    first, again, other = await asyncio.gather(sample(7), sample(7), sample(8))
    assert first == again
    assert first != other  # fixed seeds: not flaky, and shows the seed is used


async def test_stop_string_ends_the_text_before_it(client, frontend):
    greedy = (await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=16,
                                              temperature=0)).choices[0].text
    start = next(k for k in range(1, len(greedy) - 3) if greedy[k:k + 3].isalnum())
    stop = greedy[start:start + 3]
    for stream in (False, True):
        answer = await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=16,
                                                 temperature=0, stop=[stop, "never-seen"], stream=stream)
        if stream:
            text, chunks = await stream_text(answer)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert (text, finish) == (greedy[:greedy.find(stop)], "stop")


async def test_max_tokens_one_streams_a_single_final_chunk(client, frontend):
    stream = await client.chat.completions.create(model=frontend.model_id, messages=CHAT, max_tokens=1, stream=True,
                                                  temperature=0)
    text, chunks = await stream_text(stream)
    assert [c.choices[0].finish_reason for c in chunks] == ["length"]


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("params, error, words", [
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"top_p": 0}, openai.BadRequestError, "top_p"),
    ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
    ({"extra_body": {"top_k": -3}}, openai.BadRequestError, "top_k"),
    ({"n": 2}, openai.BadRequestError, "'n' is not supported"),
    ({"echo": True}, openai.BadRequestError, "'echo' is not supported"),
    ({"seed": 2**70}, openai.BadRequestError, "64-bit integer"),
    ({"stop": [""]}, openai.BadRequestError, "stop"),
    ({"extra_body": {"temperature": "hot"}}, openai.BadRequestError, "'temperature' must be a number, got string"),
    ({"prompt": [1, 2, 100000]}, openai.BadRequestError, "not in this model's vocabulary"),
    ({"prompt": ""}, openai.BadRequestError, "empty"),
    ({"prompt": "hello " * 600}, openai.BadRequestError, "context is 512 tokens"),
    ({"model": "gpt-4"}, openai.NotFoundError, "this server serves"),
    ({"stream_options": {"include_usage": True}}, openai.BadRequestError, "only allowed when 'stream' is true"),
])
async def test_bad_completion_requests_say_what_to_fix(client, frontend, params, error, words):
    request = {"model": frontend.model_id, "prompt": PROMPT, "max_tokens": 4} | params
    with pytest.raises(error) as refused:
        await client.completions.create(**request)
    assert words in refused.value.message
    assert refused.value.body["type"] == "invalid_request_error"


async def test_prompt_over_the_context_is_refused_with_its_code(client, frontend):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model=frontend.model_id, stream=True,
                                             messages=[{"role": "user", "content": "hello " * 600}])
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert "shorten the prompt" in refused.value.message


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"model": "M"}', "'messages' must be a non-empty list"),
    (b'{"model": "M", "messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string"),
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "only text parts"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "'model' is required"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"model": "M", "messages": [{"role": "wizard", "content": "hi"}]}', "messages[0].role 'wizard' is not one of"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
     "'max_tokens' must be an integer, got string"),
])
async def test_malformed_chat_bodies_get_400_json(base_url, frontend, body, words):
    body = body.replace(b'"M"', json.dumps(frontend.model_id).encode())
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/v1/chat/completions", data=body) as response:
            error = (await response.json())["error"]
    assert response.status == 400 and error["type"] == "invalid_request_error"
    assert words in error["message"]


@pytest.mark.parametrize("path, body, content_type, words", [
    ("completions", b'{"model": "M", "prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "application/json",
     "'temperature' is too large a number"),
    ("completions", b'{"model": "M", "prompt": "hi"}', "application/json; charset=bogus", "unknown encoding: bogus"),
    ("completions", b'{"model": "M", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "application/json",
     "not valid JSON"),
    ("completions", b'{"model": "M", "prompt": "a\\ud800b", "stream": true}', "application/json",
     "prompt is not Unicode text"),
    ("chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "application/json",
     "messages[0].content is not Unicode text"),
])
async def test_bodies_python_cannot_take_as_json_or_text_get_400_json(base_url, frontend, path, body, content_type,
                                                                     words):
    """Valid JSON that Python's float, json or the tokenizer refuse (a 400-digit number, a charset, a lone
    surrogate), and JSON nested too deep: 400 in OpenAI's shape, not aiohttp's 500 page."""
    body = body.replace(b'"M"', json.dumps(frontend.model_id).encode())
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/v1/{path}", data=body, headers={"Content-Type": content_type}) as response:
            error = (await response.json())["error"]
    assert response.status == 400 and words in error["message"], error


async def test_unknown_paths_and_wrong_methods_get_json_errors(base_url):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/v1/completions") as response:
            assert response.status == 405 and response.headers["Allow"] == "POST"
            assert "use POST" in (await response.json())["error"]["message"]
        async with http.post(f"{base_url}/v1/embeddings", json={}) as response:
            assert response.status == 404 and "no such path" in (await response.json())["error"]["message"]


async def test_a_full_queue_answers_429_and_the_rest_succeed(make_frontend, http_server, openai_client):
    busy = make_frontend(max_batch=1, max_waiting=1)
    async with http_server(busy) as url, openai_client(url) as client:
        async def complete():
            try:
                done = await client.completions.create(model=busy.model_id, prompt=PROMPT, max_tokens=40, temperature=0)
                return done.choices[0].finish_reason
            except openai.RateLimitError as e:
                assert e.code == "rate_limit_exceeded" and "retry later" in e.message
                return 429

        outcomes = await asyncio.gather(*(complete() for _ in range(6)))
    assert 429 in outcomes and set(outcomes) == {429, "length"}
    assert counter(busy, "kubemoe_frontend_requests_total", api="completions", status="429") == outcomes.count(429)


async def test_an_engine_failure_is_503_or_an_error_event(make_frontend, route_all, http_server, openai_client):
    broken = make_frontend(routed=False, call_timeout=0.5)
    route_all(broken, "127.0.0.1:1")  # nobody listens there: each step fails once its retries are spent
    async with http_server(broken) as url, openai_client(url) as client:
        with pytest.raises(openai.InternalServerError) as failed:
            await client.completions.create(model=broken.model_id, prompt=PROMPT, max_tokens=4)
        assert failed.value.status_code == 503 and "generation failed" in failed.value.message
        stream = await client.completions.create(model=broken.model_id, prompt=PROMPT, max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="generation failed"):
            await stream_text(stream)


async def test_a_client_that_disconnects_frees_its_slot(base_url, frontend):
    finished_before = counter(frontend, "kubemoe_frontend_completion_tokens_total")
    body = {"model": frontend.model_id, "prompt": "Hello", "max_tokens": 500, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{base_url}/v1/completions", json=body) as response:
            assert response.status == 200
            assert (await response.content.readline()).startswith(b"data: {")
    for _ in range(250):
        if frontend.engine.scheduler.idle:
            break
        await asyncio.sleep(0.02)
    assert frontend.engine.scheduler.idle
    # It never finished: an aborted sequence leaves without adding to the finished tokens.
    assert counter(frontend, "kubemoe_frontend_completion_tokens_total") == finished_before


# -- models, probes, metrics, loads ----------------------------------------------------------------


async def test_models_lists_the_one_model(client, frontend):
    models = await client.models.list()
    assert [m.id for m in models.data] == [frontend.model_id] and models.object == "list"
    assert (await client.models.retrieve(frontend.model_id)).id == frontend.model_id
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("other")


async def test_readiness_follows_the_routing_table(make_frontend, route_all, http_server, openai_client):
    unrouted = make_frontend(routed=False)
    async with http_server(unrouted) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/healthz") as response:
            assert response.status == 200
        async with http.get(f"{url}/readyz") as response:
            assert response.status == 503 and "routing table" in (await response.json())["reason"]
        async with openai_client(url) as client:
            with pytest.raises(openai.InternalServerError) as refused:
                await client.completions.create(model=unrouted.model_id, prompt=PROMPT, max_tokens=2)
            assert refused.value.status_code == 503 and refused.value.code == "not_ready"
        route_all(unrouted)
        async with http.get(f"{url}/readyz") as response:
            assert response.status == 200


async def test_metrics_count_requests_by_api_and_status(base_url, client, frontend):
    await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=0)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/metrics") as response:
            text = await response.text()
    assert response.status == 200 and response.content_type == "text/plain"
    assert 'kubemoe_frontend_requests_total{api="completions",status="200"}' in text
    assert 'kubemoe_frontend_requests_total{api="completions",status="400"}' in text
    assert "kubemoe_frontend_completion_tokens_total" in text


async def test_loads_as_json_and_protobuf_give_the_same_report(base_url, client, frontend):
    await client.completions.create(model=frontend.model_id, prompt=PROMPT, max_tokens=4)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base_url}/loads") as response:
            assert response.content_type == "application/json"
            as_json = json_format.Parse(await response.text(), pb.LoadReport())
        async with http.get(f"{base_url}/loads", headers={"Accept": "application/x-protobuf"}) as response:
            assert response.content_type == "application/x-protobuf"
            as_proto = pb.LoadReport.FromString(await response.read())
    # The open window's length grows between the two reads; everything counted is the same.
    for report in (as_json, as_proto):
        report.ClearField("window_seconds")
        for load in report.loads:
            load.ClearField("tokens_per_second")
            load.ClearField("predicted_tokens_per_second")
    assert as_json == as_proto
    assert as_proto.model == frontend.model_id and as_proto.tokens > 0 and sum(l.tokens for l in as_proto.loads) > 0
    # the default predictor (layer 1's router on layer 0's input) predicted every token layer 1 routed
    assert (as_proto.predictor, as_proto.prediction_distance) == ("router", 1)
    (layer1,) = as_proto.predictions
    assert (layer1.layer, layer1.source_layer) == (1, 0) and 0 <= layer1.accuracy <= 1
    top_k = frontend.adapter.top_k
    assert sum(l.predicted_tokens for l in as_proto.loads if l.layer == 1) == layer1.tokens * top_k
    assert sum(l.tokens for l in as_proto.loads if l.layer == 1) == layer1.tokens * top_k


# -- the whole server ------------------------------------------------------------------------------


async def test_serve_frontend_drains_in_flight_requests_when_stopped(make_frontend, openai_client):
    own = make_frontend()
    ports = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve_frontend(own, http_port=0, grpc_port=0, grace=10.0,
                                              on_ready=lambda h, g: ports.set_result((h, g))))
    http_port, grpc_port = await asyncio.wait_for(ports, 30)
    assert http_port and grpc_port
    async with openai_client(f"http://127.0.0.1:{http_port}") as client:
        in_flight = asyncio.create_task(client.completions.create(
            model=own.model_id, prompt="Hello", max_tokens=100, temperature=0))
        for _ in range(2000):  # wait until it runs, then stop the server under it
            if not own.engine.scheduler.idle:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        done = await in_flight
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 100
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not own.engine._thread.is_alive()  # the frontend was closed after the drain
