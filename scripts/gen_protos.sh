#!/usr/bin/env bash
# Regenerates protos/*_pb2.py, *_pb2_grpc.py and *_pb2.pyi from protos/jetstream.proto and
# protos/prefill_worker.proto. Usage: scripts/gen_protos.sh [OUT_DIR]  (default: the repo
# root, i.e. in place). Run from anywhere; needs grpcio-tools (the `test` extra).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/protos"
# -I at the repo root so the generated imports read `from protos import jetstream_pb2`.
cd "$root"
for proto in protos/jetstream.proto protos/prefill_worker.proto; do
  "$python" -m grpc_tools.protoc -I. \
    --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" "$proto"
done
