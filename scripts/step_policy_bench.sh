#!/usr/bin/env bash
# Step policies back to back: `jetserve bench serve` against one interleaved
# `jetserve serve` per policy, the same load each time (issue 26's: fixed-length prompts
# at one Poisson rate, SLO TTFT 1 s / TPOT 100 ms), then one plot of all of them.
#
#   scripts/step_policy_bench.sh OUT_DIR
#
# 8 slots, 128-token prompts, 64 new tokens, 8 warm-up requests. Environment: MODEL
# (default random:llama-156m), RATES (default 4), NREQ (requests per rate, default 24),
# BUDGET (--max-num-batched-tokens of the third run, default 72: 64-token chunks beside 8
# decode tokens).
set -euo pipefail

OUT=${1:?usage: scripts/step_policy_bench.sh OUT_DIR}
MODEL=${MODEL:-random:llama-156m} RATES=${RATES:-4} NREQ=${NREQ:-24} BUDGET=${BUDGET:-72}
PY=${PYTHON:-python}
mkdir -p "$OUT"

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

run() {  # NAME, then the serve flags of that policy
  local name=$1 port
  shift
  port=$(free_port)
  "$PY" -m jetserve serve --model "$MODEL" --interleaved --host 127.0.0.1 \
    --grpc-port "$port" --http-port -1 --max-concurrent-decodes 8 --max-seq-len 256 \
    "$@" > "$OUT/server_$name.txt" 2>&1 &
  local server=$!
  "$PY" -m jetserve bench serve --url "grpc://127.0.0.1:$port" --rates "$RATES" \
    --num-requests "$NREQ" --lengths fixed --prompt-len 128 --output-len 64 \
    --max-total 256 --warmup 8 --slo ttft_ms=1000,tpot_ms=100 --label "$name" \
    --out "$OUT/$name.json" | tee "$OUT/$name.txt" || { kill "$server"; exit 1; }
  kill "$server"
  wait "$server" || true
}

run prefill-first --step-policy prefill-first
run decode-first --step-policy decode-first
run "decode-first-$BUDGET" --step-policy decode-first --max-num-batched-tokens "$BUDGET"
"$PY" -m jetserve bench plot "$OUT"/prefill-first.json "$OUT"/decode-first.json \
  "$OUT/decode-first-$BUDGET.json" --out "$OUT/step_policy.png"
