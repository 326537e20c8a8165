"""Mixed steps (engines/mixed_step.py) against Hugging Face transformers: prompts
prefilled in chunks beside decoding rows give transformers' greedy tokens.

Three families cover what attention sees differently: llama3 (rope scaling, tied
embeddings), mistral (a sliding window of 16, shorter than the prompts, so chunks and
decode tokens attend through it) and gemma (head dim 24, its norms and activation);
the prefill / insert / generate path is checked for every family in
test_transformers_parity.py, and the mixed step against that path in
tests/engines/test_mixed_step.py. Prompts arrive two steps apart into three slots, so
most steps are mixed. Both layer modes run: the unrolled loop and one scanned body with
the page pools stacked (EngineConfig.layers, engines/layer_scan.py).
"""

import numpy as np
import pytest

from engines import EngineConfig, create_engine, load_hf_config
from tests.engines.mixed_driver import run_mixed
from tests.parity.hf_models import hf_greedy

FAMILIES = ("llama3", "mistral", "gemma")
PROMPT_LENGTHS = (30, 7, 19, 12, 25)
MAX_TOKENS = 10


@pytest.mark.parametrize("layers", ["loop", "scan"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_steps_equal_transformers(hf_dirs, family, layers):
    d, model = hf_dirs[family]
    cfg = EngineConfig(max_concurrent_decodes=3, max_prefill_length=16, max_seq_len=48,
                       kv_layout="paged", page_size=16, layers=layers)
    eng = create_engine(load_hf_config(d), weights=d, config=cfg)
    assert eng.model_config.scan_layers == (layers == "scan")
    params = eng.load_params()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]
    run = run_mixed(eng, params, prompts, max_tokens=MAX_TOKENS, chunk=6, budget=9,
                    widest=True)
    assert run.mixed_steps >= 5
    assert run.outputs == [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
