"""Which attention kernel the training forward uses, and the wrappers around the accelerator ones.

Every kernel computes the function ``stoker.model.attention`` defines (masked grouped-query
attention over packed rows, optional sliding window and soft-cap); they differ in memory and speed:

    blockwise  ``attention.attention``: query blocks under jax.checkpoint, O(T * block) memory;
               runs everywhere and supports everything.
    xla        ``jax.nn.dot_product_attention(implementation="xla")``: the dense reference form,
               [B, H, T, S] float32 scores in memory; no soft-cap.
    cudnn      the same API with ``implementation="cudnn"``: cuDNN's fused flash attention on an
               NVIDIA GPU; bfloat16/float16 only, head dim a multiple of 8 (<= 128, <= 256 from
               Hopper on), no soft-cap.
    splash     Pallas' splash attention on a TPU: segment ids, causal and local masks and the
               soft-cap are native.

``auto`` picks per backend (splash on TPU, cuDNN on an NVIDIA GPU, blockwise elsewhere) and falls
back to blockwise, with a logged reason, where the model needs what the kernel lacks. A kernel
asked for by name that this backend cannot run is refused (``AttentionUnavailable``).

The accelerator kernels serve self-attention over packed rows (``packed_visibility``: query and
key indices are the token indices, so "causal" is the token order); the sampler's KV-cached
extend and decode steps always use the blockwise form, whose ``Visibility`` is general.
"""

from __future__ import annotations

import contextlib
import math
import contextvars
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from stoker.model.attention import Visibility, attention, visible

log = logging.getLogger(__name__)

Implementation = Literal["blockwise", "xla", "cudnn", "splash"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)
# Splash's query/key tile: rows are padded (as segment-0 padding) to a multiple of it.
SPLASH_BLOCK = 128
# The block splash computes in, the largest of these that divides the padded length, with the
# fused backward kernel. Measured on one TPU v5e chip (Qwen2.5-0.5B shape, GRPO grad step, bf16,
# remat full; benchmarks/README.md, "Splash block sizes on the v5e"): 128-token blocks 0.80 s at
# 4 x 2048 and 2.19 s at 1 x 8192; 512: 0.36 / 0.59 s; 1024 fused: 0.35 / 0.50 s; 2048 fused at
# 8192 needs 21.8 MiB of scoped VMEM, over the default 16 MiB. Other chips take the same table
# until measured.
SPLASH_BLOCKS = (1024, 512, 256, SPLASH_BLOCK)


def splash_block(length: int) -> int:
    """The block splash runs a padded ``length`` (a multiple of SPLASH_BLOCK) in."""
    return next(b for b in SPLASH_BLOCKS if length % b == 0)


# The mesh axis the caller's rows are split over, while it traces (``rows_split_over``).
_ROW_AXIS: contextvars.ContextVar[tuple[Mesh, str | tuple[str, ...]] | None] = contextvars.ContextVar("row_axis", default=None)


@contextlib.contextmanager
def rows_split_over(mesh: Mesh, axis: str | tuple[str, ...]) -> Iterator[None]:
    """While tracing inside this, splash runs on each device's rows under ``shard_map``: XLA's
    partitioner has no rule for the Pallas custom call and would otherwise gather every row onto
    every device. (jax's cuDNN attention has its own rule, ``custom_partitioning``.) ``axis``:
    the mesh axis (or axes) the rows split over."""
    token = _ROW_AXIS.set((mesh, axis))
    try:
        yield
    finally:
        _ROW_AXIS.reset(token)


class AttentionUnavailable(ValueError):
    """A named kernel that this backend cannot run."""


@dataclass(frozen=True)
class Backend:
    """What the kernel choice depends on: ``platform`` is jax's (cpu, gpu, tpu); ``vendor`` tells
    CUDA from ROCm on a gpu; ``compute_capability`` is an NVIDIA GPU's, e.g. "9.0"."""

    platform: str
    vendor: str = ""
    compute_capability: str | None = None

    @property
    def nvidia(self) -> bool:
        return self.platform == "gpu" and self.vendor == "cuda"


def detect_backend(device: Any | None = None) -> Backend:
    """The Backend of ``device`` (default: jax's first device)."""
    device = device or jax.devices()[0]
    version = str(getattr(device.client, "platform_version", "")).lower()
    vendor = "cuda" if "cuda" in version else "rocm" if "rocm" in version else ""
    return Backend(device.platform, vendor, getattr(device, "compute_capability", None))


@dataclass(frozen=True)
class Selection:
    implementation: Implementation
    reason: str  # why this one: shown in the learner's log


def select_attention(
    choice: str, backend: Backend, *, dtype: Any, head_dim: int, softcap: float | None
) -> Selection:
    """The kernel for ``choice`` on ``backend`` for a model of this dtype, head dim and soft-cap.

    Pure: the learner calls it with ``detect_backend()``, tests with a made-up Backend."""
    if choice not in ("auto", *IMPLEMENTATIONS):
        raise AttentionUnavailable(f"attention {choice!r}; expected one of auto, {', '.join(IMPLEMENTATIONS)}")
    if choice == "blockwise":
        return Selection("blockwise", "asked for")
    if choice == "cudnn" and not backend.nvidia:
        raise AttentionUnavailable(f"attention 'cudnn' needs an NVIDIA GPU; this backend is {_describe(backend)}")
    if choice == "splash" and backend.platform != "tpu":
        raise AttentionUnavailable(f"attention 'splash' needs a TPU; this backend is {_describe(backend)}")
    kernel, why = choice, "asked for"
    if choice == "auto":
        if backend.platform == "tpu":
            return Selection("splash", "auto on a TPU")
        if not backend.nvidia:
            return Selection("blockwise", f"auto on {_describe(backend)}")
        kernel, why = "cudnn", "auto on an NVIDIA GPU"
    problem = _unsupported(kernel, backend, np.dtype(dtype), head_dim, softcap)
    if problem:
        return Selection("blockwise", f"{kernel} cannot run this model ({problem}); falling back to blockwise")
    return Selection(kernel, why)  # type: ignore[arg-type]


def _describe(backend: Backend) -> str:
    return f"{backend.platform}{f' ({backend.vendor})' if backend.vendor else ''}"


def _unsupported(choice: str, backend: Backend, dtype: np.dtype, head_dim: int, softcap: float | None) -> str:
    if softcap is not None and choice in ("xla", "cudnn"):
        return "jax.nn.dot_product_attention has no attention logit soft-cap"
    if choice != "cudnn":
        return ""
    if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        return f"cuDNN flash attention takes bfloat16 or float16, not {dtype}"
    major = int(str(backend.compute_capability or "0").split(".")[0])
    limit = 256 if major >= 9 else 128
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN needs a head dim that is a multiple of 8 and <= {limit} on this GPU, not {head_dim}"
    return ""


def attend(
    implementation: Implementation,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: Visibility,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Self-attention over packed rows with ``implementation``: q [B, T, H, D], k/v [B, T, K, D]."""
    if implementation == "blockwise":
        return attention(q, k, v, vis, scale=scale, softcap=softcap, window=window)
    if implementation == "splash":
        return splash_attention(q, k, v, vis, scale=scale, softcap=softcap, window=window)
    if softcap is not None:  # select_attention never picks these for a soft-capped model
        raise AttentionUnavailable(f"{implementation} attention has no soft-cap")
    if implementation == "xla":
        return xla_attention(q, k, v, vis, scale=scale, window=window)
    if implementation == "cudnn":
        if q.shape[1] % 2:  # cuDNN's masked backward needs even lengths
            _log_once(f"cudnn: odd length {q.shape[1]}; blockwise for this shape")
            return attention(q, k, v, vis, scale=scale, window=window)
        return packed_sdpa(q, k, v, vis, scale=scale, window=window, implementation="cudnn")
    raise AttentionUnavailable(f"attention {implementation!r}; expected one of {', '.join(IMPLEMENTATIONS)}")


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


def xla_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, *, scale: float, window: int | None = None
) -> jax.Array:
    """``jax.nn.dot_product_attention`` (XLA) with the full [B, T, S] visibility as its mask:
    correct for any ``Visibility``, dense in memory."""
    mask = visible(vis, window)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


def packed_sdpa(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: Visibility,
    *,
    scale: float,
    window: int | None,
    implementation: Literal["xla", "cudnn"],
) -> jax.Array:
    """Packed self-attention in the arguments cuDNN accepts: its causal mask and left window
    (token order), plus the segment mask as a boolean [B, 1, T, S] mask. jax turns that mask into
    an additive bias in the compute dtype, so cuDNN's memory is O(T^2) bytes per row for the bias
    (2 bytes each, not the [H, T, S] float32 scores). ``implementation="xla"`` runs the same
    arguments on the CPU, which is how the tests check the mapping."""
    seg_q, seg_k = vis.q_segment[:, :, None], vis.k_segment[:, None, :]
    same_segment = (seg_q == seg_k) & (seg_q != 0)
    return jax.nn.dot_product_attention(
        q, k, v, mask=same_segment[:, None], scale=scale, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation=implementation,
    )


@functools.cache
def _splash_kernel(length: int, heads: int, window: int | None, softcap: float | None, interpret: bool) -> Any:
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (length, length)
    mask = sa.CausalMask(shape) if window is None else sa.LocalMask(shape, (window - 1, 0), 0)
    block = splash_block(length)
    # The fused backward computes dq with dk/dv in one kernel (its own dq blocks must be None).
    sizes = sa.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
    )
    with jax.ensure_compile_time_eval():  # the mask tables are constants, not values of the caller's trace
        return sa.make_splash_mha_single_device(
            sa.MultiHeadMask([mask] * heads), block_sizes=sizes, attn_logits_soft_cap=softcap, interpret=interpret
        )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: Visibility,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Pallas splash attention, vmapped over rows: segment ids from ``vis``, the causal or local
    mask from the token order. ``interpret`` (default: off a TPU) runs Pallas' interpreter, which
    is how the CPU tests run it; ``select_attention`` never picks splash off a TPU."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, heads, _ = q.shape
    pad = -t % SPLASH_BLOCK
    # Padded keys carry segment 0, which no real query has: they are never seen.
    length = t + pad

    def heads_first(x: jax.Array) -> jax.Array:  # [B, T, N, D] -> [B, N, length, D]
        return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)

    qs, ks = (jnp.pad(s, ((0, 0), (0, pad))) for s in (vis.q_segment, vis.k_segment))
    split = _ROW_AXIS.get()
    if interpret is None:
        # The devices the program is for: the caller's mesh when it names one (a TPU topology
        # compiled ahead of time on a CPU host, stoker plan), else jax's default backend.
        platform = split[0].devices.flat[0].platform if split is not None else jax.default_backend()
        interpret = platform != "tpu"
    kernel = _splash_kernel(length, heads, window, softcap, interpret)
    # Splash scales nothing itself: the soft-cap applies to the scaled scores, as here.
    run = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=SegmentIds(qs, ks)))
    row_axes = () if split is None else (split[1],) if isinstance(split[1], str) else split[1]
    if split is not None and math.prod(split[0].shape[a] for a in row_axes) > 1:
        rows = PartitionSpec(split[1])
        run = jax.shard_map(run, mesh=split[0], in_specs=(rows,) * 5, out_specs=rows, check_vma=False)
    out = run(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), qs, ks)
    return jnp.swapaxes(out, 1, 2)[:, :t].astype(q.dtype)
