"""`jetserve batch` scoring rows against transformers on the same random HF weights.

Each row's summed continuation log-likelihood equals the sum of transformers'
log-softmax at the continuation tokens to 1e-4, and `is_greedy` equals whether every
continuation token is transformers' argmax; rows whose continuation is transformers'
own greedy continuation are among them, so both answers occur.
"""

import json

import numpy as np
import torch

from jetserve import cli
from jetserve.batch.journal import read_rows

FAMILY = "llama"


def _hf_logp(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def test_scoring_rows_match_transformers(hf_dirs, tmp_path):
    d, model = hf_dirs[FAMILY]
    rng = np.random.default_rng(1)
    rows = []
    for i in range(8):
        ctx = rng.integers(3, 128, size=int(rng.integers(1, 30))).tolist()
        if i % 2:  # transformers' greedy continuation
            cont = []
            for _ in range(int(rng.integers(1, 6))):
                cont.append(int(_hf_logp(model, ctx + cont)[-1].argmax()))
        else:
            cont = rng.integers(3, 128, size=int(rng.integers(1, 10))).tolist()
        rows.append({"id": i, "context_ids": ctx, "continuation_ids": cont})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["batch", "--model", d, "--input", str(inp), "--output", str(out),
                     "--max-seq-len", "64", "--max-concurrent-decodes", "4", "--devices", "1",
                     "--dtype", "float32", "--no-progress"]) == 0
    got = {r["id"]: r for r in read_rows(str(out))}
    assert sorted(got) == list(range(8))
    greedy_seen = set()
    for r in rows:
        ids = r["context_ids"] + r["continuation_ids"]
        logp = _hf_logp(model, ids)
        k = len(r["context_ids"])
        want = sum(logp[t - 1, ids[t]] for t in range(k, len(ids)))
        want_greedy = all(logp[t - 1].argmax() == ids[t] for t in range(k, len(ids)))
        g = got[r["id"]]
        assert abs(g["logprob"] - want) < 1e-4, (r["id"], g["logprob"], want)
        assert g["is_greedy"] is want_greedy, r["id"]
        assert g["num_tokens"] == len(ids) - k
        greedy_seen.add(want_greedy)
    assert greedy_seen == {True, False}
