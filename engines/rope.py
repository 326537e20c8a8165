"""RoPE frequencies per layer kind (host math over a ModelConfig): plain, Llama 3.1,
linear, YaRN and LongRoPE, on the rotary dims of each head."""

from __future__ import annotations

import math

from engines.config import FULL, SLIDING, ModelConfig, RopeScaling, yarn_mscale


def rope_tables(cfg: ModelConfig, kind: str = FULL) -> tuple[list[list[float]], float]:
    """RoPE of layers of `kind` (host math): (two rows of inverse frequencies, R/2 each
    for the R = cfg.rotary_dim rotated dims: row 0 for positions below the switch
    position, row 1 at and after it; equal but for LongRoPE's short and long factors,
    whose switch is original_max_position_embeddings), and the factor on cos and sin
    (YaRN's and LongRoPE's attention factor; 1 otherwise)."""
    R = cfg.rotary_dim
    theta = cfg.rope_theta
    rs = cfg.rope_scaling
    if kind == SLIDING and cfg.local_rope_theta is not None:
        theta, rs = cfg.local_rope_theta, None  # Gemma 3's local layers: plain RoPE
    inv = [1.0 / (theta ** (i / R)) for i in range(0, R, 2)]
    if rs is None:
        return [inv, inv], 1.0
    if rs.kind == "linear":
        inv = [f / rs.factor for f in inv]
        return [inv, inv], 1.0
    if rs.kind == "llama3":
        inv = _llama3(inv, rs)
        return [inv, inv], 1.0
    if rs.kind == "yarn":
        att = rs.attention_factor if rs.attention_factor is not None else yarn_mscale(rs.factor)
        return [_yarn(inv, rs, theta, R)] * 2, att
    att = rs.attention_factor
    if att is None:
        orig = rs.original_max_position_embeddings
        att = 1.0 if rs.factor <= 1 else math.sqrt(1 + math.log(rs.factor) / math.log(orig))
    for name in ("short_factor", "long_factor"):
        if len(getattr(rs, name)) != R // 2:
            raise ValueError(f"longrope {name} has {len(getattr(rs, name))} entries; the "
                             f"{R} rotary dims need {R // 2}")
    return [[f / s for f, s in zip(inv, rs.short_factor, strict=True)],
            [f / s for f, s in zip(inv, rs.long_factor, strict=True)]], att


def _yarn(inv: list[float], rs: RopeScaling, theta: float, R: int) -> list[float]:
    """YaRN: each frequency between its extrapolated (as trained) and interpolated
    (/ factor) value, by a linear ramp over the dims whose wavelengths fall between
    beta_fast and beta_slow rotations in the original context."""
    def dim_of(rotations):
        return (R * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    out = []
    for i, f in enumerate(inv):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        keep = 1.0 - ramp  # the share of the extrapolated frequency
        out.append(f / rs.factor * (1 - keep) + f * keep)
    return out


def _llama3(inv: list[float], rs: RopeScaling) -> list[float]:
    """Llama 3.1's scaling: long wavelengths / factor, short ones kept, a smooth blend
    between."""
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
        elif wl > low_wl:
            out.append(f / rs.factor)
        else:
            smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            out.append((1 - smooth) * f / rs.factor + smooth * f)
    return out
