"""LoRA adapters against peft: for a random Llama and three PEFT adapters (different
ranks, target modules and scalings, B non-zero), the engine's greedy tokens for each
adapter equal transformers' with that adapter merged (merge_and_unload), with base and
adapter requests in one batch; on one device and under `tp` on 4; disaggregated (prefill
on one slice, generate on another, whose pool rows differ); after a run-time load and
after a swap out of the pool (least recently used); and served by `jetserve serve
--lora-modules`, a prompt four times the prefill bucket for the base model and two
adapters at once, on the contiguous and the paged KV layouts, and that prompt's
log-probs (echo) through an adapter as peft's merged model scores it."""

import concurrent.futures

import jax
import numpy as np
import openai
import pytest
import torch

from engines import EngineConfig, create_engine, load_hf_config
from sharding import load_preset
from tests.e2e.serve_process import spawn, wait_listening
from tests.parity.hf_models import hf_greedy, make_hf_model
from tests.parity.lora_adapters import ADAPTERS, base_model, make_adapter, merged_model

STEPS = 12
PROMPT_LENGTHS = (9, 17, 5, 12)


@pytest.fixture(scope="module")
def model_and_refs(tmp_path_factory):
    """(model dir, {adapter: dir}, {None | adapter: greedy tokens per prompt})."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = str(root / "llama")
    base = make_hf_model("llama", base_dir)
    dirs = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        dirs[name] = str(root / name)
        make_adapter(base_dir, dirs[name], r, alpha, targets, rslora, seed=i + 1)
    refs = {None: [_hf_greedy(base, p) for p in _prompts()]}
    for name, d in dirs.items():
        merged = merged_model(base_dir, d)
        refs[name] = [_hf_greedy(merged, p) for p in _prompts()]
    for name in dirs:  # the adapters change the tokens, so the checks below mean something
        assert refs[name] != refs[None], name
    return base_dir, dirs, refs


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompt):
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _engine(base_dir, dirs, *, max_loras=3, devices=None, sharding=None):
    cfg = EngineConfig(max_concurrent_decodes=4, max_prefill_length=32, max_seq_len=64,
                       max_loras=max_loras, max_lora_rank=8)
    eng = create_engine(load_hf_config(base_dir), weights=base_dir, config=cfg,
                        devices=devices, sharding=sharding)
    for name, d in dirs.items():
        eng.load_adapter(name, d)
    return eng


def _run_batch(eng, params, jobs):
    """jobs: [(prompt, adapter or None)] in slots 0.. at once -> greedy tokens of each."""
    state = eng.init_decode_state()
    out = []
    for slot, (prompt, adapter) in enumerate(jobs):
        prefix, first = eng.prefill(params, prompt, len(prompt), adapter=adapter)
        out.append([first.to_host().token(0)])
        state = eng.insert(prefix, state, slot)
    for _ in range(STEPS - 1):
        state, res = eng.generate(params, state)
        host = res.to_host()
        for slot, toks in enumerate(out):
            toks.append(host.token(slot))
    for slot in range(len(jobs)):
        eng.free_slot(slot)
    return out


def _mixed_jobs(names):
    """Base and adapter requests in one batch: prompt i with names[i]."""
    return list(zip(_prompts(), names, strict=True))


def test_mixed_batch_matches_merged_adapters(model_and_refs):
    base_dir, dirs, refs = model_and_refs
    eng = _engine(base_dir, dirs)
    params = eng.load_params()
    names = [None, "qv4", "all8", "mlp2"]
    got = _run_batch(eng, params, _mixed_jobs(names))
    for i, (name, toks) in enumerate(zip(names, got, strict=True)):
        assert toks == refs[name][i], name
    # Every slot on another adapter, rotated: the same tokens per (prompt, adapter).
    names = ["all8", "mlp2", None, "qv4"]
    got = _run_batch(eng, params, _mixed_jobs(names))
    for i, (name, toks) in enumerate(zip(names, got, strict=True)):
        assert toks == refs[name][i], name


def test_tp_on_four_devices_matches(model_and_refs):
    base_dir, dirs, refs = model_and_refs
    eng = _engine(base_dir, dirs, devices=jax.devices()[:4], sharding=load_preset("tp"))
    assert eng.kv_repeat == 2  # 2 kv heads on 4 devices: k/v adapters repeated per head
    params = eng.load_params()
    names = ["mlp2", "all8", "qv4", None]
    got = _run_batch(eng, params, _mixed_jobs(names))
    for i, (name, toks) in enumerate(zip(names, got, strict=True)):
        assert toks == refs[name][i], name


def test_disaggregated_prefill_and_generate_match(model_and_refs):
    base_dir, dirs, refs = model_and_refs
    pe = _engine(base_dir, dirs, devices=jax.devices()[:2])
    ge = _engine(base_dir, dirs, devices=jax.devices()[4:8], sharding=load_preset("tp"))
    params_p, params_g = pe.load_params(), ge.load_params()
    names = ["qv4", "all8", None, "mlp2"]
    prefixes, out = [], []
    for prompt, name in _mixed_jobs(names):
        prefix, first = pe.prefill(params_p, prompt, len(prompt), adapter=name)
        moved = jax.device_put(ge.receive_prefix(prefix), ge.prefix_destination_sharding())
        prefixes.append(moved)
        out.append([first.to_host().token(0)])
    state = ge.init_decode_state()
    for slot in (3, 2, 1, 0):  # inserted in another order: the generate pool's rows differ
        state = ge.insert(prefixes[slot], state, slot)
    assert ge.adapters.resident() != pe.adapters.resident()
    for _ in range(STEPS - 1):
        state, res = ge.generate(params_g, state)
        for slot, toks in enumerate(out):
            toks.append(res.to_host().token(slot))
    for i, (name, toks) in enumerate(zip(names, out, strict=True)):
        assert toks == refs[name][i], name


def test_run_time_load_and_lru_swap_without_recompiling(model_and_refs):
    base_dir, dirs, refs = model_and_refs
    eng = _engine(base_dir, {"qv4": dirs["qv4"]}, max_loras=2)
    params = eng.load_params()
    got = _run_batch(eng, params, _mixed_jobs([None, "qv4", None, "qv4"]))
    assert got[1] == refs["qv4"][1] and got[0] == refs[None][0]
    traces = eng.trace_counts()
    eng.load_adapter("all8", dirs["all8"])  # loaded at run time
    eng.load_adapter("mlp2", dirs["mlp2"])  # three adapters, two rows: one swaps out
    names = ["all8", "mlp2", "all8", None]
    got = _run_batch(eng, params, _mixed_jobs(names))
    for i, (name, toks) in enumerate(zip(names, got, strict=True)):
        assert toks == refs[name][i], name
    assert "qv4" not in eng.adapters.resident()  # the least recently used went
    got = _run_batch(eng, params, _mixed_jobs(["qv4", None, "mlp2", "qv4"]))
    assert got[0] == refs["qv4"][0] and got[3] == refs["qv4"][3]
    assert got[2] == refs["mlp2"][2]
    assert eng.trace_counts() == traces  # swaps write the pool; nothing recompiled


# ---- served: prompts longer than the prefill bucket (prefilled in chunks) -----------------

LONG_PROMPT = 240  # tokens: four chunks of --max-prefill-length 64
SERVE = ["--interleaved", "--devices", "1", "--max-seq-len", "256", "--max-prefill-length",
         "64", "--no-warmup", "--served-model-name", "base", "--host", "127.0.0.1",
         "--grpc-port", "-1", "--http-port", "0"]


def _served_greedy(port, prompt, model, stream):
    """The greedy tokens a server answers (as ids: the model has no tokenizer)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    kw = dict(model=model, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if stream:
        tokens = [t for chunk in client.completions.create(stream=True, **kw)
                  for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    else:
        tokens = client.completions.create(**kw).choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _served_scores(port, prompt, model):
    """The log-prob of each prompt token but the first (echo, no tokens generated)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=1)
    scored = out.choices[0].logprobs.token_logprobs
    assert len(scored) == len(prompt) and scored[0] is None
    return np.asarray(scored[1:], np.float64)


def _hf_scores(model, prompt):
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    picked = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
    return picked[:, 0].numpy()


@pytest.mark.slow  # two servers
def test_served_long_prompts_match_peft_on_both_kv_layouts(model_and_refs):
    """`jetserve serve --lora-modules` (the base model and two adapters in one batch,
    one streamed) answers a 240-token prompt with the tokens of transformers without an
    adapter (base) and with the adapter merged by peft; `--kv-layout paged` (pages of 8)
    answers the base model and an adapter as the contiguous server does."""
    base_dir, dirs, _ = model_and_refs
    prompt = np.random.default_rng(7).integers(3, 128, LONG_PROMPT).tolist()
    names = ["qv4", "all8"]
    lora = spawn(["--model", base_dir, *SERVE, "--lora-modules",
                  *(f"{n}={dirs[n]}" for n in names)])
    paged = spawn(["--model", base_dir, *SERVE, "--kv-layout", "paged", "--page-size", "8",
                   "--lora-modules", f"all8={dirs['all8']}"])
    try:
        lora_port = wait_listening(lora, 1)["HTTP"]
        paged_port = wait_listening(paged, 1)["HTTP"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            jobs = {name: pool.submit(_served_greedy, lora_port, prompt, name or "base",
                                      name == "qv4")
                    for name in (None, *names)}
            got = {name: job.result() for name, job in jobs.items()}
            jobs = {name: pool.submit(_served_greedy, paged_port, prompt, name or "base",
                                      name is None)
                    for name in (None, "all8")}
            got_paged = {name: job.result() for name, job in jobs.items()}
            scores = {name: _served_scores(lora_port, prompt, name or "base")
                      for name in (None, "qv4")}  # echo: scored in chunks of 64
    finally:
        for proc in (lora, paged):
            proc.kill()
            proc.wait()
    assert got[None] == hf_greedy(base_model(base_dir), prompt, STEPS)
    for name in names:
        want = hf_greedy(merged_model(base_dir, dirs[name]), prompt, STEPS)
        assert want != got[None], name  # the adapter changes the tokens
        assert got[name] == want, name
    assert got_paged == {None: got[None], "all8": got["all8"]}
    np.testing.assert_allclose(scores[None], _hf_scores(base_model(base_dir), prompt),
                               atol=2e-4)
    want = _hf_scores(merged_model(base_dir, dirs["qv4"]), prompt)
    np.testing.assert_allclose(scores["qv4"], want, atol=2e-4)
    assert np.abs(scores["qv4"] - scores[None]).max() > 1e-2  # the adapter changes them
