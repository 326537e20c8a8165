"""Weight quantization: int8 per output channel and int4 group-wise, both symmetric;
and MXFP4, the form gpt-oss publishes its experts in.

Storage. A quantized matmul kernel W (laid out as the decoder uses it: [out..., in...],
or [E, in, out] for MoE experts) becomes a subtree `{"qvalue": int8[...], "scale":
f32[...]}` at W's path:

  int8  one scale per output channel: max |W| over the input axes / 127; qvalue has W's
        shape.
  int4  one scale per group of `group` consecutive elements along the kernel's last
        input axis: max |W| in the group / 7; values in [-8, 7] are packed two per byte
        along that same axis (element 2j in the low nibble, 2j+1 in the high one), so
        qvalue has that axis halved and each byte stays on the device of its elements.
  fp8_block  FP8 block checkpoints kept 8-bit (engines/fp8_block.py): qvalue
        float8_e4m3fn of W's shape, one scale per `group` x `group` block of the last two
        axes (the published [out, in] matrix, or its transpose for experts); only the MLP
        and expert kernels (FP8_BLOCK_KERNELS), the others are dequantized as they load.
  mxfp4 the OCP microscaling format (engines/mxfp4.py): 4-bit float codes (FP4 E2M1)
        packed two per byte along the last input axis as int4 packs them, qvalue
        uint8; one power-of-two scale per block of 32 along that axis, stored as its
        biased exponent (E8M0: uint8, 2^(scale - 127)). Used for the MoE experts
        (ModelConfig.expert_quant), read byte for byte from a gpt-oss checkpoint.

Logical axis names: qvalue keeps W's names (a packed axis keeps its name and splits over
the same mesh axis as before); a scale keeps the names of the dimensions it has, so it
splits with its channel (an int4 group axis keeps the input axis's name).

Dequantization happens inside the jitted model, right before each matmul
(`QuantizedKernel`): XLA sees convert * scale feeding the dot and fuses it where the
backend allows; no float copy of the weights exists outside jit. Only matmul kernels are
quantized: the embedding table (a gather, and Gemma's tied LM head), norms, biases and
the MoE router stay in the model dtype.

On XLA CPU this saves memory, not time: int8 -> f32 dequantize-then-dot is slower than a
plain f32 dot (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from engines import fp8_block, layer_scan, mxfp4

SCHEMES = ("none", "int8", "int4", "fp8_block")  # --quantize's choices (weight_quant)
MXFP4 = "mxfp4"  # expert_quant's
DEFAULT_GROUP = 32
QVALUE, SCALE = "qvalue", "scale"
EXPERT_KERNELS = ("w1", "w3", "w2")

# Kernel name -> its input (contracted) axes, for every kernel the decoder may quantize.
KERNEL_INPUT_AXES: dict[str, tuple[int, ...]] = {
    "q_proj": (2,),  # [N, H, D]
    "k_proj": (2,),  # [K, H, D]
    "v_proj": (2,),  # [K, H, D]
    "o_proj": (1, 2),  # [D, N, H]
    "gate_proj": (1,),  # [F, D]
    "up_proj": (1,),  # [F, D]
    "down_proj": (1,),  # [D, F]
    "w1": (1,),  # [E, D, F]
    "w3": (1,),  # [E, D, F]
    "w2": (1,),  # [E, F, D]
    "lm_head": (1,),  # [V, D]
    # multi-head latent attention (deepseek_v3; its o_proj is o_proj's [D, N, E])
    "q_a_proj": (1,),  # [Q, D]
    "q_b_proj": (2,),  # [N, A + P, Q]
    "kv_a_proj_with_mqa": (1,),  # [R + P, D]
    "kv_b_proj": (2,),  # [N, A + E, R]
}


FP8_BLOCK_KERNELS = ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")


def quantizes(scheme: str, name: str) -> bool:
    """Whether `scheme` stores kernel `name` quantized."""
    return (scheme != "none" and name in KERNEL_INPUT_AXES
            and (scheme != "fp8_block" or name in FP8_BLOCK_KERNELS))


def kernel_scheme(cfg: Any, name: str) -> tuple[str, int]:
    """(scheme, group) kernel `name` is stored with under ModelConfig `cfg`: the experts'
    by cfg.expert_quant where set, every other kernel by cfg.weight_quant where that
    scheme covers it ("none" where not)."""
    if name in EXPERT_KERNELS and cfg.expert_quant != "none":
        return cfg.expert_quant, mxfp4.BLOCK
    if not quantizes(cfg.weight_quant, name):
        return "none", cfg.quant_group_size
    return cfg.weight_quant, cfg.quant_group_size


def check_scheme(field: str, scheme: str, group: int) -> None:
    """Validates a (scheme, group size) pair; errors name `field`."""
    if scheme not in SCHEMES:
        raise ValueError(f"{field} must be one of {SCHEMES}, got {scheme!r}")
    if not isinstance(group, int) or isinstance(group, bool) or group < 2 or group % 2:
        raise ValueError(f"{field} group size must be an even integer >= 2, got {group!r}")


def group_for(n_in: int, group: int) -> int:
    """The group actually used along an input axis of n_in: the largest divisor of n_in
    that divides `group` (so a head_dim of 16 with group 32 gives groups of 16)."""
    return math.gcd(group, n_in)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shapes and logical names of one quantized kernel's two arrays."""

    qshape: tuple[int, ...]
    sshape: tuple[int, ...]
    snames: tuple[str | None, ...]
    group: int  # int4, mxfp4: elements per scale along the last input axis; int8: 0
    qdtype: Any = jnp.int8
    sdtype: Any = jnp.float32


def layout(shape: Sequence[int], names: Sequence[str | None], in_axes: Sequence[int],
           scheme: str, group: int, tensor: str = "kernel") -> Layout:
    shape, names = tuple(shape), tuple(names)
    if scheme == "fp8_block":
        return Layout(shape, fp8_block.scale_grid(shape, (group, group)), names, group,
                      fp8_block.FP8)
    if scheme == "int8":
        keep = [i for i in range(len(shape)) if i not in in_axes]
        return Layout(shape, tuple(shape[i] for i in keep), tuple(names[i] for i in keep), 0)
    a = in_axes[-1]
    n = shape[a]
    if scheme == MXFP4 and n % mxfp4.BLOCK:
        raise ValueError(f"{tensor}: mxfp4 scales blocks of {mxfp4.BLOCK} along input "
                         f"dimension {a} of size {n}, which must be a multiple of "
                         f"{mxfp4.BLOCK}")
    if n % 2:
        raise ValueError(f"{tensor}: int4 packs two values per byte along input dimension "
                         f"{a} of size {n}, which must be even")
    g = mxfp4.BLOCK if scheme == MXFP4 else group_for(n, group)
    qshape = shape[:a] + (n // 2,) + shape[a + 1:]
    sshape = shape[:a] + (n // g,) + shape[a + 1:]
    if scheme == MXFP4:
        return Layout(qshape, sshape, names, g, jnp.uint8, jnp.uint8)
    return Layout(qshape, sshape, names, g)


# ---- quantize (host numpy or device jax.numpy: `xp`) ----------------------------------


def quantize(w: Any, in_axes: Sequence[int], scheme: str, group: int,
             xp: Any = np) -> tuple[Any, Any]:
    """W -> (qvalue, scale) as described in the module docstring."""
    if scheme == "fp8_block":
        return fp8_block.quantize(w, (group, group), xp)
    w = w.astype(xp.float32)
    if scheme == MXFP4:
        return _quantize_mxfp4(w, in_axes[-1], xp)
    if scheme == "int8":
        amax = xp.max(xp.abs(w), axis=tuple(in_axes), keepdims=True)
        scale = amax / 127.0
        safe = xp.where(scale > 0, scale, 1.0)
        q = xp.clip(xp.round(w / safe), -127, 127).astype(xp.int8)
        return q, xp.squeeze(scale, axis=tuple(in_axes)).astype(xp.float32)
    a = in_axes[-1]
    n = w.shape[a]
    lay = layout(w.shape, (None,) * w.ndim, in_axes, scheme, group)
    g = lay.group
    wg = w.reshape(w.shape[:a] + (n // g, g) + w.shape[a + 1:])
    amax = xp.max(xp.abs(wg), axis=a + 1, keepdims=True)
    scale = amax / 7.0
    safe = xp.where(scale > 0, scale, 1.0)
    q = xp.clip(xp.round(wg / safe), -8, 7).astype(xp.int8).reshape(w.shape)
    packed = pack_nibbles(q.astype(xp.uint8) & 0x0F, a, xp)
    packed = packed.view(np.int8) if xp is np else jax.lax.bitcast_convert_type(packed, jnp.int8)
    return packed, xp.squeeze(scale, axis=a + 1).astype(xp.float32)


def _quantize_mxfp4(w: Any, a: int, xp: Any) -> tuple[Any, Any]:
    """f32 W -> (u8 codes packed along axis a, u8 biased exponents per block of 32): the
    OCP rule, a block's exponent floor(log2 max|W|) - 2 (6.0, the largest code, is
    1.5 * 2^2), each value then rounded to its nearest code (clipped at +-6)."""
    n = w.shape[a]
    wg = w.reshape(w.shape[:a] + (n // mxfp4.BLOCK, mxfp4.BLOCK) + w.shape[a + 1:])
    amax = xp.max(xp.abs(wg), axis=a + 1, keepdims=True)
    e = xp.floor(xp.log2(xp.where(amax > 0, amax, 1.0))) - 2
    e = xp.clip(e, -mxfp4.SCALE_BIAS, mxfp4.SCALE_BIAS).astype(xp.int32)
    x = xp.ldexp(wg, -e)
    # Midpoints between the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 -> their codes 0..7.
    mids = xp.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], xp.float32)
    mag = xp.searchsorted(mids, xp.abs(x).reshape(-1)).reshape(x.shape).astype(xp.uint8)
    codes = (mag | (xp.signbit(x).astype(xp.uint8) << 3)).reshape(w.shape)
    scale = xp.squeeze(e + mxfp4.SCALE_BIAS, axis=a + 1).astype(xp.uint8)
    return pack_nibbles(codes, a, xp), scale


def pack_nibbles(nibbles: Any, a: int, xp: Any = np) -> Any:
    """u8 values < 16 -> u8 bytes, two per byte along axis a (element 2j low, 2j+1 high)."""
    pairs = nibbles.reshape(nibbles.shape[:a] + (nibbles.shape[a] // 2, 2)
                            + nibbles.shape[a + 1:])
    return xp.take(pairs, 0, axis=a + 1) | (xp.take(pairs, 1, axis=a + 1) << 4)


def _interleave(lo: jax.Array, hi: jax.Array, axis: int) -> jax.Array:
    """Element j of lo and of hi -> elements 2j and 2j + 1: `axis` doubled."""
    both = jnp.stack([lo, hi], axis=axis + 1)
    return both.reshape(lo.shape[:axis] + (lo.shape[axis] * 2,) + lo.shape[axis + 1:])


def unpack_int4(packed: jax.Array, axis: int) -> jax.Array:
    """int8 bytes holding two signed nibbles -> int8 values, `axis` doubled."""
    lo = jnp.right_shift(jnp.left_shift(packed, 4), 4)  # arithmetic: sign-extends
    return _interleave(lo, jnp.right_shift(packed, 4), axis)


def dequantize_mxfp4(qvalue: jax.Array, scale: jax.Array, axis: int, dtype: Any) -> jax.Array:
    """u8 packed codes and u8 exponents (blocks of 32 along `axis`) -> W in `dtype`, by a
    16-entry table and a power of two (exact in bfloat16 and float32: one mantissa bit
    times 2^k)."""
    codes = _interleave(qvalue & 0x0F, qvalue >> 4, axis)
    values = jnp.asarray(mxfp4.FP4_VALUES, dtype)[codes]
    # 2^(e - 127) built from its bits (exp2 may round); e = 0 is the subnormal 2^-127.
    bits = jax.lax.shift_left(scale.astype(jnp.uint32), jnp.uint32(23))
    pow2 = jnp.where(scale == 0, np.float32(2.0 ** -127),
                     jax.lax.bitcast_convert_type(bits, jnp.float32)).astype(dtype)
    n = codes.shape[axis]
    vg = values.reshape(codes.shape[:axis] + (n // mxfp4.BLOCK, mxfp4.BLOCK)
                        + codes.shape[axis + 1:])
    return (vg * jnp.expand_dims(pow2, axis + 1)).reshape(codes.shape)


def dequantize(qvalue: jax.Array, scale: jax.Array, in_axes: Sequence[int], scheme: str,
               group: int, dtype: Any) -> jax.Array:
    """(qvalue, scale) -> W in `dtype`; meant to run inside jit, next to its matmul."""
    # The product is taken in f32 (a bf16 scale would add up to 0.4% error), then cast.
    if scheme == "fp8_block":
        return fp8_block.scaled(qvalue, scale, (group, group), jnp).astype(dtype)
    if scheme == "int8":
        w = qvalue.astype(jnp.float32) * jnp.expand_dims(scale, tuple(in_axes))
        return w.astype(dtype)
    a = in_axes[-1]
    if scheme == MXFP4:
        return dequantize_mxfp4(qvalue, scale, a, dtype)
    q = unpack_int4(qvalue, a)
    n = q.shape[a]
    g = n // scale.shape[a]
    qg = q.reshape(q.shape[:a] + (n // g, g) + q.shape[a + 1:])
    w = qg.astype(jnp.float32) * jnp.expand_dims(scale, a + 1)
    return w.reshape(q.shape).astype(dtype)


# ---- the decoder side -------------------------------------------------------------------


class QuantizedKernel(nn.Module):
    """Declares one kernel's qvalue and scale (with logical names) and returns the
    dequantized kernel. Initial values are placeholders: quantized weights always come
    from quantizing float ones (`quantize_params`) or from a quantized checkpoint."""

    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    in_axes: tuple[int, ...]
    scheme: str
    group: int
    dtype: Any

    @nn.compact
    def __call__(self, at: layer_scan.Layer | None = None) -> jax.Array:
        """at: in a scanned layer, qvalue and scale are stacked for all layers and only
        this layer's slices are dequantized."""
        lay = layout(self.shape, self.names, self.in_axes, self.scheme, self.group,
                     self.name or "kernel")
        q = layer_scan.param(self, QVALUE, nn.initializers.zeros, lay.qshape, self.names,
                             lay.qdtype, at)
        s = layer_scan.param(self, SCALE, nn.initializers.ones, lay.sshape, lay.snames,
                             lay.sdtype, at)
        return dequantize(q, s, self.in_axes, self.scheme, self.group, self.dtype)


def quantized_kernel(mod: nn.Module, name: str, shape: tuple[int, ...],
                     names: tuple[str | None, ...], dtype: Any,
                     at: layer_scan.Layer | None = None) -> jax.Array:
    """For the decoder: kernel `name` of `mod`, stored as `kernel_scheme` says (`at`:
    the layer of a scanned block, engines/layer_scan.py)."""
    scheme, group = kernel_scheme(mod.cfg, name)
    return QuantizedKernel(tuple(shape), tuple(names), KERNEL_INPUT_AXES[name], scheme,
                           group, dtype, name=name, parent=mod)(at)


def with_weight_quant(cfg: Any, scheme: str, group: int) -> Any:
    """The ModelConfig whose params hold weights quantized by `scheme` ("none": as is).

    A config that already describes quantized storage (an Orbax checkpoint written by
    `jetserve convert --quantize`) keeps it; asking for another scheme is an error, since
    quantized weights cannot be requantized without loss.
    """
    check_scheme("quantize", scheme, group)
    if scheme == "none":
        return cfg
    stored = (cfg.weight_quant, cfg.quant_group_size if cfg.weight_quant == "int4" else None)
    wanted = (scheme, group if scheme == "int4" else None)
    if cfg.weight_quant != "none":
        if stored != wanted:
            raise ValueError(
                f"quantize: the checkpoint holds {cfg.weight_quant} weights"
                f"{f' (group {cfg.quant_group_size})' if cfg.weight_quant == 'int4' else ''}; "
                f"cannot load them as {scheme}"
                f"{f' (group {group})' if scheme == 'int4' else ''}; convert from the "
                f"float weights instead")
        return cfg
    return dataclasses.replace(cfg, weight_quant=scheme, quant_group_size=group)


def quantize_params(params: dict, scheme: str, group: int, xp: Any = jnp,
                    kernels: Sequence[str] = tuple(KERNEL_INPUT_AXES)) -> dict:
    """A float param tree -> the same tree with every matmul kernel named in `kernels`
    quantized (one already quantized is left as it is)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = quantize_params(v, scheme, group, xp, kernels)
        elif k in kernels and quantizes(scheme, k):
            q, s = quantize(v, KERNEL_INPUT_AXES[k], scheme, group, xp)
            out[k] = {QVALUE: q, SCALE: s}
        else:
            out[k] = v
    return out


def dequantize_params(params: dict, scheme: str, dtype: Any = jnp.float32,
                      expert_quant: str = "none", group: int = 0) -> dict:
    """The inverse, for tests and quality reports (materialises every kernel); the
    experts' kernels by `expert_quant` where set; `group`: fp8_block's block size
    (int4's groups are read from the shapes)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict) and set(v) == {QVALUE, SCALE}:
            s = expert_quant if k in EXPERT_KERNELS and expert_quant != "none" else scheme
            out[k] = dequantize(v[QVALUE], v[SCALE], KERNEL_INPUT_AXES[k], s, group, dtype)
        elif isinstance(v, dict):
            out[k] = dequantize_params(v, scheme, dtype, expert_quant, group)
        else:
            out[k] = v
    return out


def param_bytes(params: Any) -> int:
    """Bytes the param arrays occupy (int4 values count their packed bytes)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
