"""`jetserve bench serve` against the real servers of the session (random:tiny on 127.0.0.1)."""

import json

import pytest

from jetserve import cli
from jetserve.bench import serve


def _check(out, rates, n, output_len):
    assert [r["rate"] for r in out["rows"]] == rates
    assert out["cold_start"]["ttft_ms"] > 0
    for row in out["rows"]:
        assert row["requests"] == row["completed"] == n and row["failed"] == 0
        assert row["throughput_tok_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            p = row[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
        assert row["ttft_ms"]["p99"] <= row["e2e_ms"]["p99"]
    assert len(out["requests"]) == n * len(rates)
    for rec in out["requests"]:
        assert rec["ok"] and rec["output_tokens"] == output_len, rec
        assert rec["ttft_ms"] <= rec["e2e_ms"]


def test_grpc_sweep_json_and_plot(tiny_servers, tmp_path, capsys):
    path, png = tmp_path / "run.json", tmp_path / "run.png"
    rc = cli.main(["bench", "serve", "--url", f"grpc://127.0.0.1:{tiny_servers.grpc_port}",
                   "--rates", "inf,50", "--num-requests", "4", "--prompt-len", "8",
                   "--output-len", "6", "--shared-prefix", "4", "--max-total", "256",
                   "--slo", "ttft_ms=60000,tpot_ms=60000", "--out", str(path),
                   "--plot", str(png), "--warmup", "2"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.startswith("cold start: ")  # its own line, before the rates
    assert printed.splitlines()[1].startswith("warm-up: 2 requests")
    out = json.loads(path.read_text())
    _check(out, [float("inf"), 50.0], 4, 6)
    # Every request met the (generous) SLOs, so goodput equals the completed request rate.
    for row in out["rows"]:
        assert row["goodput_req_s"] == pytest.approx(row["request_throughput"], rel=1e-3)
    assert {r["prompt_len"] for r in out["requests"]} == {4 + 8}  # prefix + prompt
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_http_stream_counts_tokens(tiny_servers):
    out = serve.run(f"http://127.0.0.1:{tiny_servers.http_port}", [100.0],
                    serve.Workload(num_requests=3, prompt_len=5, output_len=7, lengths="fixed",
                                   max_total=256), slo={"tpot_ms": 1e-6}, log=lambda *a: None)
    _check(out, [100.0], 3, 7)
    assert out["rows"][0]["goodput_req_s"] == 0  # no request can meet a 1 ns TPOT


def test_bad_url_is_named(tiny_servers):
    with pytest.raises(ValueError, match="--url"):
        serve.make_client("tcp://127.0.0.1:1", None, "m")
