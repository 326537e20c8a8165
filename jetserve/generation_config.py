"""A model directory's generation_config.json as the default sampling of its requests.

As vLLM reads it (`--generation-config auto`, the default): `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as `max_tokens`) in the file
are the defaults of every request that does not set them; `--generation-config vllm`
ignores the file. `do_sample` is not read (vLLM does not either): a model creator who
writes a temperature means it. transformers 5 writes only the fields a model sets, so
every field present is one the creator chose.

`resolve` is the one rule every request path applies (HTTP completions and chat, gRPC,
`jetserve generate`, `jetserve batch` rows): the request's value, else the model's
default, else the path's own default. Plain Python; no jax.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from jetserve.tokenizer import read_json_object

FILE = "generation_config.json"
MODES = ("auto", "vllm")  # --generation-config: read the file, or jetserve's defaults only
# The file's name -> the request field it is the default of.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "min_p": "min_p", "repetition_penalty": "repetition_penalty",
          "max_new_tokens": "max_tokens"}
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationDefaults:
    """The model's defaults for request fields; None: the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # the file's max_new_tokens
    source: str | None = None  # the file they were read from

    def given(self) -> dict[str, Any]:
        """{request field: default} for the fields the model sets."""
        return {f: getattr(self, f) for f in FIELDS.values() if getattr(self, f) is not None}

    def describe(self) -> str:
        """The defaults as the file names them, e.g. "temperature=0.6, top_k=20"."""
        names = {ours: theirs for theirs, ours in FIELDS.items()}
        return ", ".join(f"{names[f]}={v!r}" for f, v in self.given().items())


# The file's field -> (integer?, lowest, highest, whether the lowest is excluded):
# the ranges a request may give (engines.SamplingParams, Request.max_tokens).
_RANGES = {"temperature": (False, 0.0, 100.0, False), "top_p": (False, 0.0, 1.0, True),
           "top_k": (True, -1, _INT32_MAX, False), "min_p": (False, 0.0, 1.0, False),
           "repetition_penalty": (False, 1e-3, 100.0, False),
           "max_new_tokens": (True, 1, _INT32_MAX, False)}


def read(model_dir: str | None, mode: str = "auto") -> GenerationDefaults:
    """The defaults `model_dir`'s generation_config.json gives (none for mode "vllm", a
    directory without the file, or a model that is no directory: random:NAME). A field
    of the wrong type or range is a ValueError naming the file and the field."""
    if mode not in MODES:
        raise ValueError(f"--generation-config must be one of {list(MODES)}, got {mode!r}")
    if mode == "vllm" or not (model_dir and os.path.isdir(model_dir)):
        return GenerationDefaults()
    path = os.path.join(model_dir, FILE)
    raw = read_json_object(path)
    values = {FIELDS[k]: _checked(path, k, raw[k]) for k in FIELDS if raw.get(k) is not None}
    return GenerationDefaults(**values, source=path if values else None)


def _checked(path: str, name: str, value: Any) -> float | int:
    integer, lo, hi, open_lo = _RANGES[name]
    kind = "an integer" if integer else "a number"
    ok = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
        and not isinstance(value, bool)
    if ok and not integer:
        ok = math.isfinite(value)
    if ok:
        ok = (lo < value if open_lo else lo <= value) and value <= hi
    if not ok:
        low = f"({lo}" if open_lo else f"[{lo}"
        raise ValueError(f"{path}: {name} must be {kind} in {low}, {hi}], got {value!r} "
                         "(fix the file, or start with --generation-config vllm to ignore "
                         "it)")
    return value if integer else float(value)


def resolve(request: Mapping[str, Any], model: GenerationDefaults,
            engine: Mapping[str, Any], *, room: int | None = None) -> dict[str, Any]:
    """Each field of `engine`: the request's value where it is not None, else the model's
    default, else `engine`'s (the request path's own default). `room`: the tokens a
    prompt leaves to generate; a model's max_new_tokens default above it is cut to it
    (as vLLM does), so a request that asks for nothing is never refused for it."""
    defaults = model.given()
    out = {}
    for field, fallback in engine.items():
        value = request.get(field)
        if value is None:
            value = defaults.get(field, fallback)
            if field == "max_tokens" and room is not None and field in defaults:
                value = min(value, max(room, 1))
        out[field] = value
    return out
