"""Weights in and out: Hugging Face safetensors (one file or an index) and Orbax.

Weight names follow the source checkpoint: engines/hf_weights.py's table per family says
which HF tensor fills which parameter and how it is reshaped. A tensor published in MXFP4
(`<name>_blocks` and `<name>_scales`, gpt-oss's experts) is read as `<name>` kept MXFP4
where the decoder stores it so (ModelConfig.expert_quant: its bytes moved to the
[E, in, out] layout, engines/mxfp4.py), else decoded to floats. An FP8 block-quantized
weight (`<name>` with `<name>_scale_inv` beside it, engines/fp8_block.py) is decoded to
floats too, unless the model keeps it 8-bit (a {qvalue, scale} parameter: the two
tensors as stored).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from engines import fp8_block, mxfp4, ocdbt_reader
from engines.config import ModelConfig
from engines.hf_weights import HEAD, TOP, Transform, beyond_last_layer, layer_weights
from engines.quantization import kernel_scheme

ORBAX_PARAMS_DIR = "params"
ORBAX_MARKER = "jetserve_model.json"
ORBAX_FORMAT = "jetserve-orbax-v2"
# v1 stored every dense kernel input-major; v2 stores them as engines.model declares them
# (output-major). Kernel name -> the axis order that turns a v1 array into a v2 one.
_V1_TO_V2 = {"q_proj": (1, 2, 0), "k_proj": (1, 2, 0), "v_proj": (1, 2, 0),
             "o_proj": (2, 0, 1), "gate_proj": (1, 0), "up_proj": (1, 0),
             "down_proj": (1, 0), "lm_head": (1, 0)}
# What `jetserve convert` copies beside the weights (transformers 5 writes the chat
# template to chat_template.jinja, or .json, rather than into tokenizer_config.json).
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")



class SafetensorsReader:
    """Finds each tensor in a directory of safetensors files (with or without an index)."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open

        self.model_dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
        self._handles = {}
        self._where: dict[str, str] = {}
        for name in files:
            path = os.path.join(model_dir, name)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is listed in the index but does not exist")
            try:
                h = safe_open(path, framework="flax")
            except Exception as e:  # the library raises its own error types
                raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
            self._handles[name] = h
            for k in h.keys():
                self._where[k] = name
        if weight_map is not None:
            for k, fname in weight_map.items():
                if self._where.get(k) != fname:
                    raise ValueError(f"index says {k} is in {fname}, but it is not there")

    def keys(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"tensor {name!r} not found in the safetensors files of {self.model_dir}")
        fname = self._where[name]
        if self._handles[fname].get_slice(name).get_dtype() == "F8_E4M3":
            return _read_fp8(os.path.join(self.model_dir, fname), name)
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            return np.asarray(self._handles[fname].get_tensor(name))


def _read_fp8(path: str, name: str) -> np.ndarray:
    """A float8_e4m3fn tensor, read from the file's header and bytes (safetensors' numpy
    and flax readers have no such dtype)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
        start, end = info["data_offsets"]
        f.seek(8 + size + start)
        data = f.read(end - start)
    return np.frombuffer(data, fp8_block.FP8).reshape(info["shape"])


def _set(tree: dict, path: str, value: Any) -> None:
    keys = path.split("/")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def _get(tree: dict, path: str) -> Any:
    for k in path.split("/"):
        tree = tree[k]
    return tree


def fp8_block_size(model_dir: str, family: str) -> tuple[int, int] | None:
    """The FP8 weight block size config.json's quantization_config gives, if any."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        q = json.load(f).get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        return fp8_block.block_size(q, family)
    return None


def _read_float(reader: SafetensorsReader, name: str, block: tuple[int, int] | None,
                dtype: Any) -> tuple[np.ndarray, str | None]:
    """Tensor `name` as floats, and the name of the FP8 scale it was decoded with."""
    raw = reader.get(name)
    scale = name + fp8_block.SCALE_SUFFIX
    if scale not in reader:
        if raw.dtype == fp8_block.FP8:
            raise ValueError(f"{reader.model_dir}: tensor {name!r} is float8_e4m3fn without "
                             f"{scale!r} beside it")
        return raw, None
    if block is None:
        raise ValueError(f"{reader.model_dir}: tensor {scale!r} needs config.json's "
                         f"quantization_config with quant_method 'fp8' and weight_block_size")
    scales = fp8_block.scales_f32(reader.get(scale))
    return fp8_block.dequantize(raw, scales, block, dtype, name), scale


def _fp8_kernel(reader: SafetensorsReader, names: list[str], stacked: bool, fn: Transform,
                cfg: ModelConfig, block: tuple[int, int], want: dict,
                used: set[str]) -> dict[str, np.ndarray]:
    """{qvalue, scale} of one kernel kept in FP8 from its tensors `names` (`stacked`: the
    experts'); a tensor the checkpoint keeps at full precision is quantized here."""
    parts: dict[str, list[np.ndarray]] = {"qvalue": [], "scale": []}
    for n in names:
        scale = n + fp8_block.SCALE_SUFFIX
        q, s = ((reader.get(n), fp8_block.scales_f32(reader.get(scale))) if scale in reader
                else fp8_block.quantize(reader.get(n), block))
        parts["qvalue"].append(fn(q, cfg))
        parts["scale"].append(fn(s, cfg))
        used.update((n, scale))
    out = {k: np.stack(v) if stacked else v[0] for k, v in parts.items()}
    for k, arr in out.items():
        if tuple(arr.shape) != tuple(want[k].shape) or arr.dtype != want[k].dtype:
            raise ValueError(f"{reader.model_dir}: {names[0]!r} ({k}) is {arr.dtype}"
                             f"{arr.shape}, expected {want[k].dtype}{tuple(want[k].shape)} "
                             f"from config.json")
    return out


def _read_mxfp4(reader: SafetensorsReader, name: str, dtype: Any) -> Any:
    """Tensor `name` published as MXFP4, as [..., in, out]: decoded to `dtype`, or with
    dtype None kept 4-bit, {"qvalue": codes, "scale": exponents} (engines/quantization.py)."""
    blocks, scales = reader.get(f"{name}_blocks"), reader.get(f"{name}_scales")
    if dtype is not None:
        return mxfp4.dequantize_transposed(blocks, scales, dtype)
    codes, exponents = mxfp4.transpose_packed(blocks, scales)
    return {"qvalue": codes, "scale": exponents}


def _shapes(tree) -> Any:
    """An array's shape, or a {"qvalue", "scale"} pair's shapes."""
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def read_hf_params(
    model_dir: str,
    cfg: ModelConfig,
    abstract: dict,
    place: Callable[[str, np.ndarray], jax.Array],
) -> dict:
    """Reads HF safetensors into our param tree.

    abstract: our param tree of ShapeDtypeStructs (the expected shapes and dtypes).
    place: puts one host array onto devices (given our path), returning a jax.Array.
    """
    reader = SafetensorsReader(model_dir)
    present = reader.keys()
    used: set[str] = set()
    out: dict = {}
    last: tuple[str, Any] = ("", None)  # the last MXFP4 tensor decoded
    block = fp8_block_size(model_dir, cfg.family)
    table = list(TOP) + ([] if cfg.tie_word_embeddings else list(HEAD))
    rows = [(h.replace("{i}", str(i)), p.replace("{i}", str(i)), t)
            for i in range(cfg.num_layers) for h, p, t in layer_weights(cfg, i)]
    for hf_name, path, fn in table + rows:
        want = _get(abstract, path)
        packed = isinstance(want, dict)  # kept MXFP4: {"qvalue": codes, "scale": exponents}
        names = ([hf_name.replace("{e}", str(e)) for e in range(cfg.num_experts)]
                 if "{e}" in hf_name else [hf_name])
        if packed and kernel_scheme(cfg, path.rsplit("/", 1)[-1])[0] == "fp8_block":
            # an FP8 kernel kept 8-bit
            _set(out, path, {k: place(f"{path}/{k}", v) for k, v in _fp8_kernel(
                reader, names, "{e}" in hf_name, fn, cfg, block, want, used).items()})
            continue
        parts = []
        for n in names:
            mx = (f"{n}_blocks", f"{n}_scales")
            if n not in present and not set(mx) <= present:
                raise ValueError(
                    f"{model_dir}: tensor {n!r} is missing from the safetensors files "
                    f"(family {cfg.family})"
                )
            if packed and n in present:
                raise ValueError(f"{model_dir}: tensor {n!r} is stored as floats, but "
                                 f"config.json's quantization_config says MXFP4 ({mx[0]!r})")
            if n not in present:  # MXFP4 (read once for the rows that share it)
                if last[0] != n:
                    last = (n, _read_mxfp4(reader, n, None if packed else want.dtype))
                raw = last[1]
                used.update(mx)
            else:
                raw, scale = _read_float(reader, n, block, want.dtype)
                if scale:
                    used.add(scale)
            try:
                parts.append(jax.tree.map(lambda x, fn=fn: fn(x, cfg), raw))
            except ValueError:
                raise ValueError(
                    f"{model_dir}: tensor {n!r} has shape {_shapes(raw)}, which does not fit "
                    f"{path} of shape {_shapes(want)} from config.json"
                ) from None
            used.add(n)
        arr = jax.tree.map(lambda *p: np.stack(p), *parts) if "{e}" in hf_name else parts[0]
        if _shapes(arr) != _shapes(want):
            raise ValueError(
                f"{model_dir}: tensor {hf_name!r} has shape {_shapes(arr)} after mapping to "
                f"{path}, expected {_shapes(want)} from config.json"
            )
        _set(out, path, place(path, jax.tree.map(lambda x, w: x.astype(w.dtype), arr, want)))
    extra = sorted(k for k in present - used
                   if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight"
                   and not beyond_last_layer(k, cfg))
    if extra:
        raise ValueError(
            f"{model_dir}: {len(extra)} tensors are not used by the {cfg.family} decoder, "
            f"e.g. {extra[:3]}"
        )
    return out


def save_orbax(params: dict, cfg: ModelConfig, to_dir: str, source_dir: str | None) -> None:
    """Writes params as an Orbax checkpoint plus our config and the tokenizer files."""
    import orbax.checkpoint as ocp

    to_dir = os.path.abspath(to_dir)
    os.makedirs(to_dir, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(to_dir, ORBAX_PARAMS_DIR), params, force=True)
    with open(os.path.join(to_dir, ORBAX_MARKER), "w") as f:
        json.dump({"format": ORBAX_FORMAT, "model": cfg.to_json()}, f, indent=1)
    if source_dir:
        for name in TOKENIZER_FILES + ("config.json",):
            src = os.path.join(source_dir, name)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(to_dir, name))


def is_orbax_dir(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, ORBAX_MARKER))


def _orbax_meta(model_dir: str) -> dict:
    path = os.path.join(model_dir, ORBAX_MARKER)
    with open(path) as f:
        try:
            meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    if meta.get("format") not in ("jetserve-orbax-v1", ORBAX_FORMAT):
        raise ValueError(f"{path}: unknown format {meta.get('format')!r}")
    return meta


def read_orbax_config(model_dir: str) -> ModelConfig:
    return ModelConfig.from_json(_orbax_meta(model_dir)["model"])


def _v1_order(path: tuple) -> tuple[int, ...] | None:
    """The v1 -> v2 axis order of the leaf at `path`, or None if v1 stored it as v2 does.
    A quantized kernel's qvalue moves like the kernel; so does an int4 scale (one entry
    per group, every axis kept), while an int8 scale holds only the output axes, whose
    order v2 keeps."""
    keys = [str(getattr(k, "key", k)) for k in path]
    if keys[-1] in _V1_TO_V2:
        return _V1_TO_V2[keys[-1]]
    if len(keys) > 1 and keys[-2] in _V1_TO_V2 and keys[-1] in ("qvalue", "scale"):
        return _V1_TO_V2[keys[-2]]
    return None


def read_orbax_params(model_dir: str, abstract_sharded: dict) -> dict:
    """Restores params straight onto the shardings given in `abstract_sharded`; a v1
    checkpoint's dense kernels are restored in their stored order and transposed. A small
    checkpoint is read without orbax (engines/ocdbt_reader.py)."""
    path = os.path.abspath(os.path.join(model_dir, ORBAX_PARAMS_DIR))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} not found: not an Orbax checkpoint written by jetserve convert")
    v1 = _orbax_meta(model_dir)["format"] == "jetserve-orbax-v1"

    def stored(p, a):  # the v1 shape and sharding of a v2 leaf
        order = _v1_order(p) if v1 else None
        if order is None or len(order) != len(a.shape):  # an int8 scale
            return a
        inv = [order.index(i) for i in range(len(order))]
        spec = tuple(a.sharding.spec) + (None,) * (len(order) - len(a.sharding.spec))
        sharding = jax.sharding.NamedSharding(a.sharding.mesh,
                                              jax.sharding.PartitionSpec(*(spec[j] for j in inv)))
        return jax.ShapeDtypeStruct(tuple(a.shape[j] for j in inv), a.dtype, sharding=sharding)

    target = jax.tree_util.tree_map_with_path(stored, abstract_sharded)
    shardings = jax.tree.map(lambda a: a.sharding, abstract_sharded)
    host = ocdbt_reader.read_small(path, target)
    if host is not None:  # transposed on the host, then placed: no program to compile
        if v1:
            host = jax.tree_util.tree_map_with_path(_to_v2, host)
        return jax.device_put(host, shardings)
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(path, target)
    except Exception as e:  # orbax raises many types; name the checkpoint and the cause
        raise ValueError(f"cannot restore Orbax checkpoint {path}: {e}") from e
    if not v1:
        return params
    return jax.jit(lambda t: jax.tree_util.tree_map_with_path(_to_v2, t),
                   out_shardings=shardings, donate_argnums=0)(params)


def _to_v2(path: tuple, x):
    """A v1 leaf (a numpy array on the host or a jax array) in v2's axis order."""
    order = _v1_order(path)
    return x if order is None or x.ndim != len(order) else x.transpose(order)
