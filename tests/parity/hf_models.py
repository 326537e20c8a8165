"""Small random-weight Hugging Face models, one per family, written with save_pretrained."""

from __future__ import annotations

import os

import numpy as np

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2)

FAMILY_CONFIGS = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "llama3": dict(rope_theta=500000.0, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=16),
    "qwen2": dict(tie_word_embeddings=False),
    "gemma": dict(head_dim=24, hidden_activation="gelu_pytorch_tanh"),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}

FAMILIES = tuple(FAMILY_CONFIGS)

# Today's dense families (tests/parity/test_dense_families.py), odd shapes: head_dim
# apart from D / N, kv heads that are not a power of two, windows shorter than the
# prompts, several layer patterns, scaled and partial RoPE.
DENSE_CONFIGS = {
    "qwen3": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=24,
                            num_hidden_layers=3, tie_word_embeddings=False)),
    "qwen3_yarn": ("qwen3", dict(head_dim=24, max_position_embeddings=128, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32})),
    "gemma2": ("gemma2", dict(head_dim=32, num_hidden_layers=3, sliding_window=8,
                              query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                              final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(
        head_dim=24, num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": 10000.0}})),
    "olmo2": ("olmo2", dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96,
                            intermediate_size=192, vocab_size=132)),
    # LongRoPE: sequences here stay within original_max_position_embeddings (short
    # factors); the long factors are checked against transformers' rotary embedding in
    # tests/parity/test_dense_families.py.
    "phi3": ("phi3", dict(partial_rotary_factor=0.5, max_position_embeddings=512, pad_token_id=0,
                          original_max_position_embeddings=128, rope_parameters={
                              "rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": [1.0, 1.5, 2.0, 3.0],
                              "long_factor": [2.0, 4.0, 8.0, 16.0],
                              "original_max_position_embeddings": 128})),
}


# Today's MoE families (tests/parity/test_moe_families.py): Qwen3-MoE with dense layers
# among the expert ones (mlp_only_layers, decoder_sparse_step) and renormalised top-k, and
# with every layer routed and the top-k weights as the softmax gives them.
MOE_CONFIGS = {
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=48, decoder_sparse_step=2,
                                    mlp_only_layers=[3], norm_topk_prob=True,
                                    tie_word_embeddings=False)),
    "qwen3_moe_all": ("qwen3_moe", dict(num_attention_heads=4, head_dim=24, num_experts=8,
                                        num_experts_per_tok=3, moe_intermediate_size=40,
                                        norm_topk_prob=False)),
    # GLM-4.5: a sigmoid router with a score-correction bias, group-limited top-k (the
    # best 1 of 2 groups of 4), scaled weights, a shared expert, the first layer dense;
    # qkv bias, q/k norms, half the head rotated.
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, n_shared_experts=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                  partial_rotary_factor=0.5, moe_intermediate_size=32,
                                  head_dim=16, tie_word_embeddings=False)),
    # gpt-oss: attention sinks, q/k/v/o biases, sliding (window 8) and full layers in turn,
    # YaRN untruncated; a biased router (softmax over the top-2 logits of 4 experts),
    # experts with biases and the clamped SwiGLU at a limit low enough to clamp.
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48, head_dim=16, sliding_window=8,
                                swiglu_limit=0.5, swiglu_alpha=1.5, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                 "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64})),
}

# Llama 4 text (tests/parity/test_llama4.py): its layers' feed_forward is not the MoE
# families' mlp, so it has its own table.
LLAMA4_CONFIGS = {
    # Llama 4 text: chunked attention (chunks of 8) on the RoPE layers 0 and 2, NoPE
    # layers 1 and 3 with temperature tuning at a floor_scale the prompts cross; weightless
    # q/k norms; Llama 3.1 RoPE; experts (4, top-1, the sigmoid scaling their input) and a
    # shared expert on layers 0, 1 and 3, a wider dense MLP on layer 2.
    "llama4": ("llama4_text", dict(num_hidden_layers=4, num_local_experts=4,
                                   num_experts_per_tok=1, intermediate_size=48,
                                   intermediate_size_mlp=96, head_dim=16, moe_layers=[0, 1, 3],
                                   no_rope_layers=[1, 0, 1, 0], attention_chunk_size=8,
                                   attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
                                   use_qk_norm=True, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                                    "rope_theta": 500000.0,
                                                    "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
}

# DeepSeek-V3 (tests/parity/test_deepseek_v3.py): multi-head latent attention at odd ranks
# (a q bottleneck of 23, a kv latent of 19), key heads of 12 + 8 RoPE dims and values of
# 10; two dense layers, then experts (8, top 2 of the best 1 of 2 groups, scaled, a
# shared expert). With the q bottleneck: interleaved-pair RoPE, YaRN with mscale and
# mscale_all_dim (the scores' scale); without: plain RoPE on halves.
_MLA = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            kv_lora_rank=19, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
            first_k_dense_replace=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, moe_intermediate_size=24,
            routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
DEEPSEEK_CONFIGS = {
    "deepseek_v3": ("deepseek_v3", dict(
        _MLA, q_lora_rank=23, rope_interleave=True, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0})),
    "deepseek_v3_q_proj": ("deepseek_v3", dict(_MLA, q_lora_rank=None, rope_interleave=False)),
}


def make_hf_model(family: str, out_dir: str, seed: int = 0, **overrides):
    """Writes a random-weight model of `family` to out_dir (TINY shapes, with `overrides`
    of its config); returns the torch model."""
    import torch
    import transformers as tf

    kind = {"llama3": "llama"}.get(family, family)
    settings = FAMILY_CONFIGS.get(family)
    if family in DENSE_CONFIGS:
        kind, settings = DENSE_CONFIGS[family]
    if family in MOE_CONFIGS:
        kind, settings = MOE_CONFIGS[family]
    if family in LLAMA4_CONFIGS:
        kind, settings = LLAMA4_CONFIGS[family]
    if family in DEEPSEEK_CONFIGS:
        kind, settings = DEEPSEEK_CONFIGS[family]
    cls_cfg, cls_model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "llama4_text": (tf.Llama4TextConfig, tf.Llama4ForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
    }[kind]
    cfg = cls_cfg(**{**TINY, **settings, **overrides})
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so logits are not all near zero
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.normal_(0.0 if kind.startswith("gemma") else 1.0, 0.1)
            elif name.endswith("sinks"):  # large enough to take a share of the softmax
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():  # a router's bias, zero as initialized
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def written_case(variant: str, tmp_path_factory, prompts, steps: int):
    """(variant, its directory written by transformers, the torch model, transformers'
    greedy tokens of each prompt): a parity test file's per-family fixture."""
    d = str(tmp_path_factory.mktemp(variant))
    model = make_hf_model(variant, d)
    return variant, d, model, [hf_greedy(model, p, steps) for p in prompts]


def cli_generate(source: str, prompts, steps: int, chunk: int, capsys) -> list[list[int]]:
    """Each prompt's tokens from `jetserve generate --model source` (greedy, end of sequence
    ignored, 4 slots of 64 positions, prefill chunks of `chunk`), read from its JSON rows."""
    import json

    from jetserve import cli

    argv = ["generate", "--model", source, "--max-tokens", str(steps), "--ignore-eos",
            "--json", "--max-concurrent-decodes", "4", "--max-seq-len", "64",
            "--max-prefill-length", str(chunk)]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    capsys.readouterr()
    assert cli.main(argv) == 0
    return [json.loads(line)["token_ids"]
            for line in capsys.readouterr().out.strip().splitlines()]


def hf_greedy(model, prompt, steps: int, logit_bias: dict[int, float] | None = None
              ) -> list[int]:
    """transformers' greedy continuation of `prompt` (token ids), `steps` tokens, past any
    end-of-sequence token (as ignore_eos); logit_bias: added to those tokens' logits
    before each pick (a logits processor, as OpenAI's logit_bias)."""
    import torch
    import transformers as tf

    class AddBias(tf.LogitsProcessor):
        def __call__(self, input_ids, scores):
            for tok, value in (logit_bias or {}).items():
                scores[:, tok] += value
            return scores

    model.generation_config.eos_token_id = None
    extra = {"logits_processor": tf.LogitsProcessorList([AddBias()])} if logit_bias else {}
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             **extra)
    return out[0, len(prompt):].tolist()


def assert_near_greedy(model, prompt, tokens, tol: float, name: str = "") -> None:
    """Each of `tokens`, fed after `prompt` (teacher forcing, one transformers pass), is
    within `tol` of the top logit there: greedy up to near-ties, which a quantized KV
    cache may turn either way."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    for i, t in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        gap = float(row.max() - row[t])
        assert gap <= tol, (f"{name}: token {i} ({t}) is {gap:.4f} below the top logit "
                            f"(token {int(row.argmax())})")


# The MoE-shaped family files' shared setting (test_moe_families, test_gpt_oss,
# test_llama4, test_deepseek_v3): three prompts, the longest in three 16-token chunks.
PROMPT_LENGTHS = (40, 7, 23)


def parity_config(**kw):
    """4 slots of 64 positions, prefill chunks of 16; `kw` overrides."""
    from engines import EngineConfig

    return EngineConfig(**{**dict(max_concurrent_decodes=4, max_prefill_length=16,
                                  max_seq_len=64), **kw})


def parity_prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


def assert_logprobs_close(model, prompts, results, tol: float = 1e-4) -> None:
    """Each result's log-probs (of its tokens) within `tol` of the torch model's forward
    over the prompt and those tokens."""
    import torch

    for p, r in zip(prompts, results, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + r.token_ids])).logits[0], -1)
        ref = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(r.token_ids)]
        np.testing.assert_allclose(r.logprobs, ref, rtol=tol, atol=tol)


def assert_mixed_steps_keep_the_tokens(d: str, want, steps: int) -> None:
    """Ragged mixed steps on the paged layout (prompt chunks of 5 beside decode rows, 4-token
    pages, one device) give `want`, the tokens of `parity_prompts`."""
    import jax

    from engines import create_engine, load_hf_config
    from tests.engines.mixed_driver import run_mixed

    engine = create_engine(load_hf_config(d), weights=d, devices=jax.devices()[:1],
                           config=parity_config(kv_layout="paged", page_size=4))
    run = run_mixed(engine, engine.load_params(), parity_prompts(), max_tokens=steps,
                    chunk=5, budget=7, widest=True)
    assert run.mixed_steps >= 3
    assert run.outputs == want
