"""The policy transformer: Llama/Qwen semantics, packing isolation, log-prob helpers."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stoker.model.hf import to_hf
from stoker.model.logprobs import sequence_logprobs, token_log_not_taken, token_logprobs
from stoker.model.model import Transformer, count_params, init_model
from stoker.spec import TransformerConfig
from tests.host_devices import run_on_host_devices

QWEN3_LIKE = TransformerConfig(
    vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=12,
    intermediate_size=40, tie_embeddings=False, attention_bias=True, qk_norm=True, rope_theta=500.0,
)


def jit_forward(model: Transformer) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(ids: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(ids, pos, seg)

    return lambda ids, pos, seg: np.asarray(forward(ids, pos, seg))


# ------------------------------------------------------------------ independent numpy reference


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face's apply_rotary_pos_emb for positions 0..T-1; x is [T, heads, D]."""
    t, _, d = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    freqs = np.arange(t)[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def reference_logits(flat: dict[str, np.ndarray], cfg: TransformerConfig, ids: list[int]) -> np.ndarray:
    """LlamaForCausalLM / Qwen3ForCausalLM written from the HF tensors, in float64."""
    w = {k: v.astype(np.float64) for k, v in flat.items()}
    d = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    group = cfg.num_heads // cfg.num_kv_heads
    t = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def proj(name: str, h: np.ndarray, p: str = p) -> np.ndarray:
            out = h @ w[p + name + ".weight"].T
            return out + w[p + name + ".bias"] if p + name + ".bias" in w else out

        h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = proj("self_attn.q_proj", h).reshape(t, cfg.num_heads, d)
        k = proj("self_attn.k_proj", h).reshape(t, cfg.num_kv_heads, d)
        v = proj("self_attn.v_proj", h).reshape(t, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # HF repeat_kv
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        scores = np.where(causal[None], scores, -np.inf)
        attn = np.exp(scores - scores.max(-1, keepdims=True))
        attn /= attn.sum(-1, keepdims=True)
        out = np.einsum("hts,shd->thd", attn, v).reshape(t, -1)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ head.T


def _randomise_norms(model: Transformer, seed: int) -> None:
    """Norm weights start at 1 (and biases at 0); perturb them so the test sees their layout."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in ("weight", "bias"):
            var.set_value(jnp.asarray(rng.normal(1.0, 0.3, var.get_value().shape), jnp.float32))


@pytest.mark.parametrize("cfg", [TransformerConfig(), QWEN3_LIKE], ids=["llama-tiny", "qwen3-like"])
def test_forward_matches_reference_implementation(cfg: TransformerConfig) -> None:
    model = init_model(cfg, seed=3)
    _randomise_norms(model, seed=4)
    ids = [5, 17, 2, 9, 30, 11, 1, 7, 7, 40]
    t = len(ids)
    got = jit_forward(model)(
        np.array([ids], np.int32), np.arange(t, dtype=np.int32)[None], np.ones((1, t), np.int32)
    )[0]
    want = reference_logits(to_hf(model), cfg, ids)
    assert got.dtype == np.float32 and got.shape == (t, cfg.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_tiny_default_config_is_about_100k_parameters() -> None:
    cfg = TransformerConfig()
    d = cfg.hidden_size // cfg.num_heads
    attn = cfg.hidden_size * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer = attn + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size
    expected = cfg.vocab_size * cfg.hidden_size + cfg.num_layers * per_layer + cfg.hidden_size
    n = count_params(init_model(cfg, seed=0))
    assert n == expected
    assert 50_000 < n < 150_000


def test_packed_sequences_do_not_attend_across_segments() -> None:
    model = init_model(TransformerConfig(), seed=1)
    forward = jit_forward(model)
    a, b = [3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]
    t = 16
    ids = np.zeros((4, t), np.int32)
    pos = np.zeros((4, t), np.int32)
    seg = np.zeros((4, t), np.int32)
    # row 0: a then b packed; rows 1, 2: each alone; row 3: packed but one segment (no isolation)
    ids[0, :12] = a + b
    pos[0, :12] = list(range(5)) + list(range(7))
    seg[0, :12] = [1] * 5 + [2] * 7
    ids[1, :5], pos[1, :5], seg[1, :5] = a, range(5), 1
    ids[2, :7], pos[2, :7], seg[2, :7] = b, range(7), 1
    ids[3], pos[3], seg[3] = ids[0], pos[0], np.where(seg[0] > 0, 1, 0)
    logits = forward(ids, pos, seg)
    np.testing.assert_allclose(logits[0, :5], logits[1, :5], atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:12], logits[2, :7], atol=1e-5)
    # Without distinct segments b would see a: its logits must then differ clearly.
    assert np.abs(logits[3, 5:12] - logits[2, :7]).max() > 1e-3


def test_token_logprobs_is_log_softmax_at_targets() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32) * 3
    targets = rng.integers(0, 7, size=(2, 3)).astype(np.int32)
    for tau in (1.0, 0.5):
        z = logits / tau
        want = np.take_along_axis(z, targets[..., None], -1)[..., 0] - np.log(np.exp(z).sum(-1))
        got = np.asarray(token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature=tau))
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_token_log_not_taken_stays_exact_and_differentiable_when_p_rounds_to_one() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(1, 2, 5)).astype(np.float32) * 3
    logits[0, 1] = [40.0, 0.0, 0.0, 0.0, 0.0]  # p(0) = 1 - 4e^-40: 1 in float32, log p = 0
    targets = jnp.asarray([[2, 0]], jnp.int32)
    got = np.asarray(token_log_not_taken(jnp.asarray(logits), targets, temperature=0.5))
    z = logits[0, 0] / 0.5
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    np.testing.assert_allclose(got[0, 0], np.log1p(-p[2]), atol=1e-5)
    # log(-expm1(log p)) is -inf here; the exact value is log(4 e^-80) at temperature 0.5.
    assert float(token_logprobs(jnp.asarray(logits), targets, temperature=0.5)[0, 1]) == 0.0
    assert got[0, 1] == pytest.approx(-80.0 + np.log(4.0), abs=1e-3)
    grad = np.asarray(jax.grad(lambda x: token_log_not_taken(x, targets, temperature=0.5)[0, 1])(jnp.asarray(logits)))
    # d log(1 - p0) / d z0 = -p0 / tau: a full-size gradient, where d log p0 / d z0 = (1 - p0) / tau is ~0.
    assert np.isfinite(grad).all() and grad[0, 1, 0] == pytest.approx(-2.0, rel=1e-5)


def test_sequence_logprobs_align_with_tokens_and_skip_segment_starts() -> None:
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 6, 5)).astype(np.float32))
    ids = jnp.asarray([[1, 2, 3, 4, 0, 0]], jnp.int32)
    seg = jnp.asarray([[1, 1, 2, 2, 0, 0]], jnp.int32)
    lp = np.asarray(sequence_logprobs(logits, ids, seg))
    full = np.asarray(jax.nn.log_softmax(logits, -1))
    # token 1 (id 2) is predicted by position 0; token 3 (id 4) by position 2
    np.testing.assert_allclose(lp[0], [0, full[0, 0, 2], 0, full[0, 2, 4], 0, 0], atol=1e-6)


def test_bfloat16_model_returns_float32_logits() -> None:
    model = init_model(TransformerConfig(), seed=0, dtype=jnp.bfloat16)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids = np.array([[1, 2, 3, 4]], np.int32)
    logits = jit_forward(model)(ids, np.arange(4, dtype=np.int32)[None], np.ones((1, 4), np.int32))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


def test_same_seed_same_initialisation() -> None:
    a = to_hf(init_model(TransformerConfig(), seed=7))
    b = to_hf(init_model(TransformerConfig(), seed=7))
    c = to_hf(init_model(TransformerConfig(), seed=8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


# ------------------------------------------------------------------ init: one program per shape, not per seed
# (seed, dtype) pairs; past 32 bits jax (x64 off) keeps the low 32 bits, as the old program did
CASES = ((0, jnp.float32), (7, jnp.bfloat16), (2**33 + 5, jnp.float32))


def constant_seed_init(module: Callable[..., nnx.Module], config: TransformerConfig, seed: int, dtype: object,
                       placement: Callable[[tuple[int, ...]], jax.sharding.Sharding] | None = None) -> nnx.Module:
    """The program ``init_model`` ran before its seed became an argument: the seed written into it."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: module(config, rngs=nnx.Rngs(params=seed), dtype=dtype)))
    placed = {} if placement is None else {"out_shardings": jax.tree.map(lambda a: placement(tuple(a.shape)), abstract)}
    state = jax.jit(lambda: nnx.state(module(config, rngs=nnx.Rngs(params=seed), dtype=dtype)), **placed)()
    return nnx.merge(graphdef, state)


def same_bits(a: nnx.Module, b: nnx.Module) -> bool:
    left, right = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    return [p for p, _ in left] == [p for p, _ in right] and all(
        x.get_value().dtype == y.get_value().dtype and np.asarray(x.get_value()).tobytes() == np.asarray(y.get_value()).tobytes()
        for (_, x), (_, y) in zip(left, right, strict=True)
    )


@pytest.mark.parametrize(("seed", "dtype"), CASES)
def test_init_model_gives_the_constant_seed_programs_values_bit_for_bit(seed: int, dtype: object) -> None:
    from stoker.learner.value_network import ValueNetwork, init_value_network

    assert same_bits(init_model(QWEN3_LIKE, seed, dtype), constant_seed_init(Transformer, QWEN3_LIKE, seed, dtype))
    assert same_bits(init_value_network(QWEN3_LIKE, seed, dtype), constant_seed_init(ValueNetwork, QWEN3_LIKE, seed, dtype))


PLACED_INIT = textwrap.dedent(
    """
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    sys.path.insert(0, sys.argv[1])
    from test_model import CASES, constant_seed_init, same_bits
    from stoker.learner import sharding
    from stoker.learner.value_network import ValueNetwork, init_value_network
    from stoker.model.model import Transformer, init_model
    from stoker.spec import TransformerConfig

    assert jax.device_count() == 8, jax.devices()
    # big enough (>= MIN_SHARDED_SIZE elements) that the embedding and the MLP are split
    cfg = TransformerConfig(vocab_size=256, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=256)
    placement = functools.partial(sharding.param_sharding, mesh=sharding.make_mesh(4, 2))
    out = []
    for seed, dtype in CASES[:2]:
        for module, init in ((Transformer, init_model), (ValueNetwork, init_value_network)):
            new, old = init(cfg, seed, dtype, placement=placement), constant_seed_init(module, cfg, seed, dtype, placement)
            emb = new.embed_tokens.embedding.get_value()
            out.append({"case": f"{module.__name__} {jnp.dtype(dtype)} {seed}", "exact": same_bits(new, old),
                        "unplaced": same_bits(new, init(cfg, seed, dtype)),
                        "split": max(s.data.size for s in emb.addressable_shards) == emb.size // 8})
    json.dump(out, sys.stdout)
    """
)


def test_placed_init_gives_the_constant_seed_programs_values_bit_for_bit() -> None:
    cases = run_on_host_devices(PLACED_INIT, str(Path(__file__).parent), timeout=240)
    assert len(cases) == 2 * 2
    for case in cases:
        assert case["exact"] and case["unplaced"] and case["split"], case


class _CompileCounter(logging.Handler):
    """Collects jax's "Finished XLA compilation" log lines (``jax.log_compiles``) while open."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if "Finished XLA compilation" in (message := record.getMessage()):
            self.into.append(message)

    def __enter__(self) -> None:
        logging.getLogger("jax").addHandler(self)

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        logging.getLogger("jax").removeHandler(self)


def test_init_compiles_once_per_shape_not_per_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second seed neither traces the model again nor compiles: the seed is an argument."""
    from stoker.learner.value_network import ValueNetwork, init_value_network

    cfg = TransformerConfig(vocab_size=52, hidden_size=24, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=40)
    for module, init in ((Transformer, init_model), (ValueNetwork, init_value_network)):
        built = []
        original = module.__init__
        monkeypatch.setattr(module, "__init__", lambda self, *a, _o=original, **k: (built.append(1), _o(self, *a, **k))[1])
        compiles = []
        with jax.log_compiles(), _CompileCounter(compiles):
            first = init(cfg, 1, jnp.float32)
            traced_first, compiled_first = len(built), len(compiles)
            second = init(cfg, 2, jnp.float32)
        assert traced_first >= 1 and compiled_first >= 1
        assert (len(built), len(compiles)) == (traced_first, compiled_first), module.__name__
        assert not np.array_equal(first.embed_tokens.embedding.get_value(), second.embed_tokens.embedding.get_value())
