"""Several prompts in one prefill call (EngineConfig.prefill_batch, engines/prefill_program.py
PrefillRows) against Hugging Face transformers: each prompt's row, inserted into its slot
and decoded, gives transformers' greedy tokens for that prompt alone.

Three families cover what attention and sampling see differently: llama3 (rope scaling,
tied embeddings), mistral (a sliding window of 16: the longest prompt fills it) and gemma
(head dim 24, its norms and activation). Prompts of unlike lengths share a call, so each
row's padding differs; three prompts run as four rows (one padding row).
"""

import numpy as np
import pytest

from engines import EngineConfig, create_engine, load_hf_config
from tests.parity.hf_models import hf_greedy

FAMILIES = ("llama3", "mistral", "gemma")
MAX_TOKENS = 8


@pytest.mark.parametrize("lengths", [(12, 5, 16, 9), (7, 16, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_rows_equal_transformers(hf_dirs, family, lengths):
    d, model = hf_dirs[family]
    eng = create_engine(load_hf_config(d), weights=d, config=EngineConfig(
        max_concurrent_decodes=4, max_prefill_length=64, max_seq_len=64, prefill_batch=4))
    params = eng.load_params()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in lengths]
    prefixes, first = eng.prefill_rows(params, prompts, samplings=[None] * len(prompts))
    host = first.to_host()
    out = [[host.tokens(row)[0]] for row in range(len(prompts))]
    state = eng.init_decode_state()
    for slot, prefix in enumerate(prefixes):
        state = eng.insert(prefix, state, slot)
    for _ in range(MAX_TOKENS - 1):
        state, res = eng.generate(params, state)
        step = res.to_host()
        for slot in range(len(prompts)):
            out[slot].append(step.tokens(slot)[0])
    assert out == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
