"""`jetserve generate` under every preset gives one device's greedy tokens for any number
of prompts: the slot count it derives from the prompts is rounded up to what the preset
splits the slots by (tp_kv_batch splits them over `data`), and the extra slots stay idle."""

from __future__ import annotations

import json

import pytest

from jetserve import cli
from sharding import PRESETS

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 30], [40, 41, 42], [7, 1, 2, 9], [250, 3]]
ARGS = ["--model", "random:tiny", "--max-tokens", "12", "--ignore-eos", "--json",
        "--max-seq-len", "64", "--max-prefill-length", "16"]


def _generate(capsys, prompts, *extra) -> list[list[int]]:
    ids = [a for p in prompts for a in ("--prompt-ids", ",".join(map(str, p)))]
    assert cli.main(["generate", *ARGS, *ids, *extra]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [r["prompt_ids"] for r in rows] == prompts
    return [r["token_ids"] for r in rows]


_ONE_DEVICE: dict[int, list[list[int]]] = {}


def _one_device(capsys, count: int) -> list[list[int]]:
    """Greedy tokens of the first `count` prompts on one device, computed once per count."""
    if count not in _ONE_DEVICE:
        _ONE_DEVICE[count] = _generate(capsys, PROMPTS[:count], "--devices", "1")
    return _ONE_DEVICE[count]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("count", [1, 3, 5])
def test_any_prompt_count_under_every_preset(preset, count, capsys):
    want = _one_device(capsys, count)
    got = _generate(capsys, PROMPTS[:count], "--devices", "4", "--sharding", preset)
    assert got == want
    assert all(len(t) == 12 for t in got)


def test_tp_kv_batch_three_prompts_on_eight_devices(capsys):
    """8 devices and 2 kv heads: the slots split 4 ways, so 3 prompts take 4 slots."""
    assert (_generate(capsys, PROMPTS[:3], "--devices", "8", "--sharding", "tp_kv_batch")
            == _one_device(capsys, 3))
