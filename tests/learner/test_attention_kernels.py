"""Every attention kernel that runs on the CPU computes the masked grouped-query attention the
equation defines (packed segments, causal, sliding window, Gemma 2's soft-cap), forward and
gradient, jit and eager; ``auto`` picks per backend and a kernel a backend cannot run is refused.

Splash runs through Pallas' interpreter here; cuDNN cannot run on a CPU, so its argument mapping
(``packed_sdpa``) is checked on the XLA implementation of the same jax API."""

from __future__ import annotations

import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from stoker.learner import train
from stoker.learner.sharding import make_mesh
from stoker.model import attention as attention_module
from stoker.model import attention_kernels as ak
from stoker.model.attention import attention
from stoker.model.model import Transformer, packed_visibility
from stoker.spec import TransformerConfig
from tests.host_devices import run_on_host_devices

B, T, H, K, D = 2, 136, 4, 2, 16  # T: not a multiple of splash's 128-token tile
SCALE = 0.3


def reference(q: Any, k: Any, v: Any, segments: np.ndarray, *, softcap: float | None, window: int | None, xp: Any = np) -> Any:
    """out[b, t, h] = sum_s softmax_s(c tanh(SCALE q.k_s / c)) v_s over the keys s that query t
    sees: same nonzero segment, s <= t, t - s < window; head h reads kv head h // (H / K)."""
    t_idx, s_idx = np.arange(q.shape[1])[:, None], np.arange(q.shape[1])[None, :]
    seen = (s_idx <= t_idx) & (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] != 0)
    if window is not None:
        seen &= t_idx - s_idx < window
    kv = np.arange(H) // (H // K)
    scores = xp.einsum("bthd,bshd->bhts", q, k[:, :, kv]) * SCALE
    if softcap is not None:
        scores = softcap * xp.tanh(scores / softcap)
    scores = xp.where(seen[:, None], scores, -xp.inf)
    top = xp.max(xp.where(seen[:, None], scores, -1e30), axis=-1, keepdims=True)
    weights = xp.where(seen[:, None], xp.exp(scores - top), 0.0)
    probs = weights / xp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    return xp.einsum("bhts,bshd->bthd", probs, v[:, :, kv])


def _inputs() -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, D)), jnp.float32) for n in (H, K, K))
    segments = np.zeros((B, T), np.int32)
    segments[0, :50], segments[0, 50:120] = 1, 2  # two packed sequences, then padding
    segments[1, :130] = 1
    return q, k, v, segments


Kernel = Callable[..., jax.Array]
KERNELS: dict[str, Kernel] = {
    "blockwise": lambda q, k, v, vis, **kw: attention(q, k, v, vis, block=32, **kw),  # 5 query blocks
    "xla": lambda q, k, v, vis, softcap, **kw: ak.xla_attention(q, k, v, vis, **kw),
    "cudnn-arguments": lambda q, k, v, vis, softcap, **kw: ak.packed_sdpa(q, k, v, vis, implementation="xla", **kw),
    "splash": lambda q, k, v, vis, **kw: ak.splash_attention(q, k, v, vis, interpret=True, **kw),
}
MASKS = {"causal": (None, None), "window": (None, 37), "softcap+window": (5.0, 37)}
# Each kernel's mask forms once (splash: CausalMask, then LocalMask with the soft-cap); the first
# case of each kernel also runs eagerly.
CASES = {
    "blockwise": ["softcap+window", "causal"], "xla": ["window", "causal"], "cudnn-arguments": ["window"],
    "splash": ["softcap+window", "causal"],
}


@pytest.mark.parametrize(("kernel", "mask"), [(kernel, mask) for kernel, masks in CASES.items() for mask in masks])
def test_kernel_matches_the_reference_forward_and_gradient(kernel: str, mask: str) -> None:
    softcap, window = MASKS[mask]
    q, k, v, segments = _inputs()
    vis = packed_visibility(jnp.asarray(segments))
    real = jnp.asarray(segments != 0, jnp.float32)[:, :, None, None]  # padded queries' outputs are unspecified

    def loss(fn: Callable[..., Any], q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(real * jnp.sin(fn(q, k, v)))

    def run(q: Any, k: Any, v: Any) -> Any:
        return KERNELS[kernel](q, k, v, vis, scale=SCALE, softcap=softcap, window=window)

    got = jax.jit(run)(q, k, v)
    assert got.shape == q.shape and got.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(got)))
    want = reference(*(np.asarray(x, np.float64) for x in (q, k, v)), segments, softcap=softcap, window=window)
    np.testing.assert_allclose(np.asarray(got) * np.asarray(real), want * np.asarray(real), atol=2e-6, rtol=1e-5)

    ref_grads = jax.jit(jax.grad(
        lambda *a: loss(lambda *b: reference(*b, segments, softcap=softcap, window=window, xp=jnp), *a), argnums=(0, 1, 2)
    ))(q, k, v)
    variants = {"jit": jax.jit(jax.grad(lambda *a: loss(run, *a), argnums=(0, 1, 2)))}
    if mask == CASES[kernel][0]:  # eager: op by op, slow
        variants["eager"] = jax.grad(lambda *a: loss(run, *a), argnums=(0, 1, 2))
    for variant, grad in variants.items():
        for name, g, r in zip("qkv", grad(q, k, v), ref_grads, strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=f"{variant} d{name}")


@pytest.mark.parametrize(("length", "block"), [(120, 128), (136, 256), (500, 512), (1000, 1024)])
def test_splash_runs_every_block_of_its_table_as_the_reference(length: int, block: int) -> None:
    """Each block size the table picks (the padded length's largest), with the fused backward."""
    assert ak.splash_block(-(-length // ak.SPLASH_BLOCK) * ak.SPLASH_BLOCK) == block
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, n, D)), jnp.float32) for n in (H, K, K))
    segments = np.zeros((1, length), np.int32)
    segments[0, : length // 3], segments[0, length // 3 : length - 5] = 1, 2  # two sequences, then padding
    vis = packed_visibility(jnp.asarray(segments))
    real = jnp.asarray(segments != 0, jnp.float32)[:, :, None, None]

    def run(q: Any, k: Any, v: Any) -> Any:
        return ak.splash_attention(q, k, v, vis, scale=SCALE, interpret=True)

    want = reference(*(np.asarray(x, np.float64) for x in (q, k, v)), segments, softcap=None, window=None)
    np.testing.assert_allclose(np.asarray(jax.jit(run)(q, k, v)) * real, want * np.asarray(real), atol=2e-6, rtol=1e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(real * jnp.sin(run(*a))), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(
        lambda *a: jnp.sum(real * jnp.sin(reference(*a, segments, softcap=None, window=None, xp=jnp))), argnums=(0, 1, 2)
    ))(q, k, v)
    for name, g, r in zip("qkv", grads, ref, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_kernels_without_soft_cap_are_never_handed_one() -> None:
    q, k, v, segments = _inputs()
    with pytest.raises(ak.AttentionUnavailable, match="soft-cap"):
        ak.attend("xla", q, k, v, packed_visibility(jnp.asarray(segments)), scale=SCALE, softcap=5.0)


# ------------------------------------------------------------------------------------- selection

CPU, TPU = ak.Backend("cpu"), ak.Backend("tpu")
A100, H100, MI300 = ak.Backend("gpu", "cuda", "8.0"), ak.Backend("gpu", "cuda", "9.0"), ak.Backend("gpu", "rocm")


def _select(choice: str, backend: ak.Backend, dtype: Any = jnp.bfloat16, head_dim: int = 64,
            softcap: float | None = None) -> ak.Selection:
    return ak.select_attention(choice, backend, dtype=dtype, head_dim=head_dim, softcap=softcap)


@pytest.mark.parametrize(
    ("backend", "dtype", "head_dim", "softcap", "want"),
    [
        (TPU, jnp.float32, 64, 50.0, "splash"),  # splash takes every model
        (H100, jnp.bfloat16, 64, None, "cudnn"),
        (H100, jnp.bfloat16, 256, None, "cudnn"),
        (A100, jnp.bfloat16, 256, None, "blockwise"),  # head dim > 128 before Hopper
        (A100, jnp.float16, 72, None, "cudnn"),
        (H100, jnp.bfloat16, 60, None, "blockwise"),  # not a multiple of 8
        (H100, jnp.float32, 64, None, "blockwise"),  # cuDNN flash attention: 16-bit only
        (H100, jnp.bfloat16, 64, 50.0, "blockwise"),  # Gemma 2's soft-cap
        (MI300, jnp.bfloat16, 64, None, "blockwise"),  # no cuDNN on ROCm
        (CPU, jnp.bfloat16, 64, None, "blockwise"),
    ],
)
def test_auto_picks_the_kernel_the_backend_and_model_allow(
    backend: ak.Backend, dtype: Any, head_dim: int, softcap: float | None, want: str
) -> None:
    got = _select("auto", backend, dtype, head_dim, softcap)
    assert got.implementation == want
    assert _select(want, backend, dtype, head_dim, softcap).reason == "asked for"  # where it can run
    if backend is H100 and want == "blockwise":  # a fallback says why
        assert "falling back" in got.reason and "cudnn" in got.reason
    if want == "cudnn":
        assert got.reason == "auto on an NVIDIA GPU"


def test_named_kernels_are_refused_off_their_hardware_and_degrade_only_for_the_model() -> None:
    with pytest.raises(ak.AttentionUnavailable, match="'cudnn' needs an NVIDIA GPU; this backend is cpu"):
        _select("cudnn", CPU)
    with pytest.raises(ak.AttentionUnavailable, match="needs an NVIDIA GPU; this backend is gpu \\(rocm\\)"):
        _select("cudnn", MI300)
    with pytest.raises(ak.AttentionUnavailable, match="'splash' needs a TPU"):
        _select("splash", H100)
    with pytest.raises(ak.AttentionUnavailable, match="expected one of auto, blockwise, xla, cudnn, splash"):
        _select("flash", H100)
    assert _select("xla", CPU, jnp.float32).implementation == "xla"
    assert _select("blockwise", TPU).implementation == "blockwise"
    capped = _select("xla", CPU, softcap=30.0)
    assert capped.implementation == "blockwise" and "soft-cap" in capped.reason
    assert _select("cudnn", H100, jnp.float32).implementation == "blockwise"


def test_the_cpu_is_detected_as_a_cpu() -> None:
    assert ak.detect_backend() == ak.Backend("cpu")


# ------------------------------------------------------------------------ through the model


@pytest.mark.parametrize(("family", "kernel"), [("gemma3", "xla"), ("gemma2", "splash")])
def test_model_forward_with_the_kernel_matches_the_published_architecture(family: str, kernel: str) -> None:
    """Whole checkpoints against test_families' float64 reference: Gemma 3's local and global
    layers (GQA, qk-norm), Gemma 2's soft-capped local and global layers."""
    from stoker.model.hf import load_checkpoint

    from .test_families import FAMILIES, IDS, _random_tensors, reference_logits, write_checkpoint

    hf = FAMILIES[family]
    flat = _random_tensors(hf, seed=len(family))
    model = load_checkpoint(write_checkpoint(Path(tempfile.mkdtemp()), hf, flat))
    t = len(IDS)
    args = (jnp.asarray([IDS], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), jnp.int32))
    graphdef, state = nnx.split(model)
    got = jax.jit(lambda s, *a: nnx.merge(graphdef, s)(*a, kernel=kernel))(state, *args)
    np.testing.assert_allclose(np.asarray(got)[0], reference_logits(flat, hf, IDS), atol=2e-4, rtol=2e-4)


TINY = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_seq_len=1024)


def _step_temp_bytes(kernel: ak.Implementation, length: int) -> int:
    model = nnx.eval_shape(lambda: Transformer(TINY, rngs=nnx.Rngs(0)))
    options = train.StepOptions(attention=kernel, remat="none")
    trainer = train.Trainer(model, options, optax.adam(1e-3), make_mesh(devices=jax.devices()[:1]))
    return int(trainer.memory_analysis(1, length).temp_size_in_bytes)


def test_the_train_step_uses_the_chosen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's step with the xla kernel holds the layer's [H, T, T] float32 scores (1 MiB at
    256 tokens), the blockwise one a 16-query block's worth."""
    monkeypatch.setattr(attention_module, "BLOCK_SCORE_ELEMENTS", 4 * 16 * 256)
    blockwise, xla = _step_temp_bytes("blockwise", 256), _step_temp_bytes("xla", 256)
    assert xla > blockwise + 4 * 256 * 256 * 4, (xla, blockwise)


def test_the_learner_resolves_the_spec_choice_on_its_backend() -> None:
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.learner.testing import tiny_spec

    def settings(attention: str) -> LearnerSettings:
        spec = tiny_spec(model={"attention": attention, "architecture": TINY},
                         learner={"sequenceBuckets": [16], "microbatchTokens": 32})
        return LearnerSettings.from_spec(spec, checkpoint_dir=None)

    assert settings("xla").attention == "xla"
    assert Learner(settings("xla"), resume=False).trainer.options.attention == "xla"
    with pytest.raises(ValueError, match="attention 'cudnn' needs an NVIDIA GPU; this backend is cpu"):
        Learner(settings("cudnn"), resume=False)


SPLIT_ROWS = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from stoker.learner.sharding import make_mesh
    from stoker.model import attention_kernels as ak
    from stoker.model.model import packed_visibility

    mesh = make_mesh(4, 2)  # rows over fsdp=4, tp=2 replicated
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 64, n, 8)), jnp.float32) for n in (4, 2, 2))
    seg = jnp.asarray(np.repeat([[1, 2]], 32, axis=1).repeat(4, axis=0), jnp.int32)

    def run(q, k, v, seg):
        return ak.splash_attention(q, k, v, packed_visibility(seg), scale=0.5, softcap=3.0, interpret=True)

    rows = NamedSharding(mesh, P("fsdp"))
    with ak.rows_split_over(mesh, "fsdp"):
        split = jax.jit(run, in_shardings=rows, out_shardings=rows)
        text = str(split.trace(q, k, v, seg).jaxpr)
        got = split(q, k, v, seg)
    scores = 3.0 * jnp.tanh(0.5 * jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2)) / 3.0)
    seen = (np.arange(64)[None, :] <= np.arange(64)[:, None]) & (seg[:, :, None] == seg[:, None, :])
    probs = jax.nn.softmax(jnp.where(seen[:, None], scores, -jnp.inf), axis=-1)
    want = jnp.einsum("bhts,bshd->bthd", probs, jnp.repeat(v, 2, axis=2))
    print(json.dumps({"shard_map": "shard_map" in text, "diff": float(jnp.abs(got - want).max())}))
    """
)


def test_splash_attends_over_each_devices_rows_when_they_are_split() -> None:
    """8 CPU devices (a fresh process: the device count is fixed at jax's start)."""
    out = run_on_host_devices(SPLIT_ROWS, timeout=240)
    assert out["shard_map"] and out["diff"] < 2e-6, out
