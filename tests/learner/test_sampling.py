"""The actors' sampler: log-probs the trainer can reproduce, greedy/top-p/temperature, no recompiles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stoker.model.hf import load_checkpoint, read_weights, save_checkpoint
from stoker.model.logprobs import token_logprobs
from stoker.model.model import Transformer, init_model
from stoker.rollout.sampling import PromptTooLong, Sampler, padded_batch, pick_bucket, sample_token
from stoker.model.tokenizer import load_tokenizer, save_tokenizer, token_id, train_word_tokenizer
from stoker.weights.channel import flatten_params
from stoker.spec import SamplingSpec, TransformerConfig

CONFIG = TransformerConfig()
BUCKETS = (16, 32)

pytestmark = pytest.mark.usefixtures("xla_cache")  # the samplers here compile the same programs


def scorer(model: Transformer, temperature: float = 1.0) -> Callable[[list[int]], np.ndarray]:
    """Training-side log-probs of every token after the first, at one fixed [1, 32] shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(ids: jax.Array, seg: jax.Array) -> jax.Array:
        pos = jnp.arange(ids.shape[1])[None]
        logits = nnx.merge(graphdef, state)(ids, pos, seg)
        return token_logprobs(logits[:, :-1], ids[:, 1:], temperature=temperature)

    def run(seq: list[int]) -> np.ndarray:
        ids = np.zeros((1, 32), np.int32)
        ids[0, : len(seq)] = seq
        seg = (np.arange(32) < len(seq)).astype(np.int32)[None]
        return np.asarray(score(ids, seg))[0, : len(seq) - 1]

    return run


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    # min_batch=4: calls of 1 to 4 prompts share one batch shape (fewer programs to compile).
    return Sampler(CONFIG, SamplingSpec(temperature=1.0, top_p=1.0), seed=0, buckets=BUCKETS, min_batch=4)


@pytest.fixture(scope="module")
def score() -> Callable[[list[int]], np.ndarray]:
    return scorer(init_model(CONFIG, seed=0))


def test_logprobs_equal_the_training_forward(sampler: Sampler, score: Callable[[list[int]], np.ndarray]) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    gens = sampler.generate(prompts, max_new_tokens=6)
    assert [len(g.token_ids) for g in gens] == [6, 6, 6]
    assert sampler.version == 0
    for prompt, gen in zip(prompts, gens, strict=True):
        recomputed = score(prompt + gen.token_ids)[len(prompt) - 1 :]
        np.testing.assert_allclose(gen.logprobs, recomputed, atol=1e-4)
        assert not gen.finished


def test_no_recompile_for_other_lengths_within_a_bucket(sampler: Sampler) -> None:
    sampler.generate([[1, 2], [3, 4, 5]], max_new_tokens=3)
    compiled = sampler.compile_count
    # Different prompt lengths, contents and step limits, same (batch, prefill, cache) buckets.
    sampler.generate([[7, 8, 9, 10, 11], [12]], max_new_tokens=5)
    sampler.generate([[1], [2, 3, 4, 5, 6, 7, 8, 9]], max_new_tokens=2, stop_token_ids=[3, 5])
    assert sampler.compile_count == compiled
    # A longer prompt moves to the next bucket: exactly one more program.
    sampler.generate([list(range(1, 20)), [1]], max_new_tokens=2)
    assert sampler.compile_count == compiled + 1


def test_stop_tokens_end_a_row(sampler: Sampler) -> None:
    prompts = [[1, 2, 3], [5, 6]]
    first = sampler.generate(prompts, max_new_tokens=8)
    stop = first[0].token_ids[0]
    gens = sampler.generate(prompts, max_new_tokens=8, stop_token_ids=[stop])
    for gen in gens:
        if stop in gen.token_ids:
            assert gen.finished and gen.token_ids[-1] == stop and gen.token_ids.index(stop) == len(gen.token_ids) - 1
        else:
            assert not gen.finished and len(gen.token_ids) == 8


def test_load_weights_swaps_policy_without_recompiling(sampler: Sampler) -> None:
    prompts = [[1, 2, 3], [4]]
    sampler.generate(prompts, max_new_tokens=4)
    compiled = sampler.compile_count
    other = init_model(CONFIG, seed=11)
    sampler.load_weights(flatten_params(other), version=3)
    gens = sampler.generate(prompts, max_new_tokens=4)
    assert sampler.version == 3 and sampler.compile_count == compiled
    score = scorer(other)
    for prompt, gen in zip(prompts, gens, strict=True):
        np.testing.assert_allclose(gen.logprobs, score(prompt + gen.token_ids)[len(prompt) - 1 :], atol=1e-4)
    sampler.load_weights(flatten_params(init_model(CONFIG, seed=0)), version=0)


def training_logits(model: Transformer) -> Callable[[list[int]], np.ndarray]:
    """The training forward's logits at every position of a sequence, at one fixed [1, 16] shape."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda ids, pos, seg: nnx.merge(graphdef, state)(ids, pos, seg))

    def run(seq: list[int]) -> np.ndarray:
        ids = np.zeros((1, 16), np.int32)
        ids[0, : len(seq)] = seq
        seg = (np.arange(16) < len(seq)).astype(np.int32)[None]
        return np.asarray(forward(ids, np.arange(16, dtype=np.int32)[None], seg))[0]

    return run


def test_low_temperature_and_tiny_top_p_are_greedy() -> None:
    model = init_model(CONFIG, seed=0)
    prompt = [3, 1, 4, 1, 5]
    params = flatten_params(model)
    cold = Sampler(CONFIG, SamplingSpec(temperature=1e-4), seed=1, buckets=BUCKETS, params=params)
    nucleus = Sampler(CONFIG, SamplingSpec(temperature=1.0, top_p=1e-6), seed=2, buckets=BUCKETS, params=params)
    greedy = cold.generate([prompt], max_new_tokens=6)[0]
    gen = nucleus.generate([prompt], max_new_tokens=6)[0]
    assert gen.token_ids == greedy.token_ids

    seq = prompt + gen.token_ids
    logits = training_logits(model)(seq)
    # Every drawn token is the training forward's argmax given the tokens before it.
    assert gen.token_ids == [int(np.argmax(logits[i])) for i in range(len(prompt) - 1, len(seq) - 1)]
    # Top-p does not renormalise: the recorded log-prob is the full softmax's, not log 1 = 0.
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = [full[i, seq[i + 1]] for i in range(len(prompt) - 1, len(seq) - 1)]
    np.testing.assert_allclose(gen.logprobs, want, atol=1e-4)
    assert max(gen.logprobs) < -0.5
    np.testing.assert_allclose(greedy.logprobs, 0.0, atol=1e-3)  # at tau -> 0 the argmax has p -> 1


def test_sampled_frequencies_follow_temperature_and_top_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.tile(np.log(probs), (20_000, 1)), jnp.float32)
    key = jax.random.key(0)

    def freqs(temperature: float, top_p: float | None) -> np.ndarray:
        nucleus = None if top_p is None else jnp.float32(top_p)
        tokens, logp = sample_token(key, logits, jnp.float32(temperature), nucleus)
        tempered = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
        np.testing.assert_allclose(np.asarray(logp), np.log(tempered[np.asarray(tokens)]), atol=1e-5)
        return np.bincount(np.asarray(tokens), minlength=4) / len(tokens)

    np.testing.assert_allclose(freqs(1.0, None), probs, atol=0.015)
    hot = probs**0.5 / (probs**0.5).sum()
    np.testing.assert_allclose(freqs(2.0, None), hot, atol=0.015)
    # Nucleus 0.7: {0.5, 0.3} reaches it, renormalised to 5/8, 3/8; the tail is never drawn.
    np.testing.assert_allclose(freqs(1.0, 0.7), [5 / 8, 3 / 8, 0, 0], atol=0.015)
    assert freqs(1.0, 0.85)[3] == 0 and freqs(1.0, 0.85)[2] > 0.1


def test_buckets_and_batch_padding() -> None:
    assert pick_bucket(BUCKETS, 16) == 16 and pick_bucket(BUCKETS, 17) == 32
    with pytest.raises(PromptTooLong):
        pick_bucket(BUCKETS, 33)
    assert [padded_batch(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert [padded_batch(n, min_batch=8) for n in (1, 3, 8, 9)] == [8, 8, 8, 16]


def test_too_long_or_invalid_prompts_are_refused(sampler: Sampler) -> None:
    with pytest.raises(PromptTooLong, match="largest bucket"):
        sampler.generate([list(range(1, 30))], max_new_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.generate([[1, 2]], max_new_tokens=4, stop_token_ids=[CONFIG.vocab_size])
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        sampler.generate([[1, 99]], max_new_tokens=4)


def test_checkpoint_and_tokenizer_from_disk_drive_the_sampler(tmp_path: Path) -> None:
    texts = ["go left", "go right", "go up", "go down", "you win", "you fell"]
    tok = train_word_tokenizer(texts, ["<pad>", "<eos>"])
    # Qwen-style extras (q/k/v biases, q/k norms, untied head) so the cached decode covers them too.
    cfg = TransformerConfig(
        vocab_size=tok.get_vocab_size(), attention_bias=True, qk_norm=True, tie_embeddings=False, num_kv_heads=1
    )
    save_checkpoint(init_model(cfg, seed=4), tmp_path)
    save_tokenizer(tok, tmp_path)

    loaded_tok = load_tokenizer(tmp_path)
    model = load_checkpoint(tmp_path)
    # A non-unit temperature: the trainer divides its logits by sampler.temperature to match.
    spec = SamplingSpec(temperature=0.7)
    sampler = Sampler(model.config, spec, seed=0, buckets=BUCKETS, params=read_weights(tmp_path))
    prompt = loaded_tok.encode("go left you").ids
    gen = sampler.generate([prompt], max_new_tokens=6, stop_token_ids=[token_id(loaded_tok, "<eos>")])[0]
    assert all(0 <= t < tok.get_vocab_size() for t in gen.token_ids)
    text = loaded_tok.decode(gen.token_ids, skip_special_tokens=False)
    assert loaded_tok.encode(text).ids == gen.token_ids or "<unk>" in text
    recomputed = scorer(model, temperature=sampler.temperature)(prompt + gen.token_ids)[len(prompt) - 1 :]
    np.testing.assert_allclose(gen.logprobs, recomputed, atol=1e-4)


# ------------------------------------------------------------------ conversations (sessions)


def session_sampler(rows: int = 4, *, pin: bool = False) -> Sampler:
    return Sampler(
        CONFIG, SamplingSpec(temperature=1.0, top_p=1.0), seed=0, buckets=BUCKETS, min_batch=4,
        session_rows=rows, pin_sessions=pin,
    )


def play(sampler: Sampler, conversations: dict[str, list[int]], turns: int, reply: list[int]) -> dict[str, list[tuple[int, list[int], list[float]]]]:
    """Multi-turn: each turn samples 2 tokens per conversation, then appends ``reply`` (the
    environment). Returns per conversation [(prompt length, sampled ids, log-probs)] per turn."""
    record: dict[str, list[tuple[int, list[int], list[float]]]] = {name: [] for name in conversations}
    for _ in range(turns):
        names = list(conversations)
        gens = sampler.generate([conversations[n] for n in names], max_new_tokens=2, sessions=names)
        for name, gen in zip(names, gens, strict=True):
            record[name].append((len(conversations[name]), gen.token_ids, gen.logprobs))
            conversations[name] = conversations[name] + gen.token_ids + reply
    return record


def assert_trainer_agrees(conversation: list[int], turns: list[tuple[int, list[int], list[float]]], score: Callable[[list[int]], np.ndarray]) -> None:
    full = score(conversation)  # full[i] = log p(conversation[i + 1] | conversation[: i + 1])
    for start, ids, logprobs in turns:
        np.testing.assert_allclose(logprobs, full[start - 1 : start - 1 + len(ids)], atol=1e-4)


def test_sessions_reuse_the_cache_and_match_the_trainer(score: Callable[[list[int]], np.ndarray]) -> None:
    sampler = session_sampler()
    conversations = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9]}
    turns = play(sampler, conversations, 3, reply=[10, 11, 12])
    for name, conversation in conversations.items():
        assert_trainer_agrees(conversation, turns[name], score)
    # Turn 1 prefills everything; afterwards only the last sampled token and the reply (4 tokens
    # a turn) are new: the rest of each prompt came from the cache.
    first = 3 + 6
    later = [(3 + 5 * t, 6 + 5 * t) for t in (1, 2)]
    assert sampler.cache_stats.prompt_tokens == first + sum(a + b for a, b in later)
    assert sampler.cache_stats.reused_tokens == sum(a - 4 + b - 4 for a, b in later)
    # The chunk buckets are few: a call after the first compiles nothing new.
    compiled = sampler.compile_count
    play(sampler, {"c": [3, 3], "d": [1]}, 1, reply=[5])
    play(sampler, {"c": [3, 3], "d": [1]}, 1, reply=[5])
    assert sampler.compile_count == compiled


def test_new_weights_recompute_a_session_unless_pinned() -> None:
    old, new = init_model(CONFIG, seed=0), init_model(CONFIG, seed=11)
    score_old, score_new = scorer(old), scorer(new)
    for pin in (False, True):
        sampler = session_sampler(pin=pin)
        conversations = {"early": [1, 2, 3]}
        before = play(sampler, conversations, 1, reply=[4, 5])
        sampler.load_weights(flatten_params(new), version=7)
        conversations["late"] = [6, 7]
        reused = sampler.cache_stats.reused_tokens
        after = play(sampler, conversations, 1, reply=[4, 5])
        gens = sampler.generate([conversations["early"]], max_new_tokens=1, sessions=["early"])
        # Unpinned, the early conversation continues under the new weights (prefilled again);
        # pinned, it keeps its version-0 weights and its cache.
        early_score = score_old if pin else score_new
        assert_trainer_agrees(conversations["early"] + gens[0].token_ids, [*before["early"][1:], after["early"][0]], early_score)
        assert gens[0].version == (0 if pin else 7)
        assert (sampler.cache_stats.reused_tokens > reused) == pin or not pin
        assert_trainer_agrees(conversations["late"], after["late"], score_new)
        if pin:
            sampler.end_session("early")
            assert sampler.generate([[1, 2]], max_new_tokens=1, sessions=["early"])[0].version == 7


def test_conversations_that_open_alike_share_the_opening_under_the_same_weights() -> None:
    old, new = init_model(CONFIG, seed=0), init_model(CONFIG, seed=11)
    score_old, score_new = scorer(old), scorer(new)
    opening = [1, 2, 3, 4, 5, 6, 7]
    sampler = session_sampler(rows=4)
    first = play(sampler, {"a": list(opening)}, 1, reply=[8, 9])
    # A second episode of the same task: its opening's keys/values come from "a" (all but the
    # last token, whose logits start the sampling), and its log-probs are still the trainer's.
    reused = sampler.cache_stats.reused_tokens
    conversations = {"b": list(opening)}
    turns = play(sampler, conversations, 2, reply=[8, 9])
    assert sampler.cache_stats.reused_tokens - reused >= len(opening) - 1
    assert_trainer_agrees(conversations["b"], turns["b"], score_old)
    # New weights: "a" is prefilled again in full under them; then "b", whose cache is stale too,
    # starts from what "a" now holds under the new weights -- never from keys/values of the old.
    sampler.load_weights(flatten_params(new), version=3)
    a = list(opening) + first["a"][0][1] + [8, 9]
    reused = sampler.cache_stats.reused_tokens
    a_turn = play(sampler, {"a": a}, 1, reply=[8, 9])
    assert sampler.cache_stats.reused_tokens == reused  # no donor holds anything under version 3
    assert_trainer_agrees(a + a_turn["a"][0][1], a_turn["a"], score_new)
    b = conversations["b"]
    b_turn = play(sampler, {"b": b}, 1, reply=[8, 9])
    assert sampler.cache_stats.reused_tokens - reused >= len(opening)  # shared with "a" at version 3
    assert_trainer_agrees(b + b_turn["b"][0][1], b_turn["b"], score_new)
    # Without sharing the same turn reads nothing from the cache.
    alone = session_sampler(rows=4)
    alone.share_prefixes = False
    play(alone, {"a": list(opening)}, 1, reply=[8, 9])
    play(alone, {"b": list(opening)}, 1, reply=[8, 9])
    assert alone.cache_stats.reused_tokens == 0


def test_an_ended_conversation_is_no_longer_a_donor() -> None:
    sampler = session_sampler(rows=4)
    sampler.generate([[1, 2, 3, 4, 5]], max_new_tokens=1, sessions=["a"])
    sampler.end_session("a")
    sampler.generate([[1, 2, 3, 4, 5]], max_new_tokens=1, sessions=["b"])
    assert sampler.cache_stats.reused_tokens == 0


def test_more_sessions_than_rows_evict_the_least_recent(score: Callable[[list[int]], np.ndarray]) -> None:
    sampler = session_sampler(rows=2)
    conversations = {"a": [1, 2], "b": [3, 4], "c": [5, 6, 7]}
    turns: dict[str, list[tuple[int, list[int], list[float]]]] = {n: [] for n in conversations}
    for names in (["a", "b"], ["c"], ["a", "b"], ["c", "a"]):
        for name, got in play(sampler, {n: conversations[n] for n in names}, 1, reply=[8]).items():
            turns[name] += got
            conversations[name] = conversations[name] + got[0][1] + [8]
    for name, conversation in conversations.items():
        assert_trainer_agrees(conversation, turns[name], score)
    with pytest.raises(ValueError, match="exceed the cache"):
        sampler.generate([[1], [2], [3]], max_new_tokens=1, sessions=["x", "y", "z"])


def test_an_edited_history_is_recomputed_from_where_it_differs(score: Callable[[list[int]], np.ndarray]) -> None:
    sampler = session_sampler()
    sampler.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=2, sessions=["s"])
    edited = [1, 2, 9, 9]
    gen = sampler.generate([edited], max_new_tokens=3, sessions=["s"])[0]
    np.testing.assert_allclose(gen.logprobs, score(edited + gen.token_ids)[len(edited) - 1 :], atol=1e-4)


def test_bad_session_calls_are_refused() -> None:
    sampler = session_sampler()
    with pytest.raises(ValueError, match="only once"):
        sampler.generate([[1], [2]], max_new_tokens=1, sessions=["x", "x"])
    with pytest.raises(PromptTooLong):
        sampler.generate([list(range(1, 31))], max_new_tokens=4, sessions=["x"])
    with pytest.raises(ValueError, match="keeps no conversations"):
        Sampler(CONFIG, SamplingSpec(), seed=0, buckets=BUCKETS).generate([[1]], max_new_tokens=1, sessions=["x"])


@pytest.mark.parametrize("jit", [False, True])
def test_sample_token_at_temperature_zero_is_the_argmax_with_its_untempered_logprob(jit: bool) -> None:
    logits = jnp.asarray([[0.1, 2.0, -1.0, 1.9], [3.0, -2.0, 0.0, 2.5]], jnp.float32)
    draw = jax.jit(sample_token) if jit else sample_token
    for key in range(5):  # the key is ignored: greedy is deterministic
        tokens, logprobs = draw(jax.random.key(key), logits, jnp.asarray(0.0), None)
        assert tokens.tolist() == [1, 0]
        # log pi(y) = z_y - logsumexp(z): the tau = 1 softmax.
        want = [float(logits[b, y] - jax.scipy.special.logsumexp(logits[b])) for b, y in enumerate([1, 0])]
        np.testing.assert_allclose(logprobs, want, rtol=1e-6)
    tokens, _ = draw(jax.random.key(0), logits, jnp.asarray(0.0), jnp.asarray(0.5))  # top-p changes nothing
    assert tokens.tolist() == [1, 0]


def test_a_greedy_call_takes_the_training_forwards_argmax_without_compiling(
    sampler: Sampler, score: Callable[[list[int]], np.ndarray]
) -> None:
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    sampler.generate(prompts, max_new_tokens=6)
    compiled = sampler.compile_count
    greedy = sampler.generate(prompts, max_new_tokens=6, temperature=0.0)
    again = sampler.generate(prompts, max_new_tokens=6, temperature=0.0)
    assert sampler.compile_count == compiled  # the temperature is a runtime value
    assert [g.token_ids for g in greedy] == [g.token_ids for g in again]
    logits_of = training_logits(init_model(CONFIG, seed=0))
    for prompt, gen in zip(prompts, greedy, strict=True):
        seq = prompt + gen.token_ids
        logits = logits_of(seq)
        assert gen.token_ids == [int(np.argmax(logits[i])) for i in range(len(prompt) - 1, len(seq) - 1)]
        # The recorded log-prob is the trainer's token_logprobs at temperature 1.
        np.testing.assert_allclose(gen.logprobs, score(seq)[len(prompt) - 1 :], atol=1e-4)
    # The sampler's own temperature is untouched: a plain call samples again (not all argmax).
    sampled = [sampler.generate(prompts, max_new_tokens=6)[0].token_ids for _ in range(4)]
    assert any(s != greedy[0].token_ids for s in sampled)
    with pytest.raises(ValueError, match="temperature"):
        sampler.generate(prompts, max_new_tokens=2, temperature=-1.0)


def test_greedy_sessions_match_greedy_whole_prompts() -> None:
    sampler = session_sampler()
    conversation = [1, 2, 3]
    for _ in range(2):
        gen = sampler.generate([conversation], max_new_tokens=2, sessions=["g"], temperature=0.0)[0]
        plain = sampler.generate([conversation], max_new_tokens=2, temperature=0.0)[0]
        assert gen.token_ids == plain.token_ids
        np.testing.assert_allclose(gen.logprobs, plain.logprobs, atol=1e-4)
        conversation = conversation + gen.token_ids + [10, 11]
