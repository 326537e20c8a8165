#!/usr/bin/env bash
# Writes o200k_base.tiktoken, the vocabulary openai-harmony loads for gpt-oss (it would
# download it at first use), into DIR, from the npm package js-tiktoken (which ships the
# same ranks), and checks it against the SHA-256 openai-harmony expects. Then serve with
# TIKTOKEN_ENCODINGS_BASE=DIR. Needs npm and node.
set -euo pipefail
dir=${1:?usage: scripts/harmony_vocab.sh DIR}
mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent js-tiktoken@1.0.21 >/dev/null && tar xzf js-tiktoken-1.0.21.tgz)
node -e '
const ranks = require(process.argv[1]); const r = ranks.default || ranks;
const rows = [];
for (const line of r.bpe_ranks.split("\n").filter(Boolean)) {
  const [, offset, ...tokens] = line.split(" ");
  tokens.forEach((t, i) => rows.push([parseInt(offset, 10) + i, t]));
}
rows.sort((a, b) => a[0] - b[0]);
require("fs").writeFileSync(process.argv[2], rows.map(([k, t]) => `${t} ${k}\n`).join(""));
' "$work/package/dist/ranks/o200k_base.cjs" "$dir/o200k_base.tiktoken"
echo "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d  $dir/o200k_base.tiktoken" \
  | sha256sum -c --quiet
echo "wrote $dir/o200k_base.tiktoken; export TIKTOKEN_ENCODINGS_BASE=$dir"
