"""The OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (over the
chat path, jetserve.server.responses_api), GET /v1/models,
GET /v1/models/{id}, vLLM's POST /tokenize, POST /detokenize and GET /tokenizer_info,
GET /health, GET /metrics (Prometheus text), and what routers and probes poll: GET
/readiness (= /health), /liveness, /get_load (jetserve/server/probes.py). With an API
key, all but /health, /metrics and the probes need `Authorization: Bearer KEY` or
`x-api-key: KEY`; those stay open for probes, routers and scrapers. With
`tls_cert`/`tls_key` it serves HTTPS only. Every error, an unknown route or method
included, is OpenAI's error object.

Concurrency: one asyncio loop (uvicorn's) serves every request. Handlers validate, submit
to the orchestrator (never blocking: a full queue raises Overloaded -> 429) and await the
handles' async streams. Every response races the client's disconnect: when the client
goes away, the response task is cancelled, and leaving the stream loop cancels the
requests (jetserve.server.streams.merge), freeing their slots within one generate step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jetserve.lora_adapters import Adapters, UnknownAdapter
from jetserve.request import Overloaded
from jetserve.server import (
    client_id,
    harmony,
    lora_routes,
    probes,
    responses_api,
    tokenize_api,
)
from jetserve.server import openai_format as fmt
from jetserve.server import validation as v
from jetserve.server.auth import HOW_TO_SEND, ApiKey
from jetserve.server.config import ServerConfig
from jetserve.server.http_limits import BodyLimits, h11_protocol
from jetserve.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
    validate,
)
from jetserve.server.ports import listening_socket
from jetserve.server.readiness import Readiness
from jetserve.server.sse import CarryTransport, EventStream
from jetserve.server.streams import (
    CUT_GRACE_S,
    RETRY_AFTER_S,
    Joined,
    ShuttingDown,
    StreamCut,
    internal_error,
    merge,
    submit_all,
)

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator

log = logging.getLogger("jetserve.server")


def error_response(status: int, message: str, *, param: str | None = None,
                   kind: str = "invalid_request_error", code: str | None = None
                   ) -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


async def _routing_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, method not allowed) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    where = f"{request.method} {request.url.path}"
    if status == 404:
        message, code = f"no route {where}; see GET /v1/models", "not_found"
    elif status == 405:
        message, code = f"{where}: method not allowed", "method_not_allowed"
    else:
        message, code = f"{where}: {getattr(exc, 'detail', '')}", None
    out = error_response(status, message, code=code,
                         kind="server_error" if status >= 500 else "invalid_request_error")
    for k, val in (getattr(exc, "headers", None) or {}).items():
        out.headers[k] = val  # 405's Allow
    return out


async def _unhandled(request: Request, exc: Exception) -> Response:
    rid = f"req-{uuid.uuid4().hex}"
    log.error("HTTP request %s (%s %s) failed outside a route", rid, request.method,
              request.url.path, exc_info=exc)
    return error_response(500, internal_error(rid), kind="server_error")


def _failed(handle: Any) -> JSONResponse:
    """The 500 of a request the orchestrator ended with an error (logged under its id)."""
    return error_response(500, internal_error(handle.request_id), kind="server_error")


def _failed_event(handle: Any) -> str:
    """The SSE error event of a stream whose request the orchestrator ended with an error."""
    return _sse({"error": {"message": internal_error(handle.request_id),
                           "type": "server_error"}})


class _HttpError(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


async def _until_disconnect(request: Request) -> None:
    # Body already read: the next message the server sends is http.disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_start(head: dict) -> str:
    """What every chunk of a stream starts with, up to its choice: `data: {head,"choices":[`.
    Serialized once per stream; `_sse_chunk` then writes what `_sse` would, byte for byte."""
    return f"data: {json.dumps(head, separators=(',', ':'))[:-1]},\"choices\":["


def _sse_chunk(start: str, choice: dict, usage: dict) -> str:
    """`_sse({**head, "choices": [choice], **usage})` for `start` = `_sse_start(head)`."""
    tail = f',"usage":{json.dumps(usage["usage"], separators=(",", ":"))}' if usage else ""
    return f"{start}{json.dumps(choice, separators=(',', ':'))}]{tail}}}\n\n"


_SHUTTING_DOWN = "server shutting down: the drain timeout ended this request; retry elsewhere"
# After a drain cut's final chunks: why the stream ended (then usage, if asked, and [DONE]).
_SHUTDOWN_EVENT = _sse({"error": {"message": _SHUTTING_DOWN, "type": "server_error",
                                  "code": "shutting_down"}})


def _unfinished(totals: list[Joined]) -> list[int]:
    return [i for i, j in enumerate(totals) if j.finish_reason is None]


class OpenAIApp:
    """The routes over one orchestrator; `app` is the FastAPI application."""

    def __init__(self, orch: Orchestrator, limits: v.ModelLimits, config: ServerConfig,
                 metrics: Any | None = None, readiness: Readiness | None = None):
        self.orch = orch
        self.readiness = readiness if readiness is not None else Readiness()  # 503 until ready
        self.limits = limits
        self.config = config
        self.metrics = metrics
        self.live = True
        self.tt = fmt.TokenText(limits.tokenizer)
        self._key = ApiKey(config.api_key) if config.api_key else None
        self.cut = StreamCut()  # fired when a drain runs out of time (HttpServer.stop)
        self.adapters = Adapters.of(orch)
        if fmt.is_harmony(config.tool_call_parser, config.reasoning_parser):
            harmony.load_encoding()  # fails now, saying why, rather than on the first chat
        self.lora = lora_routes.LoraRoutes(self.adapters, self._body)
        app = FastAPI(title="jetserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/v1/completions", self._endpoint(self.completions), methods=["POST"])
        app.add_api_route("/v1/chat/completions", self._endpoint(self.chat), methods=["POST"])
        app.add_api_route("/v1/responses", self._endpoint(self.responses), methods=["POST"])
        app.add_api_route("/v1/models", self._endpoint(self.models), methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self._endpoint(self.model),
                          methods=["GET"])
        app.add_api_route("/tokenize", self._endpoint(self.tokenize), methods=["POST"])
        app.add_api_route("/detokenize", self._endpoint(self.detokenize), methods=["POST"])
        app.add_api_route("/tokenizer_info", self._endpoint(self.tokenizer_info),
                          methods=["GET"])
        for name, handler in (("load", self.lora.load), ("unload", self.lora.unload)):
            app.add_api_route(f"/v1/{name}_lora_adapter", self._endpoint(handler),
                              methods=["POST"])
        app.add_exception_handler(StarletteHTTPException, _routing_error)
        app.add_exception_handler(Exception, _unhandled)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_route, methods=["GET"])
        probes.add_routes(app, self.health, orch, config.load_format)
        self.app = app

    # ---- plumbing ----------------------------------------------------------------------

    def _endpoint(self, handler: Callable[[Request], Awaitable[Response]]):
        async def route(request: Request) -> Response:
            try:
                self._authorize(request)
                return await handler(request)
            except _HttpError as e:
                return e.response
            except v.InvalidArgument as e:
                return error_response(400, str(e), param=e.field)
            except UnknownAdapter as e:
                return error_response(404, e.args[0], param="model", code="model_not_found")
            except Overloaded as e:
                refused = error_response(429, f"server overloaded, retry later: {e}",
                                         kind="rate_limit_error")
                refused.headers["Retry-After"] = RETRY_AFTER_S
                return refused
            except ValueError as e:  # the orchestrator's own request checks
                return error_response(400, str(e))
            except ClientDisconnect:  # gone while sending its body: nobody to answer
                raise  # http_limits.BodyLimits logs it as one quiet line
            except Exception:  # a bug: answer at once, and leave the traceback in the log
                rid = f"req-{uuid.uuid4().hex}"
                log.exception("HTTP request %s (%s %s) failed", rid, request.method,
                              request.url.path)
                return error_response(500, internal_error(rid), kind="server_error")

        route.__name__ = handler.__name__
        return route

    def _authorize(self, request: Request) -> None:
        if self._key is None or self._key.accepts(request.headers.items()):
            return
        raise _HttpError(error_response(401, f"missing or wrong API key: {HOW_TO_SEND}",
                                        kind="authentication_error"))

    async def _body(self, request: Request, model: type) -> Any:
        return validate(model, parse_body(await request.body()))

    async def _joined(self, request: Request, handles: list[Any]) -> list[Joined]:
        """Joins the streams, or cancels them when the client disconnects first."""
        out = [Joined() for _ in handles]

        async def collect():
            async with contextlib.aclosing(merge(handles, cut=self.cut)) as batches:
                async for batch in batches:
                    for i, d in batch:
                        out[i].add(d)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # merge's finally cancels the requests
            await asyncio.gather(work, gone, return_exceptions=True)
        if work.cancelled():
            raise _HttpError(error_response(499, "client closed the request"))
        if isinstance(work.exception(), ShuttingDown):
            raise _HttpError(error_response(503, _SHUTTING_DOWN, kind="server_error"))
        work.result()
        for h, j in zip(handles, out, strict=True):
            if j.finish_reason == "error":
                raise _HttpError(_failed(h))
        return out

    def _check_ready(self) -> None:
        if not self.readiness.is_ready:  # warming up: 503 rather than minutes in a queue
            raise _HttpError(error_response(503, self.readiness.refusal(), kind="server_error"))

    def _submit(self, prep: fmt.Prepared) -> list[Any]:
        self._check_ready()
        return submit_all(self.orch, prep.requests)

    @staticmethod
    def _running_usage(prep: fmt.Prepared, totals: list[Joined]) -> dict:
        """vLLM's continuous_usage_stats: the counts so far on every chunk."""
        return {"usage": fmt.usage(prep, totals)} if prep.continuous_usage else {}

    def _events(self, events: AsyncIterator[str]) -> EventStream:
        return EventStream(events, write_timeout=self.config.write_timeout_s)

    # ---- routes ------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.live or self.readiness.is_draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.readiness.is_ready:
            return JSONResponse(self.readiness.warming_body(), status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_route(self) -> Response:
        if self.metrics is None:
            return Response("", media_type="text/plain")
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    def _model_card(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0,
                "owned_by": "jetserve", "max_model_len": self.limits.max_seq_len}

    async def models(self, request: Request) -> Response:
        self._check_ready()  # clients poll it to see the model served
        return JSONResponse({"object": "list",
                             "data": lora_routes.model_cards(self.adapters, self._model_card())})

    async def model(self, request: Request) -> Response:
        self._check_ready()
        name = request.path_params["model_id"]
        if name in self.adapters.names():
            return JSONResponse(lora_routes.adapter_card(self._model_card(), name))
        if name != self.config.model_name:
            raise _HttpError(error_response(
                404, f"the model {v.show(name)} does not exist; this server serves "
                     f"{self.config.model_name!r}", param="model", code="model_not_found"))
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request, TokenizeRequest)
        return JSONResponse(tokenize_api.tokenize(self.limits, body, self.config.model_name))

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request, DetokenizeRequest)
        return JSONResponse(tokenize_api.detokenize(self.limits, body,
                                                    self.config.model_name))

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(tokenize_api.tokenizer_info(self.limits))

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionRequest)
        prep = fmt.prepare_completion(self.limits, body, self.config.model_name,
                                      client_id.from_http(request), self.adapters)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": body.model or self.config.model_name}
        if not prep.run:  # max_tokens 0 and nothing to score: echo (or nothing) at once
            joined = [Joined(finish_reason="length") for _ in range(prep.choices)]
            if prep.stream:
                return self._events(self._completion_events(prep, head, None, joined))
            return JSONResponse({**head, "choices": [
                fmt.completion_choice(prep, self.tt, i, j) for i, j in enumerate(joined)],
                "usage": fmt.usage(prep, joined)})
        handles = self._submit(prep)
        if prep.stream:
            return self._events(self._completion_events(prep, head, handles, None))
        joined = await self._joined(request, handles)
        return JSONResponse({**head, "choices": [
            fmt.completion_choice(prep, self.tt, i, j) for i, j in enumerate(joined)],
            "usage": fmt.usage(prep, joined)})

    async def _completion_events(self, prep: fmt.Prepared, head: dict, handles: list | None,
                                 done: list[Joined] | None) -> AsyncIterator[str]:
        totals = [Joined() for _ in range(prep.choices)]
        sent_chars = [0] * prep.choices
        started = [False] * prep.choices
        texts = [self.tt.texts(prep, i) for i in range(prep.choices)]  # across chunks
        start = _sse_start(head)

        def chunk(i: int, part: Joined) -> str:
            choice = fmt.completion_choice(prep, self.tt, i, part, first=not started[i],
                                           base=sent_chars[i], texts=texts[i])
            started[i] = True
            sent_chars[i] += len(choice["text"])
            return _sse_chunk(start, choice, self._running_usage(prep, totals))

        if handles is None:
            for i, j in enumerate(done or ()):
                yield chunk(i, j)
        else:
            try:
                async with contextlib.aclosing(merge(handles, cut=self.cut)) as batches:
                    async for batch in batches:
                        for i, d in batch:
                            part = Joined()
                            part.add(d)
                            totals[i].add(d)
                            if d.finish_reason == "error":
                                yield _failed_event(handles[i])
                                return
                            yield chunk(i, part)
            except ShuttingDown:
                for i in _unfinished(totals):
                    totals[i].finish_reason = "cancelled"
                    yield chunk(i, Joined(finish_reason="cancelled"))
                yield _SHUTDOWN_EVENT
        if prep.include_usage:
            yield _sse({**head, "choices": [], "usage": fmt.usage(prep, totals)})
        yield "data: [DONE]\n\n"

    async def chat(self, request: Request) -> Response:
        body = await self._body(request, ChatRequest)
        prep = fmt.prepare_chat(self.limits, body, self.config.model_name,
                                client_id.from_http(request), self.adapters,
                                self.config.tool_call_parser, self.config.reasoning_parser)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": body.model or self.config.model_name}
        handles = self._submit(prep)
        if prep.stream:
            return self._events(self._chat_events(prep, head, handles))
        joined = await self._joined(request, handles)
        return JSONResponse({**head, "object": "chat.completion", "choices": [
            fmt.chat_choice(prep, self.tt, i, j) for i, j in enumerate(joined)],
            "usage": fmt.usage(prep, joined)})

    async def _chat_events(self, prep: fmt.Prepared, head: dict,
                           handles: list) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        totals = [Joined() for _ in handles]
        texts = [self.tt.texts(prep, i) for i in range(len(handles))]  # across chunks
        readers = [fmt.choice_reader(prep) for _ in handles]  # thinking, tool calls
        start = _sse_start(head)
        for i in range(len(handles)):
            yield _sse({**head, "choices": [{"index": i, "delta": readers[i].opening(),
                                             "logprobs": None, "finish_reason": None}],
                        **self._running_usage(prep, totals)})
        try:
            async with contextlib.aclosing(merge(handles, cut=self.cut)) as batches:
                async for batch in batches:
                    for i, d in batch:
                        if d.finish_reason == "error":
                            yield _failed_event(handles[i])
                            return
                        totals[i].add(d)
                        logprobs = (fmt.chat_logprobs(texts[i], d.token_ids, d.logprobs,
                                                      d.top_logprobs,
                                                      final=d.finish_reason is not None)
                                    if prep.logprobs is not None else None)
                        delta, finish = readers[i].read(d.text, d.token_ids,
                                                        d.finish_reason)
                        if not (delta or finish or logprobs or prep.continuous_usage):
                            continue  # text held back while it may be a tool call
                        yield _sse_chunk(start, {"index": i, "delta": delta,
                                                 "logprobs": logprobs, "finish_reason": finish},
                                         self._running_usage(prep, totals))
        except ShuttingDown:
            for i in _unfinished(totals):
                totals[i].finish_reason = "cancelled"
                yield _sse({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                                 "finish_reason": "cancelled"}]})
            yield _SHUTDOWN_EVENT
        if prep.include_usage:
            yield _sse({**head, "choices": [], "usage": fmt.usage(prep, totals)})
        yield "data: [DONE]\n\n"


    async def responses(self, request: Request) -> Response:
        body = parse_body(await request.body())
        try:
            chat = validate(ChatRequest, responses_api.chat_body(body))
            prep = fmt.prepare_chat(self.limits, chat, self.config.model_name,
                                    client_id.from_http(request), self.adapters,
                                    self.config.tool_call_parser, self.config.reasoning_parser)
        except v.InvalidArgument as e:
            raise responses_api.renamed(e) from None
        rid, model = f"resp_{uuid.uuid4().hex}", chat.model or self.config.model_name
        handles = self._submit(prep)
        if prep.stream:
            return self._events(self._response_events(prep, body, rid, model, handles[0]))
        [joined] = await self._joined(request, handles)
        message = fmt.chat_choice(prep, self.tt, 0, joined)["message"]
        return JSONResponse(responses_api.response(
            rid, body, model, responses_api.output_items(message), joined.finish_reason,
            fmt.usage(prep, [joined])))

    async def _response_events(self, prep: fmt.Prepared, body: dict, rid: str, model: str,
                               handle: Any) -> AsyncIterator[str]:
        async def deltas():
            async with contextlib.aclosing(merge([handle], cut=self.cut)) as batches:
                async for batch in batches:
                    for _, d in batch:
                        yield d

        def respond(output: list, finish: str | None, total: Joined | None) -> dict:
            return responses_api.response(rid, body, model, output, finish,
                                          total and fmt.usage(prep, [total]))

        w = responses_api.EventWriter()
        try:
            async for e in w.events(deltas(), fmt.choice_reader(prep), respond):
                yield f"event: {e['type']}\n{_sse(e)}"
        except ShuttingDown:
            e = w.event("error", code="shutting_down", message=_SHUTTING_DOWN)
            yield f"event: error\n{_sse(e)}"


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: `jetserve serve` decides on shutdown."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()


class HttpServer:
    """Runs an OpenAIApp under uvicorn on the current asyncio loop."""

    def __init__(self, orch: Orchestrator, limits: v.ModelLimits, config: ServerConfig,
                 metrics: Any | None = None, readiness: Readiness | None = None):
        self.config = config
        self.api = OpenAIApp(orch, limits, config, metrics, readiness)
        self.port: int | None = None
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        c = self.config
        sock = listening_socket(c.host, c.http_port, what="HTTP port")
        self.port = sock.getsockname()[1]
        app = CarryTransport(BodyLimits(self.api.app, max_body_bytes=c.max_body_bytes,
                                        body_timeout_s=c.body_timeout_s))
        cfg = uvicorn.Config(app, log_level="warning", access_log=False,
                             lifespan="off",
                             timeout_graceful_shutdown=c.drain_timeout_s + CUT_GRACE_S,
                             http=h11_protocol(c.header_timeout_s, c.body_timeout_s),
                             timeout_keep_alive=c.keep_alive_timeout_s,
                             ssl_certfile=c.tls_cert, ssl_keyfile=c.tls_key)
        self._server = _Uvicorn(cfg)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stops accepting connections; in-flight responses finish (up to the drain timeout)."""
        self.api.live = False
        # At the drain timeout our streams end themselves (final chunk, [DONE]); uvicorn's
        # own cut, CUT_GRACE_S later, is for those that cannot even send that.
        cut = asyncio.get_running_loop().call_later(self.config.drain_timeout_s,
                                                    self.api.cut.fire)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await self._task
            finally:
                cut.cancel()
