"""The gRPC service of a `--role prefill` worker (`jetserve_disagg.PrefillWorker`, see
protos/prefill_worker.proto), on grpc.aio.

Concurrency: one asyncio loop serves every RPC; `Prefill` hands its job to the prefill
thread (prefill_runner.py) and awaits the job's future, so no thread is held per call.
A call the decode side gives up on (cancelled, deadline) still finishes its prefill; its
prefix is then freed at once rather than held until it expires.

Draining (`drain`): Prefill is refused with UNAVAILABLE (the decode side retries on
another worker) while queued jobs finish and their prefixes are pulled and acknowledged,
up to a timeout; Ack and Load keep answering throughout.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engines import SamplingParams
from engines.token_mask import mask_words
from jetserve.disagg import prefix_wire
from jetserve.disagg.prefill_runner import PrefillJob, PrefillRunner, wait_idle
from jetserve.request import Overloaded
from jetserve.server.ports import unavailable
from jetserve.server.streams import internal_error
from protos import prefill_worker_pb2 as pb
from protos import prefill_worker_pb2_grpc as pb_grpc

log = logging.getLogger("jetserve.disagg")

ROLE = "prefill"
SERVICE = pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


def token_mask_from_bytes(data: bytes, vocab_size: int) -> np.ndarray | None:
    """The request's token_mask as i32[1, W] (None when empty); ValueError naming the
    field when its size does not fit this model's vocabulary."""
    if not data:
        return None
    words = mask_words(vocab_size)
    if len(data) != 4 * words:
        raise ValueError(f"token_mask has {len(data)} bytes; this model's vocabulary of "
                         f"{vocab_size} takes {4 * words} ({words} int32 words)")
    return np.frombuffer(data, np.int32).reshape(1, words)


def _adapter(engine, name: str) -> str | None:
    """The request's lora_adapter (None when empty); ValueError naming the field when
    this worker does not hold that adapter."""
    if not name:
        return None
    adapters = getattr(engine, "adapters", None)
    if adapters is None:
        raise ValueError(f"lora_adapter {name!r}: this prefill worker serves no LoRA "
                         "adapters (start it with the decode side's --lora-modules)")
    if name not in adapters:
        raise ValueError(f"lora_adapter {name!r}: not loaded on this prefill worker "
                         f"(loaded: {adapters.names()})")
    return name


def sampling_from_json(text: str) -> SamplingParams:
    """SamplingParams from the request's JSON (ValueError naming a bad field)."""
    fields = json.loads(text) if text else {}
    if not isinstance(fields, dict):
        raise ValueError("sampling_json must be a JSON object")
    return SamplingParams(**fields)


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, runner: PrefillRunner):
        self.runner = runner
        self.accepting = True
        self.ready = False

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if not self.accepting or not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "prefill worker is draining" if self.ready else
                                "prefill worker is warming up")
        try:
            if request.score_only and not request.prompt_logprobs:
                raise ValueError("score_only goes with prompt_logprobs")
            if request.prompt_logprobs and not hasattr(self.runner.engine, "prompt_logprobs"):
                raise ValueError("prompt_logprobs: this worker's engine cannot score prompts")
            job = PrefillJob(request_id=request.request_id,
                             token_ids=np.asarray(request.token_ids, np.int32),
                             sampling=sampling_from_json(request.sampling_json),
                             receiver_devices=max(1, request.receiver_devices),
                             token_mask=token_mask_from_bytes(request.token_mask,
                                                              self.runner.engine.vocab_size),
                             prompt_logprobs=(max(0, request.top_logprobs)
                                              if request.prompt_logprobs else None),
                             score_only=request.score_only,
                             adapter=_adapter(self.runner.engine, request.lora_adapter))
            future = self.runner.submit(job)
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            done = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._free_unwanted)
            raise
        except Exception:  # the runner logged its traceback under the request's id
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(request.request_id))
        return pb.PrefillResponse(
            first_row=done.first_row.astype(np.int32).tobytes(),
            first_columns=int(done.first_row.shape[0]), transfer_address=done.address,
            uuid=done.uuid, prefix_json=json.dumps(done.meta), queue_depth=self.runner.depth(),
            prompt_logprobs_json=("" if done.prompt_logprobs is None
                                  else json.dumps(done.prompt_logprobs)))

    def _free_unwanted(self, future) -> None:
        if not future.cancelled() and future.exception() is None and future.result().uuid:
            self.runner.ack(future.result().uuid)

    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        return pb.AckResponse(freed=self.runner.ack(request.uuid))

    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadResponse:
        e = self.runner.engine
        cache = {} if self.runner.cache is None else self.runner.cache.stats()
        return pb.LoadResponse(
            role=ROLE, queue_depth=self.runner.depth(),
            registered=self.runner.sender.registered(), ready=self.ready,
            signature_json=json.dumps(prefix_wire.signature(e)),
            max_prefill_length=e.max_prefill_length, max_seq_len=e.max_seq_len,
            prefills=self.runner.prefills,
            prefix_cache_queries=cache.get("lookup_tokens", 0),
            prefix_cache_hits=cache.get("hit_tokens", 0))


class PrefillServer:
    """The grpc.aio server of one prefill worker; start / drain / stop on its loop."""

    def __init__(self, runner: PrefillRunner, host: str, port: int):
        self.runner = runner
        self.servicer = PrefillServicer(runner)
        self.health = health.aio.HealthServicer()
        self.host, self.port = host, port
        self.server: grpc.aio.Server | None = None

    async def start(self) -> int:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_PrefillWorkerServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            port = server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError:
            port = 0
        if not port:
            raise unavailable("gRPC port", self.host, self.port)
        await server.start()
        self.server, self.port = server, port
        await self._set_health(False)
        return port

    async def ready(self) -> None:
        self.servicer.ready = True
        await self._set_health(True)

    async def _set_health(self, serving: bool) -> None:
        H = health_pb2.HealthCheckResponse
        for name in ("", SERVICE):
            await self.health.set(name, H.SERVING if serving else H.NOT_SERVING)

    async def drain(self, timeout_s: float) -> bool:
        """Refuses new prefills, waits for the held ones to be pulled; False on timeout."""
        self.servicer.accepting = False
        await self._set_health(False)
        return await asyncio.to_thread(wait_idle, self.runner, timeout_s)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(1.0)
