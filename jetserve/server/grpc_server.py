"""The JetStream-compatible gRPC server (`jetstream_proto.Orchestrator`), on grpc.aio.

Concurrency: one asyncio loop serves every RPC. `Decode` validates the request, submits
one orchestrator Request per sample (`submit` never blocks: a full queue raises
Overloaded), then awaits the handles' async streams, so no thread is held per stream.
When a client cancels or disconnects, grpc.aio cancels the handler coroutine; leaving the
stream loop cancels the requests, which frees their slots within one generate step.

Streaming follows JetStream: one DecodeResponse per generate step with one Sample per
sample; the EOS / stop token id comes alone in `token_ids` with empty text. Also served:
the standard `grpc.health.v1.Health` service and server reflection (v1 and v1alpha).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jetserve import generation_config
from jetserve.lora_adapters import Adapters, UnknownAdapter
from jetserve.request import Delta, Overloaded, Request
from jetserve.server import client_id, reflection
from jetserve.server import validation as v
from jetserve.server.auth import HOW_TO_SEND, ApiKey
from jetserve.server.config import ServerConfig
from jetserve.server.ports import unavailable
from jetserve.server.readiness import Readiness
from jetserve.server.streams import (
    CUT_GRACE_S,
    RETRY_AFTER_S,
    ShuttingDown,
    StreamCut,
    internal_error,
    merge,
    submit_all,
)
from jetserve.server.structured_fields import constraint_of_proto
from jetserve.server.wire_check import find_malformed
from jetserve.server.write_deadline import WriteDeadline
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator

log = logging.getLogger("jetserve.server")

SERVICE = pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name
# What an unset sampling field means when the model's generation_config sets none either:
# greedy, as JetStream's clients expect.
GRPC_DEFAULTS = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                     frequency_penalty=0.0, presence_penalty=0.0)
Sample = pb.DecodeResponse.StreamContent.Sample

# Reachable without a key, so load balancers and orchestration probes can check liveness.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class OrchestratorServicer(pb_grpc.OrchestratorServicer):
    """Decode and HealthCheck over an orchestrator.

    Args:
      orch: the running orchestrator (see jetserve.orchestrator).
      limits: what the served model accepts.
      is_live: False once the server is draining.
      readiness: while it is warming up, Decode is refused with UNAVAILABLE.
    """

    def __init__(self, orch: Orchestrator, limits: v.ModelLimits, *,
                 is_live: Callable[[], bool] = lambda: True, write_timeout: float = 30.0,
                 cut: StreamCut | None = None, readiness: Readiness | None = None):
        self.readiness = readiness if readiness is not None else Readiness()
        self.orch = orch
        self.limits = limits
        self.is_live = is_live
        self.write_timeout = write_timeout
        self.cut = cut if cut is not None else StreamCut()
        self.adapters = Adapters.of(orch)

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        # False while warming up too: JetStream clients wait on it before sending.
        return pb.HealthCheckResponse(is_live=self.is_live() and self.readiness.is_ready)

    async def Decode(self, request: pb.DecodeRequest | Malformed, context) -> None:
        """Runs `_decode`; an unexpected exception in it (a bug) becomes INTERNAL naming a
        call id, and a log line with the traceback under that id."""
        try:
            await self._decode(request, context)
        except grpc.aio.AbortError:  # a status _decode chose; already sent
            raise
        except Exception:
            call_id = f"call-{uuid.uuid4().hex}"
            log.exception("gRPC Decode %s failed", call_id)
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(call_id))

    async def _decode(self, request: pb.DecodeRequest | Malformed, context) -> None:
        # context.write rather than yield: a write that flow control holds (the client
        # reads nothing) is bounded by the write timeout; a yielded message is not.
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        if not self.readiness.is_ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.readiness.refusal())
        try:
            requests = self.build_requests(request, context.time_remaining(),
                                           client_id.from_grpc(context))
            handles = submit_all(self.orch, requests)
        except v.InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UnknownAdapter as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, e.args[0])
        except Overloaded as e:
            # As HTTP's 429: when to come back, in the trailers a client reads with the code.
            context.set_trailing_metadata((("retry-after", RETRY_AFTER_S),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server overloaded, retry later: {e}")
        except ValueError as e:  # the orchestrator's own checks; they name the field too
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        n = len(handles)
        deadline = WriteDeadline(self.write_timeout)
        try:
            async with contextlib.aclosing(merge(handles, cut=self.cut)) as batches:
                async for batch in batches:
                    for i, d in batch:
                        if d.finish_reason == "error":  # logged under its request's id
                            await context.abort(grpc.StatusCode.INTERNAL, f"sample {i}: "
                                                f"{internal_error(handles[i].request_id)}")
                    for msg in _messages(batch, n):
                        await deadline.write(context.write(msg))
        except ShuttingDown:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "server shutting down: the drain timeout ended this stream")
        except TimeoutError:
            log.warning("ending the Decode stream of %s: it read nothing for %g s (write "
                        "timeout); its requests are cancelled", context.peer(),
                        self.write_timeout)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the client read nothing for {self.write_timeout:g} s "
                                "(write timeout); the request was cancelled")
        finally:
            deadline.close()

    def build_requests(self, r: pb.DecodeRequest, time_remaining: float | None,
                       client: str = "") -> list[Request]:
        """Validates a DecodeRequest; one Request per sample, from `client`."""
        lim = self.limits
        which = r.WhichOneof("content")
        if which is None:
            raise v.InvalidArgument("content", "content is missing: set text_content or "
                                               "token_content")
        if r.lora_adapter_id:
            self.adapters.check(r.lora_adapter_id, "lora_adapter_id")
        # has_bos false: the content lacks BOS, so the server prepends it (as JetStream).
        add_bos = not r.has_bos
        if which == "text_content":
            if r.text_content.text == "":
                raise v.InvalidArgument("text_content.text", "text_content.text is empty")
            ids = v.encode_text(lim, r.text_content.text, "text_content.text", add_bos=add_bos)
        else:
            ids = v.check_token_ids(lim, list(r.token_content.token_ids),
                                    "token_content.token_ids")
            if add_bos and lim.bos_id is not None:
                ids = [lim.bos_id] + ids
        field = "text_content.text" if which == "text_content" else "token_content.token_ids"
        v.check_prompt_length(lim, ids, field)
        max_tokens = v.check_max_tokens(lim, r.max_tokens, len(ids))
        n = v.check_samples(r.num_samples or 1, "num_samples")
        v.check_sub_requests(lim, 1, n, n_field="num_samples")
        # The extension fields are proto3 `optional`: an unset one takes the model's
        # default (generation_config.json), else greedy's. max_tokens is JetStream's
        # plain int32, where unset is 0: no default, as in JetStream.
        asked = {f: getattr(r, f) if r.HasField(f) else None for f in GRPC_DEFAULTS}
        sampling = v.sampling_params(
            **generation_config.resolve(asked, lim.generation, GRPC_DEFAULTS),
            seed=r.seed if r.HasField("seed") else None,
            logit_bias=v.logit_bias_pairs(lim, dict(r.logit_bias)))
        stop = v.check_stop(list(r.stop))
        stop_ids = v.check_stop_token_ids(lim, list(r.stop_token_ids))
        logprobs = v.check_logprobs(lim, r.logprobs) if r.HasField("logprobs") else None
        constraint = constraint_of_proto(r)
        deadline = time.monotonic() + time_remaining if time_remaining is not None else None
        return [Request(prompt_ids=tuple(ids), sampling=v.sample_seed(sampling, i),
                        max_tokens=max_tokens, stop_token_ids=stop_ids, stop_strings=stop,
                        ignore_eos=r.ignore_eos, logprobs=logprobs, deadline=deadline,
                        client=client, constraint=constraint,
                        lora_adapter=r.lora_adapter_id or None)
                for i in range(n)]


class Malformed:
    """A request whose bytes are not a valid message; Decode answers INVALID_ARGUMENT."""

    def __init__(self, message: str):
        self.message = message


def _parse_decode_request(raw: bytes) -> pb.DecodeRequest | Malformed:
    # The protobuf runtime rejects bad UTF-8 without naming the field, and silently drops
    # a field sent with the wrong wire type (the request would run with a default);
    # find_malformed names either.
    problem = find_malformed(raw, pb.DecodeRequest.DESCRIPTOR)
    if problem is not None:
        return Malformed(problem)
    try:
        return pb.DecodeRequest.FromString(raw)
    except DecodeError as e:
        return Malformed(f"request is not a valid DecodeRequest: {e}")


def add_servicer(servicer: OrchestratorServicer, server: grpc.aio.Server) -> None:
    """Registers `jetstream_proto.Orchestrator` with a lenient Decode deserializer."""
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode, request_deserializer=_parse_decode_request,
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            servicer.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _split(d: Delta) -> list[Sample]:
    """A delta as one or two Samples: the text and tokens, then the stop token alone."""
    ids = list(d.token_ids)
    lps = list(d.logprobs) if d.logprobs is not None else None
    tops = list(d.top_logprobs) if d.top_logprobs is not None else None
    parts: list[tuple[list[int], str, list | None, list | None]] = []
    ends_on_stop_id = (d.finish_reason == "stop" and isinstance(d.stop_reason, int)
                       and ids and ids[-1] == d.stop_reason)
    if ends_on_stop_id:
        if len(ids) > 1 or d.text:
            parts.append((ids[:-1], d.text, lps and lps[:-1], tops and tops[:-1]))
        parts.append((ids[-1:], "", lps and lps[-1:], tops and tops[-1:]))
    else:
        parts.append((ids, d.text, lps, tops))
    samples = []
    for tok, text, lp, top in parts:
        s = Sample(text=text, token_ids=tok)
        if lp:
            s.logprobs.extend(lp)
        for alts in top or ():
            entry = s.top_logprobs.add()
            for tid, tlp in alts:
                entry.alternatives.add(token_id=tid, logprob=tlp)
        samples.append(s)
    if d.finish_reason is not None:
        samples[-1].finish_reason = d.finish_reason
    return samples


def _messages(batch: list[tuple[int, Delta]], n: int) -> list[pb.DecodeResponse]:
    """One message per step; a second one when some sample's stop token goes alone."""
    split = {i: _split(d) for i, d in batch}
    rounds = max(len(s) for s in split.values())
    out = []
    for k in range(rounds):
        samples = [Sample() for _ in range(n)]
        any_content = False
        for i, parts in split.items():
            # The stop-token part goes last so every sample's text precedes it.
            j = k - (rounds - len(parts))
            if 0 <= j < len(parts):
                samples[i] = parts[j]
                any_content = True
        if any_content:
            out.append(pb.DecodeResponse(
                stream_content=pb.DecodeResponse.StreamContent(samples=samples)))
    return out


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the API key (`authorization: Bearer KEY` or `x-api-key: KEY`)
    with UNAUTHENTICATED; grpc.health.v1 stays open for probes."""

    def __init__(self, api_key: str):
        self._key = ApiKey(api_key)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or details.method.startswith(_OPEN_PREFIXES)
                or self._key.accepts(details.invocation_metadata or ())):
            return handler
        message = f"missing or wrong API key: {HOW_TO_SEND} as metadata"

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover (makes this an async generator)

        async def deny_bidi(requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover

        if handler.request_streaming:  # reflection's ServerReflectionInfo
            return grpc.stream_stream_rpc_method_handler(
                deny_bidi, handler.request_deserializer, handler.response_serializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                deny_stream, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            deny_unary, handler.request_deserializer, handler.response_serializer)


class GrpcServer:
    """The grpc.aio server with its services; start/stop on the serving loop."""

    def __init__(self, orch: Orchestrator, limits: v.ModelLimits, config: ServerConfig,
                 readiness: Readiness | None = None):
        self.config = config
        self.live = True
        self.cut = StreamCut()  # fired when a drain runs out of time (stop)
        self.readiness = readiness if readiness is not None else Readiness()
        self.servicer = OrchestratorServicer(orch, limits, is_live=lambda: self.live,
                                             write_timeout=config.write_timeout_s, cut=self.cut,
                                             readiness=self.readiness)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        c = self.config
        interceptors = [ApiKeyInterceptor(c.api_key)] if c.api_key else []
        # grpc.so_reuseport 0: a port another server holds is an error, not shared with it.
        server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        add_servicer(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable((SERVICE, health.SERVICE_NAME), server)
        address = f"{c.host}:{c.grpc_port}"
        credentials = None
        if c.tls_cert:
            with open(c.tls_key, "rb") as f:
                key = f.read()
            with open(c.tls_cert, "rb") as f:
                cert = f.read()
            credentials = grpc.ssl_server_credentials([(key, cert)])
        try:  # a port that cannot be bound: 0 from some grpc versions, RuntimeError from others
            port = (server.add_secure_port(address, credentials) if credentials is not None
                    else server.add_insecure_port(address))
        except RuntimeError:
            port = 0
        if not port:
            raise unavailable("gRPC port", c.host, c.grpc_port)
        await server.start()
        self.server, self.port = server, port
        await self.set_health()  # NOT_SERVING while warming up
        return port

    async def set_health(self) -> None:
        """SERVING once ready (see Readiness), NOT_SERVING before; on the serving loop."""
        if not self.live:  # draining: enter_graceful_shutdown has the last word
            return
        H = health_pb2.HealthCheckResponse
        status = H.SERVING if self.readiness.healthy else H.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        """Refuses new calls at once; in-flight streams get `grace` seconds to finish, then
        end with UNAVAILABLE."""
        self.live = False
        # At `grace` our streams end with a status; gRPC's own cancel, CUT_GRACE_S later, is
        # for those whose status cannot go out.
        cut = asyncio.get_running_loop().call_later(grace or 0.0, self.cut.fire)
        try:
            await self.health.enter_graceful_shutdown()
            if self.server is not None:
                await self.server.stop(None if grace is None else grace + CUT_GRACE_S)
        finally:
            cut.cancel()
