"""Scoring rows tokenize as lm-eval's `loglikelihood` does, checked against lm-eval's own
code path (its local-completions model with the Hugging Face tokenizer of the bundled
model): the same context and continuation ids for every row, BOS or not."""

import pytest

from jetserve.batch.rows import RowError, build_job
from jetserve.model_loading import BUNDLED_DIR
from jetserve.server.validation import ModelLimits
from jetserve.tokenizer import load_tokenizer

# Seams where the context's last token and the continuation's first could merge, or
# where whitespace ends the context.
PAIRS = [("def f(x):\n", "    return x"), ("x = foo", "bar()"), ("if a ==", " b:"),
         ("sys.", "__eq__ ="), ("class A:\n    def", " __init__(self):"),
         ("print('東", "京')"), ("a\n\n", "\n    b"), ("return self.", "_x"),
         ("import o", "s"), ("", "import os"), ("x = 1 ", " + 2"), ("    # a", "bc  ")]


def _lm_eval_encodings(add_bos_token: bool) -> list[tuple[list[int], list[int]]]:
    """(context_enc, continuation_enc) lm-eval's loglikelihood hands to the server."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url="http://127.0.0.1:9/v1/completions", model="bundled",
                             tokenizer=BUNDLED_DIR, tokenizer_backend="huggingface",
                             add_bos_token=add_bos_token)
    seen = []

    def capture(requests, disable_tqdm=False):  # instead of calling a server
        seen.extend((ctx, cont) for _, ctx, cont in requests)
        return [(0.0, True)] * len(requests)

    lm._loglikelihood_tokens = capture
    lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0)
                      for pair in PAIRS], disable_tqdm=True)
    return seen


@pytest.mark.parametrize("add_bos", [False, True])
def test_text_rows_split_as_lm_eval_loglikelihood(add_bos):
    pytest.importorskip("lm_eval")
    tok = load_tokenizer(BUNDLED_DIR)
    limits = ModelLimits(vocab_size=tok.vocab_size, max_prefill_length=256, max_seq_len=512,
                         bos_id=tok.bos_id, eos_ids=tuple(tok.eos_ids), top_logprobs=1,
                         tokenizer=tok)
    want = _lm_eval_encodings(add_bos)
    merged = 0
    for (context, continuation), (w_ctx, w_cont) in zip(PAIRS, want, strict=True):
        row = {"id": 0, "context": context, "continuation": continuation, "add_bos": add_bos}
        if not w_cont:  # "import o" + "s": lm-eval scores no token at all; we refuse
            with pytest.raises(RowError, match="adds no token after the context"):
                build_job(row, limits, default_max_tokens=1)
            continue
        j = build_job(row, limits, default_max_tokens=1)
        ids = list(j.request.prompt_ids)
        assert (ids[:j.context_len], ids[j.context_len:]) == (w_ctx, w_cont), (context,
                                                                               continuation)
        separate = tok.encode(continuation.lstrip(" ") if context.endswith(" ") else
                              continuation, add_bos=False)
        merged += ids[j.context_len:] != separate
    assert merged  # some seams do tokenize differently whole than apart
