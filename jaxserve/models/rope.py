"""Rotary position embeddings: inverse frequencies for the RoPE variants found in Hugging Face configs.

The frequency tables are computed once on the host (numpy, float32 like the reference implementation) from
the config's `rope_parameters`; the device side only multiplies positions by them. Supported `rope_type`s:
`default`, `linear`, `llama3`, `yarn`. Others (`dynamic`, `longrope`, ...) are rejected with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RopeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeSpec:
    """Static RoPE description of one attention layer."""

    inv_freq: tuple[float, ...]  # [rotary_dim // 2]
    attention_scaling: float  # multiplies cos and sin (YaRN's mscale); 1.0 otherwise
    interleave: bool = False  # DeepSeek `rope_interleave`: input pairs (x0, x1), (x2, x3), ...

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def rope_spec(params: dict, head_dim: int, max_position_embeddings: int, interleave: bool = False,
              default_partial: float = 1.0) -> RopeSpec:
    """Build the RoPE spec from one `rope_parameters` dict (already merged with `rope_theta`)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise RopeConfigError(
            f"rope_parameters.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    base = float(params.get("rope_theta", 10000.0))
    partial = float(params.get("partial_rotary_factor", default_partial))
    dim = int(head_dim * partial)
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(base) ** exps)).astype(np.float32)
    scaling = 1.0

    def need(key):
        if key not in params:
            raise RopeConfigError(f"rope_parameters.{key} is required for rope_type={rope_type!r}")
        return params[key]

    if rope_type == "linear":
        inv_freq = inv_freq / np.float32(need("factor"))
    elif rope_type == "llama3":
        factor, low, high = float(need("factor")), float(need("low_freq_factor")), float(need("high_freq_factor"))
        old_ctx = float(need("original_max_position_embeddings"))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope_type == "yarn":
        orig = float(need("original_max_position_embeddings"))
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_position_embeddings / orig
        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(rot):
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap_factor = 1 - ramp
        pos_freqs = np.float32(base) ** exps
        inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrap_factor) + (1.0 / pos_freqs) * extrap_factor)
        inv_freq = inv_freq.astype(np.float32)
        scaling = float(attention_factor)
    return RopeSpec(tuple(float(f) for f in inv_freq), scaling, interleave)


def yarn_softmax_mscale(params: dict) -> float:
    """DeepSeek's extra softmax-scale factor (mscale_all_dim squared) for YaRN-scaled MLA."""
    if params.get("rope_type", "default") == "default":
        return 1.0
    m = params.get("mscale_all_dim", 0)
    if not m:
        return 1.0
    factor = float(params["factor"])
    ms = 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    return ms * ms


def apply_rope(x, positions, spec: RopeSpec):
    """Rotate the first `spec.rotary_dim` features of x.

    x: [B, T, H, D]; positions: [B, T] int32 -> [B, T, H, D]
    """
    inv = jnp.asarray(spec.inv_freq, jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, T, R/2]
    cos = (jnp.cos(freqs) * spec.attention_scaling)[:, :, None, :]
    sin = (jnp.sin(freqs) * spec.attention_scaling)[:, :, None, :]
    rd = spec.rotary_dim
    rot, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    if spec.interleave:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out
