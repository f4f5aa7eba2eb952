"""Rotary position embeddings (Su et al., arXiv:2104.09864) in Hugging Face's "rotate half" layout,
with the frequency rescalings real checkpoints use.

For a head of width d the inverse frequencies are f_i = theta^(-2i/d), i < d/2, and

    rope(x, p) = (x1 cos(p f) - x2 sin(p f),  x2 cos(p f) + x1 sin(p f))

for the halves (x1, x2) of x. Rescalings change only f:

* linear: f / factor.
* llama3 (Llama 3.1, Meta's published rule): with wavelength w = 2 pi / f, L the original
  context, l = L / low_freq_factor and h = L / high_freq_factor,
  w < h: f (high frequencies kept);  w > l: f / factor;  between:
  (1 - s) f / factor + s f  with  s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stoker.spec import RopeScaling


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """The d/2 inverse frequencies, in float64 on the host (constants of the compiled program)."""
    freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None:
        return freq
    if scaling.type == "linear":
        return freq / scaling.factor
    context = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / freq
    smooth = (context / wavelength - low) / (high - low) if high != low else np.zeros_like(freq)
    blended = (1 - smooth) * freq / scaling.factor + smooth * freq
    out = np.where(wavelength > context / low, freq / scaling.factor, blended)
    return np.where(wavelength < context / high, freq, out)


def rotary(x: jax.Array, positions: jax.Array, inv_freq: Sequence[float] | np.ndarray) -> jax.Array:
    """``x`` [B, T, H, D] rotated by ``positions`` [B, T]; computed in float32."""
    dim = x.shape[-1]
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : dim // 2], x32[..., dim // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
