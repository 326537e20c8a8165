"""Long prompts against Hugging Face transformers (float32), through the blockwise prefill
attention: a 4,096-token prompt on a tiny Llama, and a Mistral whose prompt is five
times its sliding window. The prompt is prefilled in chunks (each continuing the last
one's prefix, as `--prefill-chunk` does), then decoded greedily; the logits of a whole
prompt are compared position by position."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from engines import EngineConfig, create_engine, load_hf_config
from engines.kv_cache import PrefillKV
from tests.parity.hf_models import TINY

STEPS = 8
CHUNK = 1024


def _hf_model(family, out_dir, **extra):
    import transformers as tf

    cls_cfg, cls_model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[family]
    cfg = cls_cfg(**dict(TINY, max_position_embeddings=8192, **extra))
    torch.manual_seed(0)
    model = cls_model(cfg).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if p.dim() < 2 else 0.08)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def _chunked_greedy(engine, params, prompt, steps):
    prefix = None
    for start in range(0, len(prompt), CHUNK):
        piece = prompt[start:start + CHUNK]
        prefix, res = engine.prefill(params, piece, len(piece), existing_prefix=prefix)
    tokens = [res.to_host().token(0)]
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    for _ in range(steps - 1):
        state, res = engine.generate(params, state)
        tokens.append(res.to_host().token(0))
    return tokens


def _check(model_dir, model, length):
    prompt = np.random.default_rng(1).integers(3, TINY["vocab_size"], length).tolist()
    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=CHUNK,
                       max_seq_len=length + STEPS, top_logprobs=0)
    engine = create_engine(load_hf_config(model_dir), weights=model_dir, config=cfg)
    params = engine.load_params()
    ours = _chunked_greedy(engine, params, prompt, STEPS)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
        ref = model(torch.tensor([prompt])).logits[0].numpy()
    assert ours == out[0, length:].tolist()
    # The whole prompt at once (positions 0..T-1 against themselves) through the model.
    pos = jnp.arange(length)[None]
    logits = engine.model.apply({"params": params}, jnp.asarray([prompt], jnp.int32), pos,
                                PrefillKV(pos, None))[0]
    err = np.max(np.abs(np.asarray(logits) - ref)) / np.max(np.abs(ref))
    assert err < 1e-4


def test_llama_4096_token_prompt(tmp_path):
    _check(str(tmp_path), _hf_model("llama", str(tmp_path)), 4096)


def test_mistral_prompt_five_times_the_sliding_window(tmp_path):
    window = 512
    model = _hf_model("mistral", str(tmp_path), sliding_window=window)
    assert load_hf_config(str(tmp_path)).sliding_window == window
    _check(str(tmp_path), model, 5 * window)



def test_prompt_scoring_of_2000_tokens(tmp_path):
    """Echo scoring (log p of each prompt token given those before it) over one
    2,048-token bucket: the blockwise path against transformers' log-softmax."""
    model = _hf_model("llama", str(tmp_path))
    prompt = np.random.default_rng(2).integers(3, TINY["vocab_size"], 2000).tolist()
    cfg = EngineConfig(max_concurrent_decodes=1, max_prefill_length=2048, max_seq_len=2048,
                       top_logprobs=2)
    engine = create_engine(load_hf_config(str(tmp_path)), weights=str(tmp_path), config=cfg)
    scored = engine.prompt_logprobs(engine.load_params(), prompt)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
    want = [logp[t - 1, prompt[t]] for t in range(1, len(prompt))]
    np.testing.assert_allclose(scored.token_logprobs[1:], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(scored.greedy[1:], logp.argmax(-1)[:-1])
