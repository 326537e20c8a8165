#!/usr/bin/env bash
# The benchmarks of docs/BENCHMARKS.md on an accelerator, in one command (under 8 minutes
# on one GPU): plan, decode against the floor (device memory probed in the same run),
# the orchestrator overhead, a cold and a warm start, long-prompt prefill, and a serving
# sweep against a real server.
#
#   scripts/device_bench.sh [OUT_DIR]          # default OUT_DIR: bench-<date>
#
# Needs jetserve installed with a JAX build for the accelerator (e.g. jax[cuda12]) and the
# `bench` extra. transformers on PyTorch CPU is no peer for a GPU, so compare-hf is not
# run here. Environment:
#   MODEL        model to run (default random:llama-156m)
#   DTYPE        bfloat16 (default) or float32
#   HARDWARE     `jetserve plan` preset of this accelerator (default h200)
#   SMALL=1      tiny sizes, to check the script itself on a CPU in a couple of minutes
set -euo pipefail

OUT=${1:-bench-$(date -u +%Y%m%dT%H%M%SZ)}
MODEL=${MODEL:-random:llama-156m}
DTYPE=${DTYPE:-bfloat16}
HARDWARE=${HARDWARE:-h200}
PY=${PYTHON:-python}
mkdir -p "$OUT"

if [[ "${SMALL:-0}" == 1 ]]; then
  MODEL=random:tiny DTYPE=float32
  BATCHES=1,4 CONTEXT=32 STEPS=4 READ_GB=0.05 MATMUL=256
  OVERHEAD_ARGS=(--batch 4 --steps 60 --repeats 2 --max-seq-len 128)
  SERVE_ARGS=(--max-concurrent-decodes 4 --max-seq-len 128)
  RATES=4,inf NREQ=6 PLEN=16 OLEN=8 MAXTOTAL=128
  PREFILL_LENGTHS=64,256
else
  BATCHES=1,8,32,128 CONTEXT=192 STEPS=50 READ_GB=2 MATMUL=4096
  OVERHEAD_ARGS=(--batch 8 --steps 100 --repeats 5)
  SERVE_ARGS=(--max-concurrent-decodes 64 --max-seq-len 1024)
  RATES=4,16,64,inf NREQ=128 PLEN=128 OLEN=128 MAXTOTAL=1024
  PREFILL_LENGTHS=1024,4096,16384
fi

log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/log.txt" >&2; }
run() { log "$*"; timeout "${STEP_TIMEOUT:-150}" "$@" 2>>"$OUT/stderr.txt" | tee -a "$OUT/log.txt"; }

log "device_bench: model $MODEL, dtype $DTYPE, out $OUT"
{ date -u; uname -a; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
    || echo "no nvidia-smi"; "$PY" -c "import jax; print(jax.__version__, jax.devices())"; } \
  > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | tee -a "$OUT/log.txt"

run "$PY" -m jetserve plan --model "$MODEL" --hardware "$HARDWARE" --batch "$BATCHES" \
  --context "$CONTEXT" --json > "$OUT/plan.json"

run "$PY" -m jetserve bench decode --model "$MODEL" --dtype "$DTYPE" --batch "$BATCHES" \
  --context "$CONTEXT" --steps "$STEPS" --read-gb "$READ_GB" --matmul-size "$MATMUL" --json \
  > "$OUT/decode.json"

run "$PY" -m jetserve.bench.orchestrator_overhead --model "$MODEL" "${OVERHEAD_ARGS[@]}" --json \
  > "$OUT/overhead.txt"

# Process start to first token with a cold compile cache, then a warm one (the same dir).
run "$PY" -m jetserve bench startup --model "$MODEL" --json > "$OUT/startup.json"

# Long-prompt prefill with the attention the engine picks here (cuDNN on a GPU, splash on
# a TPU) and with the XLA blockwise path.
run "$PY" -m jetserve bench prefill --model "$MODEL" --lengths "$PREFILL_LENGTHS" --json \
  > "$OUT/prefill.json"
run "$PY" -m jetserve bench prefill --model "$MODEL" --lengths "$PREFILL_LENGTHS" \
  --attention xla --json > "$OUT/prefill_xla.json"

# A real server on a free port; the sweep's cold-start line includes its start and compile.
PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
log "serve --model $MODEL on 127.0.0.1:$PORT"
"$PY" -m jetserve serve --model "$MODEL" --dtype "$DTYPE" --host 127.0.0.1 --grpc-port "$PORT" \
  --http-port -1 "${SERVE_ARGS[@]}" > "$OUT/server.txt" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
run "$PY" -m jetserve bench serve --url "grpc://127.0.0.1:$PORT" --rates "$RATES" \
  --num-requests "$NREQ" --prompt-len "$PLEN" --output-len "$OLEN" --max-total "$MAXTOTAL" \
  --vocab 256 --label "$MODEL interleaved" --out "$OUT/serve.json" --plot "$OUT/serve.png"
kill "$SERVER"
wait "$SERVER" || true
trap - EXIT

log "done: $OUT (plan.json decode.json overhead.txt startup.json prefill.json prefill_xla.json serve.json serve.png log.txt)"
