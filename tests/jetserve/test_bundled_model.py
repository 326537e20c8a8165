"""The model shipped inside the package: found without --model, loads, writes Python."""

from __future__ import annotations

import ast
import functools
import importlib.util
import io
import json
import keyword
import os
import re
import shutil
import subprocess
import sys
import tokenize
import zipfile

import numpy as np
import pytest

from engines import EngineConfig, from_hf_config
from jetserve.model_loading import BUNDLED_DIR, build_engine, default_model, resolve_model
from jetserve.tokenizer import SentencePieceTokenizer, load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "def add(a, b):\n    "
MAX_BYTES = 30 * 1024 * 1024


@functools.cache
def stdlib_names() -> frozenset[str]:
    """Every identifier and keyword written in the standard library's sources."""
    names = set(keyword.kwlist)
    root, rels = _training_script().stdlib_files()
    for rel in rels:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f.read()))
    return frozenset(names)


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    """Python's own tokens of `source`, up to where it stops being Python: an unclosed
    bracket or string at the end, or a dedent to no enclosing level."""
    out = []
    try:
        out.extend(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return out


def python_looking(prompt: str, text: str) -> bool:
    """True when `text`, continuing `prompt`, reads as Python token by token: it starts
    with code rather than blanks, Python's tokenizer reads all of it without error
    tokens, it indents by multiples of four spaces, and it adds at least three names, one
    of them a keyword, every one of them the prompt's or written somewhere in the standard
    library (words inside strings and comments are single tokens and do not count). It
    does not ask for a complete statement: a short greedy continuation may stop mid-line."""
    if len(text.split("\n")[0].strip()) < 3:
        return False
    source = prompt + text
    toks = _tokens(source)
    prompt_lines = prompt.count("\n")
    new = [t for t in toks if t.start[0] > prompt_lines]
    if not new or any(t.type == tokenize.ERRORTOKEN and t.string.strip() for t in new):
        return False
    if max(t.end[0] for t in toks) <= source.rstrip().count("\n"):
        return False  # it gave up before the last line (say, inside an unclosed string)
    for line in text.split("\n")[1:]:
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and (indent % 4 or line[indent:indent + 1] == "\t"):
            return False
    names = [t.string for t in new if t.type == tokenize.NAME]
    known = stdlib_names() | {t.string for t in toks if t.start[0] <= prompt_lines}
    return (len(names) >= 3 and any(keyword.iskeyword(n) for n in names)
            and all(n in known for n in names))


def _bundled_bytes() -> int:
    total = 0
    for d, _, files in os.walk(BUNDLED_DIR):
        total += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return total


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer(BUNDLED_DIR)
    assert isinstance(t, SentencePieceTokenizer)
    return t


def test_default_model_is_the_bundled_one():
    assert default_model() == BUNDLED_DIR
    src = resolve_model(None)
    assert src.path == BUNDLED_DIR
    # jetserve's own config and the Hugging Face config.json describe the same model.
    with open(os.path.join(BUNDLED_DIR, "config.json")) as f:
        assert from_hf_config(json.load(f)) == src.config
    assert src.config.family == "llama"
    assert src.config.num_kv_heads < src.config.num_heads  # grouped-query attention
    assert src.tokenizer.bos_id == 1 and src.tokenizer.eos_ids == (2,)


def test_bundled_files_stay_small():
    for name in ("config.json", "jetserve_model.json", "tokenizer.model",
                 "tokenizer_config.json", "MODEL.md"):
        assert os.path.isfile(os.path.join(BUNDLED_DIR, name)), name
    assert os.path.isdir(os.path.join(BUNDLED_DIR, "params"))
    assert _bundled_bytes() < MAX_BYTES


def test_tokenizer_round_trips_python_source(tok):
    import inspect
    import json.decoder
    import textwrap

    samples = [inspect.getsource(m) for m in (textwrap, json.decoder, ast)]
    samples += [PROMPT, "\tx = 'é 🐍'  # tab, accents, emoji\r\n", "  \n\n    \n", "a\u00a0b"]
    for s in samples:
        ids = tok.encode(s, add_bos=False)
        assert tok.decode(ids) == s
        with_bos = tok.encode(s)  # add_bos_token is true in tokenizer_config.json
        assert with_bos[0] == tok.bos_id and with_bos[1:] == ids
        assert tok.decode(with_bos + [tok.eos_ids[0]]) == s
    # The indent the prompt ends with is one piece, as it is in the training data.
    ids = tok.encode(PROMPT, add_bos=False)
    assert tok.decode(ids[-1:]) == "    " and tok.decode(ids[-2:-1]) == "\n"


def test_chat_template_renders(tok):
    import jinja2

    tmpl = jinja2.Environment().from_string(tok.chat_template)
    text = tmpl.render(messages=[{"role": "user", "content": "add two numbers"}],
                       add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert text == "<s># user:\nadd two numbers\n# assistant:\n"


def _training_script():
    """scripts/train_bundled_model.py as a module: its corpus split says which stdlib files
    the model never saw."""
    spec = importlib.util.spec_from_file_location(
        "train_bundled_model", os.path.join(REPO, "scripts", "train_bundled_model.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its own module up there
    spec.loader.exec_module(mod)
    return mod


def test_weights_load_and_score_heldout_python():
    """build_engine(None) restores the Orbax checkpoint, and the weights know Python they
    were not trained on: on held-out stdlib files the model's perplexity is far below both
    uniform guessing (what random weights do) and the best context-free guess (the
    training corpus's token frequencies)."""
    train = _training_script()
    train_texts, held, _ = train.read_corpus()
    engine = build_engine(None, engine_config=EngineConfig(
        max_concurrent_decodes=1, max_prefill_length=256, max_seq_len=256))
    params = engine.load_params()
    tok = engine.tokenizer
    # Add-one smoothed unigram model of the training files.
    counts = np.bincount(train.token_stream(tok.sp, train_texts), minlength=tok.vocab_size) + 1
    unigram_logp = np.log(counts / counts.sum())
    model_nll, unigram_nll = [], []
    for text in held[:8]:  # the first 256 tokens of each of 8 held-out files
        ids = tok.encode(text)[:256]
        lp = engine.prompt_logprobs(params, ids)
        model_nll.extend(-np.asarray(lp.token_logprobs[1:], np.float64))
        unigram_nll.extend(-unigram_logp[ids[1:]])
    model_ppl, unigram_ppl = np.exp(np.mean(model_nll)), np.exp(np.mean(unigram_nll))
    assert len(model_nll) > 1000
    assert model_ppl < tok.vocab_size / 20, (model_ppl, unigram_ppl)
    assert model_ppl < unigram_ppl / 2, (model_ppl, unigram_ppl)
    print(f"held-out: model perplexity {model_ppl:.1f}, unigram {unigram_ppl:.1f}")


def test_noise_is_not_python_looking(tok):
    """What random weights would print (uniform pieces) fails the check used below."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        noise = tok.decode(rng.integers(3, tok.vocab_size, 32).tolist())
        assert not python_looking(PROMPT, noise), noise
    assert python_looking(PROMPT, "return a + b\n\n\ndef sub(a, b):")
    assert python_looking(PROMPT, '"""Add a and b.\n\n    """\n    return a + b')
    assert not python_looking(PROMPT, '"""Add a and b."""\n    """')  # no code
    assert not python_looking(PROMPT, '"""Return the list of the list\n    #\n    #')
    # A greedy continuation may stop mid-statement, and its body may be over-indented.
    assert python_looking(PROMPT, '"""Return a list.\n        """\n        if not self.path(')
    assert not python_looking(PROMPT, "return a + b\n\tpass")  # a tab indents
    assert not python_looking(PROMPT, "return a $ b")  # not a Python token


def test_cli_generate_without_model_prints_python():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-m", "jetserve", "generate", "--prompt", PROMPT, "--max-tokens", "32"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout[:-1] if out.stdout.endswith("\n") else out.stdout
    assert python_looking(PROMPT, text), text


@pytest.mark.slow
def test_wheel_ships_the_model(tmp_path):
    """A built wheel holds the model, stays < 40 MB, and an installed copy finds it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("jetserve", "engines", "sharding", "protos"):
        shutil.copytree(os.path.join(REPO, name), src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), src)
    readme = os.path.join(REPO, "README.md")
    if os.path.exists(readme):
        shutil.copy(readme, src)
    else:
        (src / "README.md").write_text("jetserve\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", str(src), "-w", str(tmp_path / "whl")], check=True, timeout=600)
    (wheel,) = (tmp_path / "whl").glob("jetserve-*.whl")
    assert wheel.stat().st_size < 40 * 1024 * 1024
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    for f in ("config.json", "tokenizer.model", "jetserve_model.json", "MODEL.md"):
        assert f"jetserve/bundled_model/{f}" in names
    assert any(n.startswith("jetserve/bundled_model/params/") for n in names)
    code = ("import jetserve.model_loading as m; from engines.checkpoint import "
            "read_orbax_config; print(m.__file__); print(m.default_model()); "
            "print(read_orbax_config(m.default_model()).vocab_size)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), check=True).stdout.split()
    site = str(tmp_path / "site")
    assert out[0].startswith(site) and out[1] == os.path.join(site, "jetserve", "bundled_model")
    assert int(out[2]) > 256
