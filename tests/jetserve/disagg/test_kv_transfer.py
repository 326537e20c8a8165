"""Prefixes pulled from another process (jax.experimental.transfer on 127.0.0.1): the
decode engine generates from them exactly what it generates from its own prefill, across
presets; a prefix of another model is refused before any pull; held prefixes are freed by
an ack or a timeout; a pull from a sender that hangs is given up on time, leaving no
thread behind."""

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jetserve.disagg import prefix_wire
from jetserve.disagg.kv_transfer import KVReceiver, KVSender, PullTimeout
from jetserve.model_loading import build_engine
from tests.jetserve.disagg.prefix_sender import ENGINE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
PROMPTS = ([5, 17, 42, 9, 88, 3], [7] * 20)


class Sender:
    """The prefix_sender process, one JSON command and answer at a time."""

    def __init__(self, sharding: str, devices: int, hold_s: float):
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.jetserve.disagg.prefix_sender", sharding,
             str(devices), str(hold_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=ROOT, env=env)
        assert "ready" in self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "the sender process ended"
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def sender():
    s = Sender("tp", 4, hold_s=3.0)  # tp over 4 devices: tiny's 2 kv heads repeated twice
    yield s
    s.close()


def _greedy(engine, params, prefix, steps: int) -> list[int]:
    state = engine.insert(prefix, engine.init_decode_state(), 1)
    out = [int(prefix.token)]
    for _ in range(steps):
        state, res = engine.generate(params, state)
        out.append(res.to_host().token(1))
    return out


@pytest.mark.parametrize("sharding,devices,layout", [("tp_kv_batch", 4, "contiguous"),
                                                     ("replicated", 2, "contiguous"),
                                                     ("replicated", 2, "paged")])
def test_pulled_prefix_generates_what_a_local_prefill_does(sender, sharding, devices, layout):
    engine = build_engine("random:tiny", devices=jax.devices()[4:4 + devices],
                          sharding=sharding,
                          engine_config=dataclasses.replace(ENGINE, kv_layout=layout,
                                                            page_size=8))
    params = engine.load_params()
    receiver = KVReceiver(engine)
    for prompt in PROMPTS:
        sent = sender.ask(prompt=prompt, receiver_devices=devices)
        pulled = receiver.pull(sent["address"], sent["uuid"], sent["meta"], "sender")
        assert jax.tree.structure(pulled) == jax.tree.structure(
            engine.prefix_destination_sharding())
        for got, want in zip(jax.tree.leaves(pulled),
                             jax.tree.leaves(engine.prefix_destination_sharding()), strict=True):
            assert got.sharding.is_equivalent_to(want, got.ndim)
        ids = np.asarray(prompt, np.int32)
        local, first = engine.prefill(params, ids, len(ids))
        assert sent["first"] == first.to_host().token(0)
        assert _greedy(engine, params, pulled, 6) == _greedy(engine, params, local, 6)
        assert sender.ask(ack=sent["uuid"]) == {"freed": True, "registered": 0}


def test_prefix_of_another_model_is_refused_before_the_pull(sender):
    other = build_engine("random:small", devices=jax.devices()[4:6], sharding="replicated",
                         engine_config=ENGINE)
    receiver = KVReceiver(other)
    sent = sender.ask(prompt=PROMPTS[0], receiver_devices=2)
    with pytest.raises(prefix_wire.PrefixMismatch, match="worker-a makes prefixes with"):
        receiver.pull(sent["address"], sent["uuid"], sent["meta"], "worker-a")
    # A described kv array of another dtype is named too.
    tiny = build_engine("random:tiny", devices=jax.devices()[4:6], sharding="replicated",
                        engine_config=ENGINE)
    meta = copy.deepcopy(sent["meta"])
    meta["signature"]["dtype"] = "bfloat16"
    with pytest.raises(prefix_wire.PrefixMismatch, match="dtype='bfloat16'"):
        KVReceiver(tiny).pull(sent["address"], sent["uuid"], meta, "worker-a")
    assert sender.ask(ack=sent["uuid"])["freed"] is True  # still held: nothing was pulled


def test_unacknowledged_prefixes_are_freed_after_the_hold_time(sender):
    sent = sender.ask(prompt=PROMPTS[1], receiver_devices=2)
    assert sender.ask(expire=True) == {"expired": 0, "registered": 1}
    time.sleep(3.5)  # past hold_s (not a timed assertion: waits for the timeout to pass)
    assert sender.ask(expire=True) == {"expired": 1, "registered": 0}
    assert sender.ask(ack=sent["uuid"]) == {"freed": False, "registered": 0}


def test_sender_checks_its_hold_time():
    engine = build_engine("random:tiny", devices=jax.devices()[:1], engine_config=ENGINE)
    with pytest.raises(ValueError, match="hold_s must be > 0"):
        KVSender(engine, hold_s=0)


def test_pull_from_a_hung_sender_is_abandoned_without_a_thread_left_behind(sender):
    engine = build_engine("random:tiny", devices=jax.devices()[4:6], sharding="replicated",
                          engine_config=ENGINE)
    receiver = KVReceiver(engine, timeout_s=1.0)
    sent = sender.ask(prompt=PROMPTS[0], receiver_devices=2)
    threads = threading.active_count()
    sender.proc.send_signal(signal.SIGSTOP)  # hangs: stopped, its sockets still open
    try:
        with pytest.raises(PullTimeout, match="no prefix from worker-a after 1 s"):
            receiver.pull(sent["address"], sent["uuid"], sent["meta"], "worker-a")
        assert threading.active_count() == threads  # nothing is still waiting on it
    finally:
        sender.proc.send_signal(signal.SIGCONT)
    # The sender answers again: a new pull reconnects and gets its prefix.
    again = sender.ask(prompt=PROMPTS[0], receiver_devices=2)
    pulled = receiver.pull(again["address"], again["uuid"], again["meta"], "worker-a")
    assert int(pulled.token) == again["first"]
    assert sender.ask(ack=sent["uuid"])["freed"] is True
    assert sender.ask(ack=again["uuid"]) == {"freed": True, "registered": 0}
