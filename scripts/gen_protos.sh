#!/usr/bin/env bash
# Regenerates protos/jetstream_pb2.py, jetstream_pb2_grpc.py and jetstream_pb2.pyi from
# protos/jetstream.proto. Usage: scripts/gen_protos.sh [OUT_DIR]  (default: the repo root,
# i.e. in place). Run from anywhere; needs grpcio-tools (the `test` extra).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
python="${PYTHON:-python}"
mkdir -p "$out/protos"
# -I at the repo root so the generated imports read `from protos import jetstream_pb2`.
cd "$root"
"$python" -m grpc_tools.protoc -I. \
  --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  protos/jetstream.proto
