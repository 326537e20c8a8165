"""Trains the small model shipped inside the package (jetserve/bundled_model/).

A Llama-architecture decoder of a few million parameters (grouped-query attention, RoPE,
SwiGLU, tied embeddings) learns the CPython standard library's own `.py` sources, which
every machine with Python has, so `jetserve generate` / `serve` without `--model` print
recognisable Python instead of noise. A sentencepiece BPE tokenizer (byte fallback) is
trained on the same files first. Files are split into train and held-out by a hash of
their path relative to the stdlib root, so the split does not depend on the machine.

    python scripts/train_bundled_model.py                 # train, write jetserve/bundled_model
    python scripts/train_bundled_model.py --out /tmp/m    # train elsewhere (reproducibility)
    python scripts/train_bundled_model.py --eval-only     # held-out perplexity of the shipped model

Needs the `train` extra (optax). Runs on CPU in float32; deterministic for a given seed,
Python version (the corpus) and library versions. One process, no threads of our own.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engines.checkpoint import read_orbax_config, read_orbax_params, save_orbax  # noqa: E402
from engines.config import ModelConfig  # noqa: E402
from engines.model import Decoder  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "jetserve", "bundled_model")

# Directories of the stdlib that are not ordinary library code: tests, generated tables
# (encodings, pydoc_data) and third-party packages (site-packages).
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data",
             "__pycache__"}
HELDOUT_EVERY = 20  # one file in 20 (by path hash) is held out
SPECIALS = {"unk": 0, "bos": 1, "eos": 2}
# "\n" is an atomic piece. The 4-space symbol never matches: sentencepiece looks user
# symbols up after spaces became "▁", so training learned "▁▁▁▁" (a normal piece) for an
# indent instead. It stays listed so the piece ids the weights learned do not move, and
# `retire_unreachable_symbols` marks it unused in the written model.
USER_SYMBOLS = ["\n", "    "]

# Messages become comments. BOS is written by the template, as Hugging Face templates do
# (servers turn a leading bos_token into its id and encode the rest without adding one).
# Tools (jetserve.server.tool_calls documents the format): listed as JSON comments first,
# with how to call one; a call in the history is <tool_call>{"name", "arguments"}</tool_call>
# on a line of its own. Without tools it renders as it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '# tools:\\n' }}{% for tool in tools %}"
    "{{ '# ' + tool | tojson + '\\n' }}{% endfor %}"
    "{{ '# To call a tool, answer with <tool_call>{\"name\": NAME, \"arguments\": ARGUMENTS}"
    "</tool_call>, ARGUMENTS a JSON object matching the parameters of the tool.\\n' }}"
    "{% endif %}{% for message in messages %}{{ '# ' + message['role'] + ':\\n' }}"
    "{% if message['content'] or not message['tool_calls'] %}"
    "{{ message['content'] + '\\n' }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    "{{ '<tool_call>{\"name\": ' + f['name'] | tojson + ', \"arguments\": ' + "
    "(f['arguments'] if f['arguments'] is string else f['arguments'] | tojson) + "
    "'}</tool_call>\\n' }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides the trained weights (printed into MODEL.md)."""

    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 720
    peak_lr: float = 5e-3
    warmup_steps: int = 60
    weight_decay: float = 0.1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "seed" and not v > 0 and f.name != "weight_decay":
                raise ValueError(f"{f.name} must be positive, got {v!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_heads ({self.num_heads})")

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=1024,
            bos_token_id=SPECIALS["bos"], eos_token_ids=(SPECIALS["eos"],),
        )


# ---- corpus -------------------------------------------------------------------------------


def stdlib_files() -> tuple[str, list[str]]:
    """(stdlib root, sorted relative paths of its library .py files)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("_sysconfigdata"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    if not out:
        raise FileNotFoundError(f"no .py files under the stdlib directory {root}")
    return root, sorted(out)


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_EVERY == 0


def read_corpus() -> tuple[list[str], list[str], str]:
    """(train texts, held-out texts, stdlib root), each list in path order."""
    root, rels = stdlib_files()
    train, held = [], []
    for rel in rels:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        (held if is_heldout(rel) else train).append(text)
    return train, held, root


def _chunks(texts: list[str], limit: int = 4000):
    """Multi-line pieces of the files, so the tokenizer learns across newlines."""
    for text in texts:
        buf: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            if size + len(line) > limit and buf:
                yield "".join(buf)
                buf, size = [], 0
            buf.append(line[:limit])
            size += len(buf[-1])
        if buf:
            yield "".join(buf)


def train_tokenizer(texts: list[str], vocab_size: int, prefix: str):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(texts), model_prefix=prefix, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
        # Keep the text exactly: no NFKC, no whitespace folding, no dummy leading space.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
        user_defined_symbols=USER_SYMBOLS, unk_id=SPECIALS["unk"], bos_id=SPECIALS["bos"],
        eos_id=SPECIALS["eos"], pad_id=-1, max_sentence_length=16384,
        shuffle_input_sentence=False, num_threads=1, minloglevel=2,
    )
    retire_unreachable_symbols(prefix + ".model")
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def retire_unreachable_symbols(model_path: str) -> None:
    """Marks user symbols that contain a space UNUSED, in place.

    sentencepiece never emits them (it matches user symbols in the escaped text, where a
    space is "▁"), but transformers' converter matches user symbols in the raw text first,
    so without this it would encode four spaces as the never-trained piece and the model
    would see other tokens through transformers than the ones it was trained on. Encoding
    with sentencepiece is unchanged; the piece keeps its id and its text."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    for piece in proto.pieces:
        if piece.type == pb.ModelProto.SentencePiece.USER_DEFINED and " " in piece.piece:
            piece.type = pb.ModelProto.SentencePiece.UNUSED
    with open(model_path, "wb") as f:
        f.write(proto.SerializeToString())


def token_stream(sp, texts: list[str]) -> np.ndarray:
    """Every file as BOS + pieces + EOS, concatenated in order."""
    parts = []
    for ids in sp.encode(texts):
        parts.append(np.asarray([SPECIALS["bos"], *ids, SPECIALS["eos"]], np.int32))
    return np.concatenate(parts)


# ---- model, loss, training ----------------------------------------------------------------


class FullSequenceKV:
    """KV store for a whole-sequence forward: attend over the new tokens, causally."""

    def __init__(self, positions):
        self.positions = positions

    def update(self, layer, k, v):
        return k, v, self.positions


def token_nll(model: Decoder, params, tokens):
    """tokens i32[B, T+1] -> negative log-likelihood of tokens[:, 1:], f32[B, T]."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    pos = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape)
    logits = model.apply({"params": params}, x, pos, FullSequenceKV(pos))  # (B, T, V)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]


def init_params(model: Decoder, seed: int):
    import flax.linen as nn

    z = jnp.zeros((1, 1), jnp.int32)
    return jax.jit(lambda k: nn.meta.unbox(model.init(k, z, z, FullSequenceKV(z))["params"]))(
        jax.random.key(seed))


def make_optimizer(tc: TrainConfig):
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.peak_lr, min(tc.warmup_steps, tc.steps // 2), tc.steps, end_value=tc.peak_lr * 0.05)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask),
    )


def train(tc: TrainConfig, model: Decoder, stream: np.ndarray):
    """Returns (params, per-step losses, wall seconds)."""
    import optax

    opt = make_optimizer(tc)
    params = init_params(model, tc.seed)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: token_nll(model, p, batch).mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(tc.seed)
    span = tc.seq_len + 1
    losses = []
    log_every = max(1, min(20, tc.steps // 10))
    t0 = time.time()
    for i in range(tc.steps):
        starts = rng.integers(0, len(stream) - span, size=tc.batch_size)
        batch = np.stack([stream[s:s + span] for s in starts])
        params, opt_state, loss = step(params, opt_state, batch)
        if (i + 1) % log_every == 0 or i == 0:
            losses.append((i + 1, float(loss)))
            el = time.time() - t0
            tok_s = (i + 1) * tc.batch_size * tc.seq_len / el
            print(f"step {i + 1}/{tc.steps} loss {float(loss):.4f} "
                  f"elapsed {el:.0f}s ({tok_s:.0f} tok/s)", flush=True)
    jax.block_until_ready(params)
    return params, losses, time.time() - t0


def evaluate(model: Decoder, params, stream: np.ndarray, seq_len: int, n_bytes: int,
             batch_size: int = 16) -> dict:
    """Scores every held-out token after the first once; perplexity per token and byte."""
    nll_fn = jax.jit(lambda p, b: token_nll(model, p, b))
    n = (len(stream) - 1 + seq_len - 1) // seq_len  # windows
    padded = np.zeros(n * seq_len + 1, np.int32)
    padded[:len(stream)] = stream
    mask = np.zeros(n * seq_len, bool)
    mask[:len(stream) - 1] = True
    windows = np.stack([padded[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    wmask = mask.reshape(n, seq_len)
    total = 0.0
    for s in range(0, n, batch_size):
        b, m = windows[s:s + batch_size], wmask[s:s + batch_size]
        if len(b) < batch_size:  # one shape for the jit
            fill = batch_size - len(b)
            b = np.concatenate([b, np.zeros((fill, seq_len + 1), np.int32)])
            m = np.concatenate([m, np.zeros((fill, seq_len), bool)])
        total += float(np.sum(np.asarray(nll_fn(params, b), np.float64) * m))
    tokens = int(mask.sum())
    return {"tokens": tokens, "bytes": n_bytes, "nll_per_token": total / tokens,
            "ppl_per_token": float(np.exp(total / tokens)),
            "ppl_per_byte": float(np.exp(total / n_bytes)),
            "bits_per_byte": total / n_bytes / np.log(2)}


# ---- output -------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig) -> dict:
    """A Hugging Face LlamaForCausalLM config.json for the same model."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "torch_dtype": "float32", "use_cache": True,
    }


def tokenizer_config(max_len: int) -> dict:
    return {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "add_bos_token": True,
        "add_eos_token": False, "add_prefix_space": False, "legacy": False,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def model_card(tc: TrainConfig, cfg: ModelConfig, stats: dict) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    template = os.path.join(here, "bundled_model_card.md")
    with open(template) as f:
        text = f.read()
    values = {**dataclasses.asdict(tc), **stats, "params": cfg.param_count(),
              "params_mb": cfg.param_count() * 4 / 1e6, "head_dim": cfg.head_dim,
              "heldout_every": HELDOUT_EVERY,
              "bytes_per_token": stats["train_bytes"] / stats["train_tokens"]}
    return text.format(**values)


def write_model(out: str, params, tc: TrainConfig, sp_prefix: str, stats: dict) -> None:
    import shutil

    cfg = tc.model_config()
    os.makedirs(out, exist_ok=True)
    save_orbax(params, cfg, out, None)
    shutil.copy(sp_prefix + ".model", os.path.join(out, "tokenizer.model"))
    write_json(os.path.join(out, "config.json"), hf_config(cfg))
    write_json(os.path.join(out, "tokenizer_config.json"),
               tokenizer_config(cfg.max_position_embeddings))
    write_json(os.path.join(out, "generation_config.json"),
               {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]})
    write_json(os.path.join(out, "training_stats.json"), stats)
    with open(os.path.join(out, "MODEL.md"), "w") as f:
        f.write(model_card(tc, cfg, stats))


def load_model(out: str):
    """(ModelConfig, params, sentencepiece processor) of a written model directory."""
    import sentencepiece as spm

    cfg = read_orbax_config(out)
    model = Decoder(cfg, dtype=jnp.float32)
    # A one-device mesh: the reader lays a v1 checkpoint's kernels out by their spec.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    abstract = jax.eval_shape(lambda: init_params(model, 0))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=dev),
                          abstract)
    params = read_orbax_params(out, target)
    return cfg, params, spm.SentencePieceProcessor(model_file=os.path.join(out, "tokenizer.model"))


# ---- main ---------------------------------------------------------------------------------


def heldout_eval(model, params, sp, held: list[str], seq_len: int) -> dict:
    n_bytes = sum(len(t.encode("utf-8")) for t in held)
    return evaluate(model, params, token_stream(sp, held), seq_len, n_bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="model directory to write or evaluate")
    ap.add_argument("--eval-only", action="store_true",
                    help="print the held-out perplexity of the model in --out")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "float32")
    train_texts, held, root = read_corpus()
    print(f"corpus: {root}: {len(train_texts)} train files, {len(held)} held-out files",
          flush=True)
    if args.eval_only:
        cfg, params, sp = load_model(args.out)
        res = heldout_eval(Decoder(cfg), params, sp, held, TrainConfig.seq_len)
        print(json.dumps(res, indent=1))
        print(f"held-out perplexity: {res['ppl_per_token']:.3f} per token, "
              f"{res['ppl_per_byte']:.4f} per byte ({res['bits_per_byte']:.3f} bits/byte)")
        return 0

    tc = TrainConfig(seed=args.seed, steps=args.steps)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        prefix = os.path.join(tmp, "tokenizer")
        sp = train_tokenizer(train_texts, tc.vocab_size, prefix)
        tok_time = time.time() - t0
        stream = token_stream(sp, train_texts)
        n_train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
        print(f"tokenizer: {tok_time:.0f}s; train stream {len(stream)} tokens "
              f"({n_train_bytes / len(stream):.2f} bytes/token)", flush=True)
        cfg = tc.model_config()
        print(f"model: {cfg.param_count()} parameters", flush=True)
        model = Decoder(cfg, dtype=jnp.float32)
        params, losses, train_time = train(tc, model, stream)
        res = heldout_eval(model, params, sp, held, tc.seq_len)
        print(f"held-out perplexity: {res['ppl_per_token']:.3f} per token, "
              f"{res['ppl_per_byte']:.4f} per byte ({res['bits_per_byte']:.3f} bits/byte)",
              flush=True)
        stats = {
            "python": platform.python_version(), "jax": jax.__version__,
            "train_files": len(train_texts), "heldout_files": len(held),
            "train_tokens": int(len(stream)), "train_bytes": n_train_bytes,
            "tokens_seen": tc.steps * tc.batch_size * tc.seq_len,
            "tokenizer_seconds": round(tok_time, 1), "train_seconds": round(train_time, 1),
            "train_minutes": round(train_time / 60, 1), "final_loss": losses[-1][1],
            "heldout_tokens": res["tokens"], "heldout_bytes": res["bytes"],
            "ppl_per_token": round(res["ppl_per_token"], 3),
            "ppl_per_byte": round(res["ppl_per_byte"], 4),
            "bits_per_byte": round(res["bits_per_byte"], 3),
            "loss_curve": losses,
        }
        write_model(args.out, params, tc, prefix, stats)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
