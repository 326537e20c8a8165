"""Host tokenizers: sentencepiece (`tokenizer.model`) or HF `tokenizers` (`tokenizer.json`).

Both expose the same small surface (`engines.engine_api.Tokenizer`): encode, decode,
vocab_size, bos_id, eos_ids, plus the chat template from `tokenizer_config.json`.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # byte-fallback pieces, both libraries
# tokenizer_config.json's special tokens (transformers' special_tokens_map).
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token")


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object a model directory's file holds ({} when there is no such file); a
    ValueError naming the file when it is not valid JSON or not an object."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class _Base:
    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    add_bos_default: bool = True

    def _setup_specials(self, cfg: dict[str, Any], eos_from_config: tuple[int, ...]):
        self.config = dict(cfg)  # tokenizer_config.json, for /tokenizer_info
        self.chat_template = cfg.get("chat_template") if isinstance(
            cfg.get("chat_template"), str) else None
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        # Every special token the config names, as chat templates see them.
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS
                               if (t := _token_str(cfg.get(k))) is not None}
        if self.bos_token is not None:
            bid = self.token_to_id(self.bos_token)
            if bid is not None:
                self.bos_id = bid
        eos = list(eos_from_config)
        if self.eos_token is not None:
            eid = self.token_to_id(self.eos_token)
            if eid is not None and eid not in eos:
                eos.insert(0, eid)
        if eos:
            self.eos_ids = tuple(eos)
        if "add_bos_token" in cfg:
            self.add_bos_default = bool(cfg["add_bos_token"])

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError


class SentencePieceTokenizer(_Base):
    def __init__(self, model_path: str, config: dict[str, Any] | None = None,
                 eos_from_config: tuple[int, ...] = ()):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_path)
        except Exception as e:  # sentencepiece raises OSError or RuntimeError
            raise ValueError(f"{model_path} is not a sentencepiece model: {e}") from None
        self.vocab_size = self.sp.GetPieceSize()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_ids = (self.sp.eos_id(),) if self.sp.eos_id() >= 0 else ()
        self._setup_specials(config or {}, eos_from_config)

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.PieceToId(token)
        return i if i != self.sp.unk_id() or token == self.sp.IdToPiece(i) else None

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self._encode_with_specials(text)
        add = self.add_bos_default if add_bos is None else add_bos
        return ([self.bos_id] if add and self.bos_id is not None else []) + ids

    def _encode_with_specials(self, text: str) -> list[int]:
        """A special piece written in the text ("<s>", "</s>", "<unk>") is its id, as
        transformers and vLLM read it, so clients that tokenize on their side agree;
        the text between is sentencepiece's."""
        if self._specials is None or not self._specials.search(text):
            return list(self.sp.EncodeAsIds(text))
        ids: list[int] = []
        for k, part in enumerate(self._specials.split(text)):
            if k % 2:
                ids.append(self.sp.PieceToId(part))
            elif part:
                ids.extend(self.sp.EncodeAsIds(part))
        return ids

    @functools.cached_property
    def _specials(self) -> re.Pattern | None:
        pieces = sorted({self.sp.IdToPiece(i) for i in range(self.vocab_size)
                         if self.sp.IsControl(i) or self.sp.IsUnknown(i)} - {""},
                        key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None

    def encode_verbatim(self, text: str) -> list[int]:
        """Ids whose pieces spell `text` exactly, byte for byte as `token_bytes` reads
        them: no dummy leading "▁", no normalization or whitespace folding, and special
        pieces written in the text taken as text. A grammar continues text with these
        (structured/vocabulary.py); `encode` is how a prompt reaches the model, where
        sentencepiece's dummy prefix would put a space before the text."""
        return list(self._verbatim_sp.EncodeAsIds(text))

    @functools.cached_property
    def _verbatim_sp(self):
        """This model with the identity normalizer (same pieces, same scores)."""
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(self.sp.serialized_model_proto())
        norm = proto.normalizer_spec
        norm.name, norm.precompiled_charsmap = "identity", b""
        norm.add_dummy_prefix = norm.remove_extra_whitespaces = False
        sp = spm.SentencePieceProcessor()
        sp.LoadFromSerializedProto(proto.SerializeToString())
        return sp

    def decode(self, ids: list[int]) -> str:
        return self.sp.DecodeIds([int(i) for i in ids if 0 <= i < self.vocab_size])

    def id_to_piece(self, i: int) -> str:
        return self.sp.IdToPiece(int(i))

    def token_bytes(self, i: int) -> bytes | None:
        """The bytes piece `i` stands for (one byte for a byte-fallback piece); None for
        control and unknown pieces, which stand for no text."""
        i = int(i)
        if not 0 <= i < self.vocab_size or self.sp.IsControl(i) or self.sp.IsUnknown(i):
            return None
        piece = self.sp.IdToPiece(i)
        if self.sp.IsByte(i):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")


class HFTokenizer(_Base):
    def __init__(self, json_path: str, config: dict[str, Any] | None = None,
                 eos_from_config: tuple[int, ...] = ()):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(json_path)
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise ValueError(f"{json_path} is not a tokenizers JSON file: {e}") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = None
        self.eos_ids = ()
        # tokenizer.json post-processors usually add BOS themselves; we add it explicitly.
        self._setup_specials(config or {}, eos_from_config)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos_default if add_bos is None else add_bos
        return ([self.bos_id] if add and self.bos_id is not None else []) + list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_piece(self, i: int) -> str:
        return self.tok.id_to_token(int(i)) or ""

    def token_bytes(self, i: int) -> bytes | None:
        """The bytes token `i` adds after other text: an added token's own text, a
        byte-fallback piece's byte, a byte-level BPE piece's bytes, a Metaspace piece's
        text with its "▁" a space; None for special tokens, and where the decoder is none
        of these (the piece does not say)."""
        i = int(i)
        piece = self.tok.id_to_token(i)
        if piece is None or i in self._special_ids:
            return None
        if i in self._added_text:
            return self._added_text[i].encode("utf-8")
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        reading = self._piece_reading
        if reading == "byte_level":
            chars = _byte_level_chars()
            if all(c in chars for c in piece):
                return bytes(chars[c] for c in piece)
        elif reading is not None:  # the character the decoder replaces with a space
            return piece.replace(reading, " ").encode("utf-8")
        return None

    @functools.cached_property
    def _piece_reading(self) -> str | None:
        """How the decoder reads a piece: "byte_level", the one character it replaces
        with a space (Metaspace, or Llama's Replace + ByteFallback), or None."""
        dec = json.loads(self.tok.to_str()).get("decoder") or {}
        for d in [dec, *(dec.get("decoders") or [])]:
            if d.get("type") == "ByteLevel":
                return "byte_level"
            if d.get("type") == "Metaspace":
                return d.get("replacement", "\u2581")
            pattern = (d.get("pattern") or {}).get("String")
            if d.get("type") == "Replace" and d.get("content") == " " and len(pattern or "") == 1:
                return pattern
        return None

    @functools.cached_property
    def _added_text(self) -> dict[int, str]:
        return {i: t.content for i, t in self.tok.get_added_tokens_decoder().items()
                if not t.special}

    def encode_verbatim(self, text: str) -> list[int]:
        """Ids whose `token_bytes` spell `text` exactly: no prefix space added (Metaspace
        prepend, a Prepend normalizer, byte-level add_prefix_space) and special tokens
        written in the text taken as text. A grammar continues text with these."""
        return list(self._verbatim_tok.encode(text, add_special_tokens=False).ids)

    @functools.cached_property
    def _verbatim_tok(self):
        from tokenizers import Tokenizer

        spec = json.loads(self.tok.to_str())
        spec["normalizer"] = _without_prepend(spec.get("normalizer"))
        _never_prepend(spec.get("pre_tokenizer"))
        tok = Tokenizer.from_str(json.dumps(spec))
        tok.no_padding()
        tok.no_truncation()
        tok.encode_special_tokens = True
        return tok

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)


Tokenizer = SentencePieceTokenizer | HFTokenizer


def _without_prepend(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """A tokenizer.json normalizer without its Prepend("▁") steps."""
    if not spec or spec.get("type") == "Prepend":
        return None
    if spec.get("type") == "Sequence":
        return {**spec, "normalizers": [n for n in spec["normalizers"]
                                        if n.get("type") != "Prepend"]}
    return spec


def _never_prepend(spec: dict[str, Any] | None) -> None:
    """Turns off, in place, the space a tokenizer.json pre-tokenizer puts before text."""
    if not spec:
        return
    for p in spec.get("pretokenizers") or []:
        _never_prepend(p)
    if spec.get("type") == "Metaspace":
        spec["prepend_scheme"] = "never"
        spec.pop("add_prefix_space", None)
    if spec.get("type") == "ByteLevel":
        spec["add_prefix_space"] = False


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte. Printable
    Latin-1 bytes stand for themselves; the rest take code points from 256 up, in order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def load_tokenizer(model_dir: str) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has none (token ids only)."""
    cfg = read_json_object(os.path.join(model_dir, "tokenizer_config.json"))
    cfg = _with_chat_template(model_dir, cfg)
    gen = read_json_object(os.path.join(model_dir, "generation_config.json"))
    eos = gen.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    sp_path = os.path.join(model_dir, "tokenizer.model")
    json_path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(json_path):
        return HFTokenizer(json_path, cfg, eos_ids)
    if os.path.exists(sp_path):
        return SentencePieceTokenizer(sp_path, cfg, eos_ids)
    return None


def _with_chat_template(model_dir: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config's `chat_template`; newer transformers save it beside, in
    chat_template.jinja (or chat_template.json); a list of named templates -> "default"."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        else:
            template = read_json_object(os.path.join(model_dir, "chat_template.json")).get(
                "chat_template")
    return {**cfg, "chat_template": template} if isinstance(template, str) else cfg
