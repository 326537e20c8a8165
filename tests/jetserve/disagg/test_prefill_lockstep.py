"""Prefixes offered block by block (a prefill engine over several processes), in one
process: each distinct block is offered once, by the lowest-id device holding it; the
decode side pulls the blocks, puts the leaves together and generates what a local
prefill generates; the lock-step runner's turns carry jobs (with their first token's mask
and scoring) and acknowledgements, and a failed broadcast fails what is queued.
(The two-process deployment itself: tests/e2e/test_split_serve_processes.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engines import SamplingParams
from engines.engine_api import HostResults
from jetserve.disagg import prefix_wire
from jetserve.disagg.kv_transfer import KVReceiver, KVSender
from jetserve.disagg.prefill_lockstep import LockStepPrefillRunner, exchange_turn
from jetserve.disagg.prefill_runner import PrefillJob
from jetserve.model_loading import build_engine
from jetserve.orchestrator.prefill_worker import prompt_logprobs
from tests.jetserve.disagg.prefix_sender import ENGINE
from tests.jetserve.disagg.test_kv_transfer import _greedy


def test_each_distinct_block_is_owned_by_the_lowest_device_holding_it():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, PartitionSpec("a")))
    got = prefix_wire.owned_pieces(x)
    assert [(d.id, index) for d, index in got] == [(0, [[0, 2], [0, 8]]),
                                                   (2, [[2, 4], [0, 8]])]
    one = jax.device_put(jnp.float32(3), NamedSharding(mesh, PartitionSpec()))
    assert [(d.id, index) for d, index in prefix_wire.owned_pieces(one)] == [(0, [])]


def test_turns_round_trip_through_the_broadcast():
    sent = []

    def broadcast(a):
        sent.append(a.shape)
        return a

    turn = {"stop": False, "acks": [2**62 + 5], "job": {"tokens": list(range(300))}}
    assert exchange_turn(turn, broadcast) == turn
    assert sent[0] == (1,) and sent[1][0] >= len(str(turn)) and sent[1][0] & (sent[1][0] - 1) == 0


@pytest.fixture(scope="module")
def engines():
    prefill = build_engine("random:tiny", devices=jax.devices()[:4], sharding="tp",
                           engine_config=ENGINE)
    decode = build_engine("random:tiny", devices=jax.devices()[4:6], sharding="replicated",
                          engine_config=dataclasses.replace(ENGINE, kv_layout="paged",
                                                            page_size=8))
    return prefill, prefill.load_params(), decode, decode.load_params()


def _generates_as_a_local_prefill(decode, params, ids, done, pulled) -> None:
    """The worker's first token and the pulled prefix's next tokens are what a prefill of
    `ids` on the decode engine gives (in chunks of max_prefill_length)."""
    local = None
    for start in range(0, len(ids), 32):
        piece = ids[start:start + 32]
        local, first = decode.prefill(params, piece, len(piece), existing_prefix=local)
    assert HostResults(done.first_row[None]).token(0) == first.to_host().token(0)
    assert _greedy(decode, params, pulled, 5) == _greedy(decode, params, local, 5)


def test_lock_step_runner_offers_blocks_that_generate_as_a_local_prefill(engines):
    prefill, params, decode, decode_params = engines
    sender = KVSender(prefill, hold_s=30)
    runner = LockStepPrefillRunner(prefill, params, sender, max_queued=4, primary=True,
                                   broadcast=lambda a: a, idle_wait_s=0.01)
    assert sender.sources == [sender.address]  # this one process's transfer server
    receiver = KVReceiver(decode)
    runner.start()
    try:
        for prompt in ([5, 17, 42, 9, 88, 3], [7] * 40):  # the second in two chunks
            ids = np.asarray(prompt, np.int32)
            job = PrefillJob(request_id="r", token_ids=ids, sampling=SamplingParams(),
                             receiver_devices=2)
            done = runner.submit(job).result(timeout=300)
            # Each leaf's blocks tile it once: kv heads repeated over tp are offered once.
            for i, r in enumerate(done.meta["leaves"]):
                blocks = [p["index"] for p in done.meta["pieces"] if p["leaf"] == i]
                assert sum(np.prod([b - a for a, b in x]) for x in blocks) == np.prod(r["shape"])
            assert {p["source"] for p in done.meta["pieces"]} == {0}
            pulled = receiver.pull(done.address, done.uuid, done.meta, "worker")
            _generates_as_a_local_prefill(decode, decode_params, ids, done, pulled)
            assert runner.ack(done.uuid) is True and sender.registered() == 0
    finally:
        runner.stop()


def test_a_failed_broadcast_fails_the_queued_jobs_and_refuses_new_ones(engines):
    prefill, params, _, _ = engines

    def broken(a):
        raise RuntimeError("gloo: connection closed by peer")

    runner = LockStepPrefillRunner(prefill, params, KVSender(prefill, hold_s=30),
                                   max_queued=4, primary=True, broadcast=broken)
    jobs = [PrefillJob(request_id=f"r{i}", token_ids=np.asarray([5, 6], np.int32),
                       sampling=SamplingParams(), receiver_devices=2) for i in range(2)]
    futures = [runner.submit(j) for j in jobs]
    runner.start()
    try:
        for f in futures:
            with pytest.raises(RuntimeError, match="connection closed by peer"):
                f.result(timeout=60)
        with pytest.raises(RuntimeError, match="this prefill worker stopped: lock step"):
            runner.submit(jobs[0])
    finally:
        runner.stop()


def test_turns_carry_the_first_tokens_mask_and_scoring(engines):
    prefill, params, _, _ = engines
    sender = KVSender(prefill, hold_s=30)
    runner = LockStepPrefillRunner(prefill, params, sender, max_queued=4, primary=True,
                                   broadcast=lambda a: a, idle_wait_s=0.01)
    mask = np.zeros((1, 8), np.int32)
    mask[0, 77 // 32] = 1 << (77 % 32)  # token 77 only
    ids = np.asarray([5, 17, 42, 9], np.int32)
    runner.start()
    try:
        done = runner.submit(PrefillJob(request_id="m", token_ids=ids, sampling=SamplingParams(),
                                        receiver_devices=2, token_mask=mask,
                                        prompt_logprobs=2)).result(timeout=300)
        assert HostResults(done.first_row[None]).token(0) == 77
        want = prompt_logprobs(prefill, params, ids, 2)
        assert done.prompt_logprobs[1] == want[1]
        np.testing.assert_allclose(done.prompt_logprobs[0][1:], want[0][1:], rtol=1e-6)
        assert runner.ack(done.uuid) is True
        only = runner.submit(PrefillJob(request_id="s", token_ids=ids, sampling=SamplingParams(),
                                        receiver_devices=2, prompt_logprobs=0,
                                        score_only=True)).result(timeout=300)
        assert only.uuid == 0 and only.first_row.size == 0 and sender.registered() == 0
    finally:
        runner.stop()


def test_lock_step_runners_keep_alike_prefix_caches(engines):
    """A prefill worker over several processes with the prefix cache, in one process:
    process 0's runner and a follower (its own engine, cache and transfer server; the
    broadcast a queue) apply the same turns, so the follower's cache ends node for node,
    count for count, as process 0's; a prompt through a cached 2-block prefix is a hit
    whose prefix generates what a local prefill of the whole prompt does."""
    import types

    from jetserve.orchestrator.prefix_cache import PrefixCache
    from jetserve.orchestrator.prefix_stores import ArrayStore
    from tests.jetserve.test_lockstep import _following, _queue_broadcast

    prefill, params, decode, decode_params = engines
    follower_engine = build_engine("random:tiny", devices=jax.devices()[4:8], sharding="tp",
                                   engine_config=ENGINE)
    send, receive = _queue_broadcast()

    def cache(engine):
        return PrefixCache(store=ArrayStore(engine, 16), hbm_bytes=1 << 20, host_bytes=0)

    lead = LockStepPrefillRunner(prefill, params, KVSender(prefill, hold_s=30), max_queued=4,
                                 primary=True, broadcast=send, idle_wait_s=0.01,
                                 cache=cache(prefill), cache_key="m")
    follower = LockStepPrefillRunner(follower_engine, follower_engine.load_params(),
                                     KVSender(follower_engine, hold_s=30), max_queued=4,
                                     primary=False, broadcast=receive,
                                     cache=cache(follower_engine), cache_key="m")
    thread, errors = _following(types.SimpleNamespace(run=follower.follow))
    receiver = KVReceiver(decode)
    shared = [(5 * j) % 200 + 3 for j in range(32)]
    lead.start()
    try:
        for prompt in (shared + [9, 8, 7], shared + [1, 2]):
            ids = np.asarray(prompt, np.int32)
            done = lead.submit(PrefillJob(request_id="r", token_ids=ids,
                                          sampling=SamplingParams(),
                                          receiver_devices=2)).result(timeout=300)
            pulled = receiver.pull(done.address, done.uuid, done.meta, "worker")
            _generates_as_a_local_prefill(decode, decode_params, ids, done, pulled)
            lead.ack(done.uuid)
    finally:
        lead.stop()
    thread.join(60)
    assert not thread.is_alive() and not errors
    stats = lead.cache.stats()
    assert stats["hits"] == 1 and stats["hit_tokens"] == 32 and stats["hbm_blocks"] == 2
    assert follower.cache.nodes() == lead.cache.nodes()
    assert follower.cache.stats() == stats
