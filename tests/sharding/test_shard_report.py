"""`jetserve shard-report`: specs per tensor, predicted bytes per device equal to measured."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from jetserve import cli

ARGS = ["shard-report", "--model", "random:tiny", "--hardware", "tpu-v5e",
        "--max-seq-len", "64", "--max-concurrent-decodes", "8"]


def _report(capsys, *extra) -> dict:
    assert cli.main([*ARGS, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def tp_kv_batch_report():
    """8 devices, random:tiny (4 heads, 2 kv heads): mesh data 4 x model 2, measured."""
    out = io.StringIO()  # a module fixture cannot use capsys
    with contextlib.redirect_stdout(out):
        assert cli.main([*ARGS, "--sharding", "tp_kv_batch", "--devices", "8", "--json"]) == 0
    return json.loads(out.getvalue())


def test_predicted_bytes_match_measured(tp_kv_batch_report):
    r = tp_kv_batch_report
    assert r["mesh"] == {"data": 4, "model": 2}
    assert len(r["per_device"]) == 8
    for d in r["per_device"]:
        for kind in ("param_bytes", "kv_cache_bytes"):
            measured = d[f"measured_{kind}"]
            assert measured is not None and measured > 0
            assert abs(d[kind] - measured) <= 0.05 * measured, (d["device"], kind)
    # Weights split over model (2) and copied over data; the cache split over all 8.
    assert r["per_device"][0]["kv_cache_bytes"] * 8 == r["kv_cache_bytes_total"]
    assert r["per_device"][0]["param_bytes"] < r["param_bytes_total"] / 1.9


def test_tensor_specs_and_floor(tp_kv_batch_report):
    r = tp_kv_batch_report
    t = {x["name"]: x for x in r["tensors"]}
    assert t["layers_0/self_attn/q_proj"]["spec"] == ["model", None, None]
    assert t["layers_0/mlp/down_proj"]["spec"] == [None, "model"]
    assert t["k/0"]["spec"] == ["data", "model", None, None]  # keys [B, K, H, S]
    assert t["k/0"]["shape"] == [8, 2, 16, 64]
    assert t["v/0"]["spec"] == ["data", "model", None, None]  # values [B, K, S, H]
    assert t["v/0"]["shape"] == [8, 2, 64, 16]
    assert t["k/0"]["bytes_per_device"] * 8 == t["k/0"]["bytes"]
    assert t["layers_0/input_layernorm"]["spec"] == [None]
    # Floor: the busiest device's parameters plus full cache, over v5e's 820 GB/s.
    busiest = max(d["param_bytes"] + d["kv_cache_bytes"] for d in r["per_device"])
    assert r["step_bytes_per_device"] == busiest
    assert r["decode_step_floor_s"] == pytest.approx(busiest / 8.2e11)
    assert r["hardware"]["name"] == "tpu-v5e"


def test_text_report_without_measuring(capsys):
    assert cli.main([*ARGS, "--sharding", "replicated", "--devices", "2", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "mesh {'data': 1, 'model': 2}" in out
    assert "embed_tokens" in out and "k/0" in out
    assert "100.0% of the bytes sharded" not in out and "0.0% of the bytes sharded" in out
    assert "decode step floor on tpu-v5e (820 GB/s)" in out


def test_sharding_from_a_yaml_path(capsys, tmp_path):
    path = tmp_path / "heads_only.yaml"
    path.write_text("mesh: {model: -1}\nrules: {heads: model, kv_heads: model}\n")
    r = _report(capsys, "--sharding", str(path), "--devices", "2", "--no-measure")
    assert r["sharding"] == "heads_only" and r["mesh"] == {"model": 2}
    t = {x["name"]: x for x in r["tensors"]}
    assert t["layers_0/self_attn/o_proj"]["spec"] == [None, "model", None]
    assert t["layers_0/mlp/up_proj"]["spec"] == [None, None]


@pytest.mark.parametrize("extra,message", [
    (["--sharding", "tp", "--devices", "16"], "--devices 16: only 8 cpu devices exist"),
    # (tp on 4 devices replicates random:tiny's 2 kv heads; 3 devices can do neither.)
    (["--sharding", "tp", "--devices", "3"],
     "parameter layers_0/self_attn/k_proj: dimension 0 (kv_heads) of size 2 does not divide "
     "over mesh axis 'model' of size 3 in sharding 'tp'"),
    (["--sharding", "no_such_preset"], "unknown sharding 'no_such_preset'"),
])
def test_errors_name_what_is_wrong(capsys, extra, message):
    assert cli.main([*ARGS, *extra, "--no-measure"]) == 2
    assert message in capsys.readouterr().err


def test_tp_past_the_kv_heads_shows_the_copies(capsys):
    """random:tiny (4 heads, 2 kv heads) under tp on 4 devices: each kv head on 2 of them;
    every device holds one head's k/v projections and cache, half of it a copy."""
    r = _report(capsys, "--sharding", "tp", "--devices", "4")
    rep = r["kv_head_replication"]
    assert (rep["copies"], rep["stored_kv_heads"], rep["kv_heads"]) == (2, 2, 4)
    assert rep["params"] == [f"layers_{i}/self_attn/{w}" for i in range(2)
                             for w in ("k_proj", "v_proj")]
    assert rep["kv_cache"] == ["k/0", "k/1", "v/0", "v/1"]
    t = {x["name"]: x for x in r["tensors"]}
    assert t["layers_0/self_attn/k_proj"]["shape"] == [4, 16, 64]  # [K', H, D]
    assert t["layers_0/self_attn/k_proj"]["spec"] == ["model", None, None]
    assert t["k/0"]["shape"] == [8, 4, 16, 64] and t["k/0"]["spec"][1] == "model"
    one_head = 16 * 64 * 4  # H x D f32: each device's share of one k/v projection
    cache = 8 * 16 * 64 * 4  # B x H x S f32: one head of one layer's keys
    assert t["layers_0/self_attn/k_proj"]["bytes_per_device"] == one_head
    assert rep["bytes_per_device"] == 4 * one_head + 4 * cache
    assert rep["copy_bytes_per_device"] == rep["bytes_per_device"] // 2
    # Measured on the devices as predicted: the loader repeated the heads in place.
    for d in r["per_device"]:
        assert d["measured_param_bytes"] == d["param_bytes"]
        assert d["measured_kv_cache_bytes"] == d["kv_cache_bytes"]
    assert cli.main([*ARGS, "--sharding", "tp", "--devices", "4", "--no-measure"]) == 0
    assert ("kv heads replicated: the model's 2 kv heads each held by 2 devices (4 run), in "
            "4 parameters and 4 cache tensors: 144.0 KiB per device, 72.0 KiB of it copies"
            in capsys.readouterr().out)


def test_no_copies_where_the_kv_heads_split(tp_kv_batch_report):
    rep = tp_kv_batch_report["kv_head_replication"]
    assert rep["copies"] == 1 and rep["params"] == [] and rep["bytes_per_device"] == 0
