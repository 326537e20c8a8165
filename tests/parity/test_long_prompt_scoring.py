"""Echo scoring of a 2,000-token prompt, past the prefill bucket: the engine scores it in
chunks (each over the KV of the ones before), and the log-prob of every prompt token
equals transformers' one pass over the whole prompt."""

import numpy as np
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from tests.parity.hf_models import make_hf_model

N = 2000


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("long_llama"))
    return d, make_hf_model("llama", d, max_position_embeddings=2048)


def test_echo_scores_of_a_2000_token_prompt_match_transformers(llama):
    d, model = llama
    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=256, max_seq_len=2048,
                       top_logprobs=1)
    eng = create_engine(load_hf_config(d), weights=d, config=cfg)
    prompt = np.random.default_rng(0).integers(3, 128, size=N).tolist()
    pl = eng.prompt_logprobs(eng.load_params(), prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
    want = [logp[t - 1, prompt[t]] for t in range(1, N)]
    assert len(pl.token_logprobs) == N and np.isnan(pl.token_logprobs[0])
    np.testing.assert_allclose(pl.token_logprobs[1:], want, rtol=1e-4, atol=1e-4)
    # Every position is checked, chunk boundaries (multiples of 256) included.
    np.testing.assert_array_equal(pl.greedy[1:], logp.argmax(-1)[:-1])
