#!/usr/bin/env bash
# Serving curve: `jetserve bench serve` over a sweep of request rates against a real
# server, once interleaved (prefill and generate on one engine) and once disaggregated
# (prefill on device 0, generate on device 1), then one plot of both.
#
#   scripts/serve_curve.sh OUT_DIR
#
# Environment: MODEL (default random:small), RATES (default 1,2,4,8), NREQ (requests per
# rate, default 32), PLEN / OLEN (median prompt / output tokens, default 64 / 64), LENGTHS
# (fixed or synthetic, default synthetic), SLOTS (default 8), WARMUP (requests sent
# before the sweep and not counted, default 16). On a CPU the two "devices"
# of the disaggregated server are fake XLA host devices sharing the same cores.
set -euo pipefail

OUT=${1:?usage: scripts/serve_curve.sh OUT_DIR}
MODEL=${MODEL:-random:small}
RATES=${RATES:-1,2,4,8}
NREQ=${NREQ:-32}
PLEN=${PLEN:-64}
OLEN=${OLEN:-64}
LENGTHS=${LENGTHS:-synthetic}
SLOTS=${SLOTS:-8}
WARMUP=${WARMUP:-16}
PY=${PYTHON:-python}
mkdir -p "$OUT"

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

curve() {  # NAME, then the serve flags of that mode
  local name=$1 port
  shift
  port=$(free_port)
  XLA_FLAGS=--xla_force_host_platform_device_count=2 "$PY" -m jetserve serve --model "$MODEL" \
    --host 127.0.0.1 --grpc-port "$port" --http-port -1 --max-concurrent-decodes "$SLOTS" \
    --max-seq-len 1024 "$@" > "$OUT/server_$name.txt" 2>&1 &
  local server=$!
  "$PY" -m jetserve bench serve --url "grpc://127.0.0.1:$port" --rates "$RATES" \
    --num-requests "$NREQ" --lengths "$LENGTHS" --prompt-len "$PLEN" --output-len "$OLEN" \
    --max-total 1024 --warmup "$WARMUP" --label "$name" --out "$OUT/$name.json" | tee "$OUT/$name.txt" \
    || { kill "$server"; exit 1; }
  kill "$server"
  wait "$server" || true
}

curve interleaved --interleaved
curve disaggregated --prefill-devices 1 --generate-devices 1
"$PY" -m jetserve bench plot "$OUT/interleaved.json" "$OUT/disaggregated.json" \
  --out "$OUT/serve_curve.png"
