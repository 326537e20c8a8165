#!/usr/bin/env bash
# Scheduling modes back to back: `jetserve bench serve` against one `jetserve serve` per
# mode, the same load each time (issue 26's: 8 slots, fixed 128-token prompts, 128 new
# tokens, Poisson arrivals at each rate, SLO TTFT 1 s / TPOT 100 ms), with the load
# average before and after each run, then one plot of both.
#
#   scripts/mixed_serve_bench.sh OUT_DIR
#
# Both modes on the same paged KV (pages of 64, --max-seq-len 320: 5 pages a sequence)
# and one 128-token prefill bucket, so they differ only in --scheduling: turns (prefill,
# insert and generate calls) or mixed (decode rows and prompt chunks in one step).
# Environment: MODEL (default random:llama-156m), RATES (default 2,4,8,inf), NREQ
# (requests per rate, default 32), MODES (default "turns mixed").
set -euo pipefail

OUT=${1:?usage: scripts/mixed_serve_bench.sh OUT_DIR}
MODEL=${MODEL:-random:llama-156m} RATES=${RATES:-2,4,8,inf} NREQ=${NREQ:-32}
MODES=${MODES:-turns mixed}
PY=${PYTHON:-python}
mkdir -p "$OUT"

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

run() {  # MODE
  local mode=$1 port
  port=$(free_port)
  "$PY" -m jetserve serve --model "$MODEL" --interleaved --host 127.0.0.1 \
    --grpc-port "$port" --http-port -1 --max-concurrent-decodes 8 --max-seq-len 320 \
    --max-prefill-length 128 --kv-layout paged --page-size 64 --scheduling "$mode" \
    > "$OUT/server_$mode.txt" 2>&1 &
  local server=$!
  echo "$mode: load before $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/load_$mode.txt"
  "$PY" -m jetserve bench serve --url "grpc://127.0.0.1:$port" --rates "$RATES" \
    --num-requests "$NREQ" --lengths fixed --prompt-len 128 --output-len 128 \
    --max-total 320 --warmup 8 --slo ttft_ms=1000,tpot_ms=100 --label "$mode" \
    --ready-timeout 1200 --out "$OUT/$mode.json" | tee "$OUT/$mode.txt" \
    || { kill "$server"; exit 1; }
  echo "$mode: load after $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load_$mode.txt"
  kill "$server"
  wait "$server" || true
}

for mode in $MODES; do
  run "$mode"
done
# shellcheck disable=SC2046
"$PY" -m jetserve bench plot $(for m in $MODES; do echo "$OUT/$m.json"; done) \
  --out "$OUT/mixed_serve.png"
