"""The OpenAI-compatible HTTP API of a frontend, plus probes, metrics and the load report.

Requests are checked at the boundary and refused with OpenAI's error shape before anything runs;
the engine's own refusals (prompt too long, queue full) surface with the first delta, so a handler
pulls that delta before it sends any header. Every engine stream is closed when its handler ends
(`aclosing`): a client that goes away frees its batch slot at the next engine step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from aiohttp import web
from google.protobuf import json_format
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kubemoe.frontend.app import NOT_READY
from kubemoe.load_report import PROTOBUF
from kubemoe.frontend.engine import Delta, InvalidPrompt, PromptTooLong, QueueFull
from kubemoe.frontend.sampling import SamplingParams

log = logging.getLogger(__name__)

# OpenAI parameters this server does not implement: accepted only at a value that changes nothing.
NO_OP_VALUES = {
    "n": (None, 1), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}
# The message roles OpenAI's chat API takes; what a role means is the model's chat template's to say.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
API_ROUTES = {"completions", "chat_completions", "models"}  # counted in frontend.metrics.requests


class ApiError(Exception):
    """A refused request, answered as `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, headers=None) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def unknown_model(model: str, served: str) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist here; this server serves {served!r}",
                    param="model", code="model_not_found")


# -- reading request bodies ---------------------------------------------------------------------

_JSON_TYPES = {"number": (int, float), "integer": (int,), "string": (str,), "boolean": (bool,),
               "object": (dict,), "array": (list,)}


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _get(body: dict, name: str, kind: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, _JSON_TYPES[kind]) or (kind != "boolean" and isinstance(value, bool)):
        article = "an" if kind[0] in "aeiou" else "a"
        raise invalid(f"'{name}' must be {article} {kind}, got {_json_type(value)}", param=name)
    return value


def _sampling(body: dict, default_max_tokens: int) -> SamplingParams:
    for name, allowed in NO_OP_VALUES.items():
        if body.get(name) not in allowed:
            raise invalid(f"'{name}' is not supported by this server; leave it out "
                          f"(or send {json.dumps(allowed[1])})", param=name)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise invalid("'stop' must be a string or a list of strings", param="stop")
    seed = _get(body, "seed", "integer")
    max_tokens = _get(body, "max_completion_tokens", "integer")  # chat's newer name wins
    max_tokens = _get(body, "max_tokens", "integer") if max_tokens is None else max_tokens
    try:
        return SamplingParams(
            temperature=_float(body, "temperature", 1.0), top_p=_float(body, "top_p", 1.0),
            top_k=_get(body, "top_k", "integer", 0), seed=seed, stop=tuple(stop or ()),
            max_tokens=default_max_tokens if max_tokens is None else max_tokens)
    except ValueError as e:
        raise invalid(str(e), param=str(e).split(" ", 1)[0]) from None


def _float(body: dict, name: str, default: float) -> float:
    try:
        return float(_get(body, name, "number", default))
    except OverflowError:  # a JSON integer has no bound: 10**400
        raise invalid(f"'{name}' is too large a number", param=name) from None


def _text(value: str, param: str) -> str:
    """A JSON string as the tokenizer takes it: Unicode text (JSON can spell a lone surrogate, \\ud800)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(f"{param} is not Unicode text: {e.reason} at character {e.start}", param=param) from None
    return value


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        if m["role"] not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role {m['role'][:40]!r} is not one of {', '.join(CHAT_ROLES)}",
                          param=f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones can reach a text model
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                              "supported", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string or a list of text parts, got {_json_type(content)}",
                          param=f"messages[{i}].content")
        out.append({"role": m["role"], "content": _text(content, f"messages[{i}].content")})
    return out


# -- responses ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Kind:
    """What differs between /v1/completions and /v1/chat/completions: names and choice shapes."""

    api: str
    id_prefix: str
    object: str
    chunk_object: str

    @property
    def chat(self) -> bool:
        return self.api == "chat_completions"

    def choice(self, text: str, finish: str | None) -> dict:
        body: dict[str, object] = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}

    def chunk_choice(self, text: str, finish: str | None, first: bool) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            body: dict[str, object] = {"delta": delta}
        else:
            body = {"text": text}
        return {"index": 0, **body, "logprobs": None, "finish_reason": finish}


COMPLETIONS = _Kind("completions", "cmpl", "text_completion", "text_completion")
CHAT = _Kind("chat_completions", "chatcmpl", "chat.completion", "chat.completion.chunk")


def _usage(delta: Delta) -> dict:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens}


def _engine_error(delta: Delta) -> ApiError:
    return ApiError(503, f"generation failed: {delta.error}; retry the request", code="engine_error")


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def _chain(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    if not first.finish_reason:
        async for delta in rest:
            yield delta


class HttpApi:
    def __init__(self, frontend):
        self.frontend = frontend
        self.created = int(time.time())

    # -- generation -------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.frontend.tokenizer.encode(_text(prompt, "prompt"))
        elif isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = prompt
        else:
            raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
        return await self._generate(request, body, COMPLETIONS, ids, _sampling(body, default_max_tokens=16))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = _chat_messages(body)
        try:
            ids = self.frontend.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        except TemplateError as e:  # e.g. the template's own check of role order
            raise invalid(f"the chat template refused these messages: {e}", param="messages") from None
        # Without a limit a reply may fill the context, as OpenAI's chat API allows.
        params = _sampling(body, default_max_tokens=max(1, self.frontend.max_context - len(ids)))
        return await self._generate(request, body, CHAT, ids, params)

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, LookupError, RecursionError) as e:  # LookupError: an unknown charset
            raise invalid(f"the request body is not valid JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise invalid(f"the request body must be a JSON object, got {_json_type(body)}")
        model = _get(body, "model", "string")
        if model is None:
            raise invalid(f"'model' is required; this server serves {self.frontend.model_id!r}", param="model")
        if model != self.frontend.model_id:
            raise unknown_model(model, self.frontend.model_id)
        return body

    async def _generate(self, request: web.Request, body: dict, kind: _Kind, ids: list[int],
                        params: SamplingParams) -> web.StreamResponse:
        stream = _get(body, "stream", "boolean", False)
        options = _get(body, "stream_options", "object")
        if options is not None and not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        include_usage = bool(_get(options or {}, "include_usage", "boolean", False))
        if not self.frontend.ready:
            raise ApiError(503, NOT_READY, code="not_ready")
        request_id = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": kind.chunk_object if stream else kind.object,
                "created": int(time.time()), "model": self.frontend.model_id}
        async with contextlib.aclosing(self.frontend.engine.generate(request_id, ids, params)) as deltas:
            try:
                first = await anext(deltas)
            except InvalidPrompt as e:
                param = "messages" if kind.chat else "prompt"
                code = "context_length_exceeded" if isinstance(e, PromptTooLong) else None
                raise invalid(str(e), param=param, code=code) from None
            except QueueFull as e:
                raise ApiError(429, f"the server is busy: {e}", code="rate_limit_exceeded") from None
            if stream:
                return await self._stream(request, kind, head, _chain(first, deltas), include_usage)
            return await self._collect(kind, head, _chain(first, deltas))

    async def _collect(self, kind: _Kind, head: dict, deltas: AsyncIterator[Delta]) -> web.Response:
        texts = []
        async for delta in deltas:
            texts.append(delta.text)
        if delta.finish_reason == "error":
            raise _engine_error(delta)
        return web.json_response({**head, "choices": [kind.choice("".join(texts), delta.finish_reason)],
                                  "usage": _usage(delta)})

    async def _stream(self, request: web.Request, kind: _Kind, head: dict, deltas: AsyncIterator[Delta],
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        extra = {"usage": None} if include_usage else {}
        first = True
        try:
            await response.prepare(request)
            async for delta in deltas:
                if delta.finish_reason == "error":
                    await response.write(_sse(_engine_error(delta).body()))
                    break
                if delta.text or delta.finish_reason or first:
                    choice = kind.chunk_choice(delta.text, delta.finish_reason, first)
                    await response.write(_sse({**head, "choices": [choice], **extra}))
                    first = False
                if delta.finish_reason and include_usage:
                    await response.write(_sse({**head, "choices": [], "usage": _usage(delta)}))
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except ConnectionResetError:
            log.info("%s: the client went away; generation stopped", head["id"])
        return response

    # -- everything else --------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.frontend.model_id:
            raise unknown_model(request.match_info["model"], self.frontend.model_id)
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.frontend.model_id, "object": "model", "created": self.created, "owned_by": "kubemoe",
                "max_model_len": self.frontend.max_context}

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        details = self.frontend.readiness()
        if self.frontend.ready:
            return web.json_response({"status": "ready", **details})
        return web.json_response({"status": "not ready", "reason": NOT_READY, **details}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        self.frontend.loads.refresh()  # expert token counts held on the device
        return web.Response(body=generate_latest(self.frontend.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def loads(self, request: web.Request) -> web.Response:
        report = self.frontend.loads.report()
        if PROTOBUF in request.headers.get("Accept", ""):
            return web.Response(body=report.SerializeToString(), content_type=PROTOBUF)
        return web.Response(text=json_format.MessageToJson(report, always_print_fields_with_no_presence=True), content_type="application/json")

    @web.middleware
    async def errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every refusal in OpenAI's error shape, and every API request counted by outcome."""
        try:
            response = await handler(request)
        except ApiError as e:
            response = e.response()
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods))
            response = ApiError(405, f"{request.method} is not allowed on {request.path}; use {allowed}").response(
                headers={"Allow": allowed})
        except web.HTTPNotFound:
            response = ApiError(404, f"no such path: {request.method} {request.path}; the API is under /v1 "
                                     "(/v1/completions, /v1/chat/completions, /v1/models)").response()
        except web.HTTPException as e:  # e.g. 413 for a body over the size limit
            if e.status < 400:
                raise
            response = ApiError(e.status, e.text or e.reason).response()
        except Exception:  # a bug: said as one, in the API's error shape, never aiohttp's text page
            log.exception("%s %s failed", request.method, request.path)
            response = ApiError(500, "the server failed on this request (a bug: its log has the traceback)",
                                code="internal_error").response()
        route = request.match_info.route.name
        if route in API_ROUTES:
            self.frontend.metrics.requests.labels(api=route, status=str(response.status)).inc()
        return response


def create_app(frontend) -> web.Application:
    api = HttpApi(frontend)
    app = web.Application(middlewares=[api.errors])
    app.router.add_post("/v1/completions", api.completions, name="completions")
    app.router.add_post("/v1/chat/completions", api.chat_completions, name="chat_completions")
    app.router.add_get("/v1/models", api.models, name="models")
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_get("/healthz", api.healthz)
    app.router.add_get("/readyz", api.readyz)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/loads", api.loads)
    return app


async def start_http_server(frontend, host: str = "127.0.0.1", port: int = 0,
                            grace: float = 30.0) -> tuple[web.AppRunner, int]:
    """Serve `create_app(frontend)` on host:port (0: any free port); returns the runner and the port.

    `runner.cleanup()` stops listening, lets running requests finish for up to `grace` seconds and
    then cancels them. A handler is cancelled when its client disconnects, which closes its engine
    stream, so an abandoned request stops generating.
    """
    runner = web.AppRunner(create_app(frontend), handler_cancellation=True, shutdown_timeout=grace)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
