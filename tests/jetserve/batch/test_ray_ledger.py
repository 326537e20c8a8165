"""The ledger of a Ray batch job (plain Python, no Ray), the pool's settings, and what
`jetserve batch --ray` refuses before it starts anything (flags of the other ways to run
a job over hosts; Ray not installed)."""

import sys

import pytest

from jetserve import cli
from jetserve.batch.ray_job import RayPool, parse_resources
from jetserve.batch.ray_ledger import ALIVE_S, Ledger


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_first_attempt_runs_the_block_whole():
    led = Ledger()
    a = led.begin("b", ["k1", "k2"], "actor")
    assert (a.alone, a.done, a.poisoned) == (False, {}, {})
    led.finished("b", [("k1", "row1", 3), ("k2", "row2", 4)])
    led.end("b")
    assert led.status()["blocks_retried"] == 0
    # A block run again after it ended (Ray lost its output) is a fresh attempt.
    assert led.begin("b", ["k1", "k2"]).alone is False


def test_a_death_keeps_finished_rows_and_blames_the_unfinished_ones():
    led = Ledger()
    led.begin("b", ["k1", "k2", "k3"])
    led.finished("b", [("k1", "row1", 3)])
    # No end: the actor died. The next attempt runs the rest one at a time.
    a = led.begin("b", ["k1", "k2", "k3"])
    assert a.alone and a.done == {"k1": ("row1", 3)} and a.poisoned == {}
    led.started("b", "k2")
    led.finished("b", [("k2", "row2", 4)])
    led.started("b", "k3")
    # Died again, with k3 alone in the engine: k3 has killed two actors.
    a = led.begin("b", ["k1", "k2", "k3"])
    assert a.done == {"k1": ("row1", 3), "k2": ("row2", 4)} and a.poisoned == {"k3": 2}
    led.end("b")
    assert led.status()["blocks_retried"] == 2


def test_rows_that_ran_alone_and_finished_are_not_blamed():
    led = Ledger()
    led.begin("b", ["k1", "k2"])
    led.begin("b", ["k1", "k2"])  # first death: both blamed once
    led.started("b", "k1")
    led.finished("b", [("k1", "row1", 3)])
    a = led.begin("b", ["k1", "k2"])  # died between rows: nobody running alone
    assert a.poisoned == {} and a.done == {"k1": ("row1", 3)}


def test_heartbeats_count_actors_alive_and_restarts():
    clock = Clock()
    led = Ledger(clock=clock)
    led.heartbeat("a", 100, "n1")
    led.heartbeat("b", 200, "n1")
    led.begin("blk", ["k"], "a")
    st = led.status()
    assert (st["actors"], st["alive"], st["restarts"]) == (2, 2, 0)
    assert [(x["pid"], x["block"]) for x in st["busy"]] == [(100, "blk")]
    clock.t = ALIVE_S + 1
    led.heartbeat("a", 101, "n2")  # started again: a new process
    st = led.status()
    assert (st["actors"], st["alive"], st["restarts"], st["busy"]) == (2, 1, 1, [])
    led.begin("blk", ["k"], "a")  # its block again, on the new process
    clock.t += 2.5
    led.end("blk", "a")
    # From the first block's start to the last one's end: the engines' time.
    assert led.status()["engines_s"] == ALIVE_S + 3.5


def test_pool_settings():
    assert parse_resources("TPU=4, CPU=8") == {"TPU": 4.0, "CPU": 8.0}
    assert RayPool(resources={"CPU": 2, "GPU": 1, "TPU": 4}).remote_args() == {
        "num_cpus": 2, "num_gpus": 1, "resources": {"TPU": 4}}
    with pytest.raises(ValueError, match="NAME=NUMBER.*got 'TPU'"):
        parse_resources("TPU")
    with pytest.raises(ValueError, match="--ray-actors must be >= 1, got 0"):
        RayPool(actors=0)
    with pytest.raises(ValueError, match="--ray-block-rows must be >= 1"):
        RayPool(block_rows=0)


def test_without_ray_the_flag_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    rc = cli.main(["batch", "--ray", "--input", str(tmp_path / "in.jsonl"), "--output",
                   str(tmp_path / "out.jsonl")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--ray needs Ray Data" in err and "pip install 'jetserve[ray]'" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("extra, message", [
    (["--num-processes", "2", "--process-id", "0"],
     "--ray hands rows to actors itself: leave out --num-processes"),
    (["--coordinator", "127.0.0.1:1"], "leave out --coordinator"),
    (["--merge"], "--merge joins the parts of a run without --ray"),
    (["--retry-failed"], "--retry-failed continues a job: add --resume"),
    (["--ray-actors", "0"], "--ray-actors must be >= 1, got 0"),
    (["--ray-actor-resources", "TPU:4"], "--ray-actor-resources: expected NAME=NUMBER"),
])
def test_ray_refuses_what_it_cannot_do(extra, message, capsys, tmp_path):
    rc = cli.main(["batch", "--ray", "--input", str(tmp_path / "in.jsonl"), "--output",
                   str(tmp_path / "out.jsonl"), *extra])
    assert rc == 2
    assert message in capsys.readouterr().err
