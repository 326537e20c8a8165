"""The prefill worker's gRPC service in this process (random:tiny on one fake device):
refusals while warming up and draining, named errors for bad requests (an adapter it
does not hold among them), a prefix held
from Prefill until Ack, the first token sampled within the mask a request carries, and
the prompt's log-probs when asked (alone, for scoring)."""

import asyncio
import json
import threading

import grpc
import jax
import numpy as np
import pytest

from engines import SamplingParams
from engines.engine_api import HostResults
from jetserve.disagg.kv_transfer import KVSender
from jetserve.disagg.prefill_runner import PrefillRunner
from jetserve.disagg.prefill_service import PrefillServer, PrefillServicer
from jetserve.model_loading import build_engine
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from protos import prefill_worker_pb2 as pb
from protos import prefill_worker_pb2_grpc as pb_grpc
from tests.jetserve.disagg.prefix_sender import ENGINE


@pytest.fixture(scope="module")
def worker():
    engine = build_engine("random:tiny", devices=jax.devices()[:1], engine_config=ENGINE)
    runner = PrefillRunner(engine, engine.load_params(), KVSender(engine, hold_s=30),
                           max_queued=4)
    runner.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731
    server = PrefillServer(runner, "127.0.0.1", 0)
    call(server.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, pb_grpc.PrefillWorkerStub(channel), call
    finally:
        channel.close()
        call(server.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        runner.stop()


def _code(stub, **fields) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(pb.PrefillRequest(**fields), timeout=60)
    return e.value.code(), e.value.details()


def test_prefill_worker_service(worker):
    server, stub, call = worker
    load = stub.Load(pb.LoadRequest(), timeout=30)
    assert (load.role, load.ready, load.registered) == ("prefill", False, 0)
    assert json.loads(load.signature_json)["num_kv_heads"] == 2
    assert _code(stub, token_ids=[1, 2]) == (grpc.StatusCode.UNAVAILABLE,
                                             "prefill worker is warming up")
    call(server.ready())

    code, msg = _code(stub, token_ids=[1, 2], sampling_json='{"temperature": -1}')
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in msg
    code, msg = _code(stub, token_ids=[1, 2], sampling_json='{"beam_width": 2}')
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "beam_width" in msg
    code, msg = _code(stub, token_ids=[])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids has 0 tokens" in msg
    code, msg = _code(stub, token_ids=[1, 2], lora_adapter="a1")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg.startswith("lora_adapter 'a1': this prefill worker serves no LoRA adapters")

    out = stub.Prefill(pb.PrefillRequest(token_ids=[1, 5, 9], receiver_devices=1), timeout=60)
    meta = json.loads(out.prefix_json)
    assert out.first_columns > 3 and len(out.first_row) == 4 * out.first_columns
    assert meta["signature"] == json.loads(load.signature_json)
    assert stub.Load(pb.LoadRequest(), timeout=30).registered == 1
    assert stub.Ack(pb.AckRequest(uuid=out.uuid), timeout=30).freed
    assert not stub.Ack(pb.AckRequest(uuid=out.uuid), timeout=30).freed
    assert stub.Load(pb.LoadRequest(), timeout=30).registered == 0

    # Structured output: the worker samples its one token within the mask it is sent.
    code, msg = _code(stub, token_ids=[1, 2], token_mask=b"\xff" * 4)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert msg == "token_mask has 4 bytes; this model's vocabulary of 256 takes 32 (8 int32 words)"
    for only in (77, 200):
        mask = np.zeros(8, np.int32)
        mask[only // 32] = np.int32(1 << (only % 32)) if only % 32 < 31 else np.int32(-2**31)
        out = stub.Prefill(pb.PrefillRequest(token_ids=[1, 5, 9], receiver_devices=1,
                                             token_mask=mask.tobytes()), timeout=60)
        row = np.frombuffer(out.first_row, np.int32).reshape(1, out.first_columns)
        assert HostResults(row).token(0) == only
        assert stub.Ack(pb.AckRequest(uuid=out.uuid), timeout=30).freed

    # Echo / scoring: the prompt's log-probs come back with the token, or alone.
    want = prompt_logprobs(server.runner.engine, server.runner.params,
                           np.asarray([1, 5, 9, 14], np.int32), 2)
    for score_only in (False, True):
        out = stub.Prefill(pb.PrefillRequest(token_ids=[1, 5, 9, 14], receiver_devices=1,
                                             prompt_logprobs=True, top_logprobs=2,
                                             score_only=score_only), timeout=60)
        values, alts = json.loads(out.prompt_logprobs_json)
        assert values[0] is None and len(values) == 4 and [len(a) for a in alts] == [0, 2, 2, 2]
        np.testing.assert_allclose(values[1:], want[0][1:], rtol=1e-6)
        assert [[p[0] for p in a] for a in alts] == [[p[0] for p in a] for a in want[1]]
        assert (out.first_columns == 0) == score_only and (out.uuid == 0) == score_only
        assert stub.Load(pb.LoadRequest(), timeout=30).registered == int(not score_only)
        if not score_only:
            assert stub.Ack(pb.AckRequest(uuid=out.uuid), timeout=30).freed
    code, msg = _code(stub, token_ids=[1, 2], score_only=True)
    assert (code, msg) == (grpc.StatusCode.INVALID_ARGUMENT,
                           "score_only goes with prompt_logprobs")

    assert call(server.drain(timeout_s=30))
    assert _code(stub, token_ids=[1, 2]) == (grpc.StatusCode.UNAVAILABLE,
                                             "prefill worker is draining")
    assert stub.Load(pb.LoadRequest(), timeout=30).role == "prefill"  # still answers


def test_prefix_cache_on_the_prefill_side_gives_the_same_prefix(worker):
    from jetserve.orchestrator.prefix_cache import PrefixCache
    from jetserve.orchestrator.prefix_stores import ArrayStore

    plain = worker[0].runner
    engine = plain.engine
    cache = PrefixCache(store=ArrayStore(engine, 16), hbm_bytes=1 << 24, host_bytes=0)
    cached = PrefillRunner(engine, plain.params, plain.sender, max_queued=1, cache=cache,
                           cache_key="tiny")
    tokens = np.arange(1, 41, dtype=np.int32)  # 40 tokens: two chunks of 32 and 8
    want_prefix, want_first = plain.prefill(tokens, SamplingParams())
    cached.prefill(tokens, SamplingParams())  # caches its two whole 16-token blocks
    prefix, first = cached.prefill(tokens, SamplingParams())
    assert cache.stats()["hits"] == 1 and cache.stats()["hit_tokens"] == 32
    load = asyncio.run(PrefillServicer(cached).Load(pb.LoadRequest(), None))
    assert load.prefix_cache_hits == 32  # as the worker reports them
    assert load.prefix_cache_queries == cache.stats()["lookup_tokens"] > 32
    assert first.to_host().token(0) == want_first.to_host().token(0)
    assert int(prefix.length) == int(want_prefix.length) == 40
    L = int(prefix.length)
    for got, want in zip(prefix.k + prefix.v, want_prefix.k + want_prefix.v, strict=True):
        np.testing.assert_allclose(np.asarray(got)[:, :L], np.asarray(want)[:, :L], atol=1e-5)
