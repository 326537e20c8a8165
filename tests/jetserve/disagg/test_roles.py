"""`jetserve serve --role`: which flags go together, worker addresses, and the bound on
KV bytes being pulled at once."""

import argparse
import threading

import pytest

from jetserve.commands import serve
from jetserve.disagg import roles
from jetserve.disagg.prefill_client import parse_addresses
from jetserve.disagg.pull_worker import BytesInFlight


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,message", [
    (["--role", "decode"], "--role decode needs --prefill-workers"),
    (["--prefill-workers", "h:1"], "--prefill-workers goes with --role decode, not --role both"),
    (["--role", "prefill", "--prefill-workers", "h:1"], "not --role prefill"),
    (["--role", "decode", "--prefill-workers", "h:1", "--coordinator", "h:1",
      "--num-processes", "2", "--process-id", "0", "--prefix-cache-hbm-mb", "8"],
     "the prefix cache is the prefill workers'"),
    (["--role", "decode", "--prefill-workers", "h:1", "--prefill-devices", "2"],
     "leave out --prefill-devices"),
    (["--role", "prefill", "--generate-devices", "2"], "--devices N takes the first N"),
    (["--role", "decode", "--prefill-workers", "h:1", "--prefix-cache-hbm-mb", "8"],
     "the prefix cache is the prefill workers'"),
    (["--role", "prefill", "--prefix-hold-timeout", "0"], "--prefix-hold-timeout must be > 0"),
    (["--role", "decode", "--prefill-workers", "h:1", "--prefill-timeout", "-1"],
     "--prefill-timeout must be > 0"),
    (["--role", "decode", "--prefill-workers", "h:1", "--max-transfer-bytes", "0"],
     "--max-transfer-bytes must be >= 1"),
])
def test_flags_that_do_not_go_with_the_role(argv, message):
    with pytest.raises(ValueError, match=message):
        roles.check_arguments(_args(*argv))


def test_a_prefill_worker_may_span_several_processes():
    roles.check_arguments(_args("--role", "prefill", "--coordinator", "h:1",
                                "--num-processes", "2", "--process-id", "1"))


@pytest.mark.parametrize("process", ["0", "1"])
def test_a_prefill_worker_over_several_processes_takes_the_prefix_cache(process):
    roles.check_arguments(_args("--role", "prefill", "--coordinator", "h:1",
                                "--num-processes", "2", "--process-id", process,
                                "--prefix-cache-hbm-mb", "8", "--prefix-cache-host-mb", "16"))


def test_a_decode_role_may_span_several_processes():
    roles.check_arguments(_args("--role", "decode", "--prefill-workers", "h:1",
                                "--coordinator", "h:1", "--num-processes", "2",
                                "--process-id", "1"))


def test_role_both_is_the_default():
    args = _args()
    assert args.role == "both"
    roles.check_arguments(args)


@pytest.mark.parametrize("text,message", [
    ("", "--prefill-workers is empty"),
    ("localhost", "'localhost' is not HOST:PORT"),
    ("h:0", "'h:0' is not HOST:PORT"),
    ("h:1,h:1", "names an address twice"),
])
def test_bad_worker_addresses(text, message):
    with pytest.raises(ValueError, match=message):
        parse_addresses(text)


def test_worker_addresses():
    assert parse_addresses("10.0.0.1:9000, host-b:9001,") == ["10.0.0.1:9000", "host-b:9001"]


def test_bytes_in_flight_wait_for_room_but_one_large_prefix_goes_alone():
    budget, stopping = BytesInFlight(100), threading.Event()
    assert budget.take(300, stopping, 0.01)  # nothing out: a prefix over the bound goes
    taken = threading.Event()
    t = threading.Thread(target=lambda: (budget.take(10, stopping, 0.01), taken.set()))
    t.start()
    assert not taken.wait(0.2)  # waits while the large one is out
    budget.give(300)
    assert taken.wait(10)
    t.join()
    assert (budget.used, budget.count) == (10, 1)
    stopping.set()
    assert budget.take(95, stopping, 0.01) is False  # would overflow, and stopping
    with pytest.raises(ValueError, match="max_bytes_in_flight must be >= 1"):
        BytesInFlight(0)
