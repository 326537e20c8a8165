"""LeaderWorkerSet's environment as --coordinator / --num-processes / --process-id:
flags win, a leader address without a port gets the default coordinator port, and a
partial environment is refused by name."""

import argparse

import pytest

from jetserve import distributed


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    distributed.add_arguments(p)
    return p.parse_args(list(argv))


LWS = {"LWS_LEADER_ADDRESS": "slice-0.slice.default", "LWS_GROUP_SIZE": "4",
       "LWS_WORKER_INDEX": "2"}


def test_the_environment_fills_what_flags_leave_out():
    args = _args()
    distributed.from_lws_environment(args, LWS)
    assert (args.coordinator, args.num_processes, args.process_id) == (
        f"slice-0.slice.default:{distributed.COORDINATOR_PORT}", 4, 2)
    args = _args()
    distributed.from_lws_environment(args, {**LWS, "LWS_LEADER_ADDRESS": "10.0.0.7:1234"})
    assert args.coordinator == "10.0.0.7:1234"


def test_flags_win_over_the_environment():
    args = _args("--coordinator", "127.0.0.1:999", "--process-id", "0")
    distributed.from_lws_environment(args, LWS)
    assert (args.coordinator, args.num_processes, args.process_id) == ("127.0.0.1:999", 4, 0)


def test_no_group_or_a_group_of_one_changes_nothing():
    for env in ({}, {**LWS, "LWS_GROUP_SIZE": "1"}):
        args = _args()
        distributed.from_lws_environment(args, env)
        assert (args.coordinator, args.num_processes, args.process_id) == (None, None, None)


def test_a_partial_or_bad_environment_is_refused_by_name():
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX is not"):
        distributed.from_lws_environment(_args(), {k: v for k, v in LWS.items()
                                                   if k != "LWS_WORKER_INDEX"})
    with pytest.raises(ValueError, match="LWS_GROUP_SIZE must be an integer, got 'four'"):
        distributed.from_lws_environment(_args(), {**LWS, "LWS_GROUP_SIZE": "four"})
