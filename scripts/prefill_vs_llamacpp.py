"""Prefill tokens/s of jetserve against llama.cpp's llama-bench, same weights, same run.

Issue 20 asks for prefill at 8,192 tokens to reach half the compute floor, with llama.cpp
measured beside it. This runs, back to back and alternating for `--rounds` rounds:

  - `jetserve bench prefill --model HF_DIR --lengths N --json` (its own process per
    length; its row carries tokens/s, the compute floor and the matmul FLOP/s it measured);
  - `llama-bench -m GGUF -p N -n 0 -t THREADS -r 1 -o json` on the f32 GGUF of the same
    weights;

and, before each round, a one-thread-per-core matmul FLOP/s and memory read-bandwidth
probe (jetserve.bench.bandwidth) so a loaded machine shows in the figures. It prints the
best tokens/s of each engine, their ratio, and the fraction of the compute floor each
reaches (the floor is jetserve's: matmul plus attention FLOPs over jetserve's measured f32
matmul FLOP/s; llama.cpp does the same FLOPs but for the LM head, which it runs for the
last token only, a 0.1% difference at 8k).

`--make-gguf LLAMA_CPP_DIR` first writes the inputs: a random HF Llama of `--preset`
(`jetserve bench make-hf-model`) in --hf-dir, converted to an f32 GGUF at --gguf by that
llama.cpp checkout's convert_hf_to_gguf.py. The random checkpoint has no tokenizer, which
the converter needs, so it gets a placeholder SentencePiece-style vocabulary of the
model's size (unknown, bos, eos, the 256 byte tokens, then numbered tokens); llama-bench
draws random token ids and never tokenizes text, so the vocabulary's content is moot.

    python scripts/prefill_vs_llamacpp.py --llama-bench /tmp/lcp/.../build/bin/llama-bench \
        --gguf /tmp/m.gguf --hf-dir /tmp/m-hf --length 8192 [--make-gguf LLAMA_CPP_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

_CONVERT = textwrap.dedent("""
    import sys
    import gguf
    from conversion.llama import LlamaModel

    def set_vocab(self):  # the random checkpoint has no tokenizer: a placeholder one
        n = self.hparams["vocab_size"]
        tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{i:02X}>".encode() for i in range(256)]
        tokens += [f"<t{i}>".encode() for i in range(len(tokens), n)]
        T = gguf.TokenType
        types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
        types += [T.NORMAL] * (n - len(types))
        w = self.gguf_writer
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens[:n])
        w.add_token_scores([0.0] * n)
        w.add_token_types(types[:n])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    LlamaModel.set_vocab = set_vocab
    import convert_hf_to_gguf
    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
    convert_hf_to_gguf.main()
""")


def make_gguf(llama_cpp_dir: str, preset: str, hf_dir: str, gguf_path: str, *,
              python: str = sys.executable) -> None:
    """Writes the random HF checkpoint and its f32 GGUF (see the module docstring).

    `python` runs the converter: it needs torch, transformers and numpy, which a separate
    venv (scripts/peer_bench.sh's) may hold rather than jetserve's.
    """
    if not os.path.isfile(os.path.join(llama_cpp_dir, "convert_hf_to_gguf.py")):
        raise SystemExit(f"--make-gguf {llama_cpp_dir!r} has no convert_hf_to_gguf.py")
    subprocess.run([sys.executable, "-m", "jetserve", "bench", "make-hf-model",
                    "--preset", preset, "--out", hf_dir], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(llama_cpp_dir, "gguf-py"), llama_cpp_dir]))
    subprocess.run([python, "-c", _CONVERT, hf_dir, "--outtype", "f32",
                    "--outfile", gguf_path], check=True, env=env)


def run_jetserve(hf_dir: str, length: int, timeout_s: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "jetserve", "bench", "prefill", "--model", hf_dir,
                          "--lengths", str(length), "--json"],
                         capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"jetserve bench prefill failed ({out.returncode}): "
                           f"{out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["rows"][0]


def run_llama_bench(binary: str, gguf_path: str, length: int, threads: int,
                    timeout_s: float) -> dict:
    cmd = [binary, "-m", gguf_path, "-p", str(length), "-n", "0", "-t", str(threads),
           "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    rows = [r for r in json.loads(out.stdout) if r["n_prompt"] == length]
    return {"tokens_per_s": rows[0]["avg_ts"], "n_threads": rows[0]["n_threads"],
            "n_batch": rows[0]["n_batch"], "n_ubatch": rows[0]["n_ubatch"],
            "type_k": rows[0]["type_k"], "build": rows[0].get("build_commit")}


def probe() -> dict:
    """Machine state beside the runs: f32 matmul FLOP/s (XLA) and read bandwidth."""
    from jetserve.bench.bandwidth import matmul_flops, stream_read_bandwidth

    return {"matmul_gflops": round(matmul_flops("float32", size=1024) / 1e9, 1),
            "read_gbps": round(stream_read_bandwidth().gbps, 1),
            "load_1min": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-bench", required=True, help="path of a built llama-bench")
    p.add_argument("--gguf", required=True, help="f32 GGUF of the --hf-dir weights")
    p.add_argument("--hf-dir", required=True, help="HF directory jetserve loads")
    p.add_argument("--length", type=int, default=8192, help="prompt tokens")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both engines")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama-bench -t (jetserve's XLA uses every core)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    p.add_argument("--make-gguf", metavar="LLAMA_CPP_DIR",
                   help="first write --hf-dir (random --preset) and convert it to --gguf")
    p.add_argument("--preset", default="llama-156m", help="random:NAME shape for --make-gguf")
    a = p.parse_args(argv)
    if a.length < 2:
        p.error(f"--length must be >= 2, got {a.length}")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.make_gguf:
        make_gguf(a.make_gguf, a.preset, a.hf_dir, a.gguf)
    for path, flag in ((a.llama_bench, "--llama-bench"), (a.gguf, "--gguf"),
                       (os.path.join(a.hf_dir, "config.json"), "--hf-dir")):
        if not os.path.isfile(path):
            p.error(f"{flag}: {path!r} does not exist")
    rounds = []
    for r in range(a.rounds):
        row = {"probe": probe()}
        order = ("jetserve", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "jetserve")
        for name in order:
            row[name] = (run_jetserve(a.hf_dir, a.length, a.timeout_s) if name == "jetserve"
                         else run_llama_bench(a.llama_bench, a.gguf, a.length, a.threads,
                                              a.timeout_s))
            print(f"round {r + 1} {name}: {row[name]['tokens_per_s']:.1f} tokens/s", flush=True)
        rounds.append(row)
    js = max((x["jetserve"] for x in rounds), key=lambda x: x["tokens_per_s"])
    lc = max((x["llama.cpp"] for x in rounds), key=lambda x: x["tokens_per_s"])
    floor_tps = a.length / js["floor_s"]  # tokens/s at the compute floor
    summary = {"length": a.length, "jetserve_tokens_per_s": js["tokens_per_s"],
               "llamacpp_tokens_per_s": round(lc["tokens_per_s"], 1),
               "ratio_jetserve_over_llamacpp": round(js["tokens_per_s"] / lc["tokens_per_s"], 3),
               "floor_tokens_per_s": round(floor_tps, 1),
               "jetserve_fraction_of_floor": round(js["tokens_per_s"] / floor_tps, 3),
               "llamacpp_fraction_of_floor": round(lc["tokens_per_s"] / floor_tps, 3)}
    print(json.dumps({"rounds": rounds, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
