"""FrozenLake as text: maps, rendering, moves, the shaping and the word-level tokenizer."""

from __future__ import annotations

import pytest

from stoker.actor.frozenlake import (
    ACTIONS,
    INSTRUCTION,
    WORDS,
    FrozenLake,
    FrozenLakeConfig,
    goal_distances,
    make_map,
    parse_action,
    potentials,
)
from stoker.actor.tokenization import frozenlake_tokenizer


@pytest.mark.parametrize("seed", range(6))
def test_maps_are_seeded_and_solvable(seed: int) -> None:
    desc = make_map(5, 0.3, seed)
    assert desc == make_map(5, 0.3, seed)
    assert desc[0][0] == "S" and desc[-1][-1] == "G"
    assert goal_distances(desc)[0, 0] > 0  # a hole-free path from S reaches G


def test_observation_renders_grid_with_player_and_instruction() -> None:
    env = FrozenLake(FrozenLakeConfig(size=4))
    first = env.reset("1", seed=0)
    assert first.text.startswith(INSTRUCTION)
    grid = first.text.splitlines()[-1].split()
    assert grid.count("|") == 4 and grid.count("P") == 1 and grid[0] == "P"
    cells = [w for w in grid if w != "|"]
    assert len(cells) == 16 and cells[-1] == "G"


def test_parse_takes_first_move_word() -> None:
    assert parse_action("H up left") == ACTIONS.index("up")
    assert parse_action("right.") == ACTIONS.index("right")
    assert parse_action("upward F") is None
    assert parse_action("") is None


def test_invalid_answer_costs_the_turn_without_moving() -> None:
    env = FrozenLake(FrozenLakeConfig())
    env.reset("1", seed=0)
    result = env.step("G G")
    assert result.observation.text.startswith("invalid move .")
    assert result.observation.info["state"] == 0
    assert result.reward == 0.0 and not result.terminated
    assert result.observation.info["metrics"]["invalid_actions"] == 1.0


def test_expert_path_succeeds_and_shaped_return_telescopes() -> None:
    env = FrozenLake(FrozenLakeConfig(reward_shaping=True))
    env.reset("1", seed=0)
    phi = potentials(env._desc)
    rewards = [env.step(move).reward for move in env.shortest_path()]
    # G = R + Phi(goal) - Phi(s0) with R = 1 and Phi(goal) = 0
    assert sum(rewards) == pytest.approx(1.0 - phi[0])
    assert all(r > 0 for r in rewards)  # every step of a shortest path gets closer


def test_hole_is_worst_and_goal_best_under_shaping() -> None:
    desc = make_map(4, 0.2, 1)
    phi = potentials(desc)
    flat = "".join(desc)
    assert phi[flat.index("G")] == 0.0
    assert all(phi[i] == -1.0 for i, cell in enumerate(flat) if cell == "H")
    assert all(-1.0 <= p <= 0.0 for p in phi)


def test_falling_into_a_hole_ends_unsuccessfully() -> None:
    env = FrozenLake(FrozenLakeConfig(reward_shaping=False))
    env.reset("1", seed=0)  # map 1 has a hole right of the start (see the render test's grid)
    result = env.step("right")
    assert result.terminated and result.reward == 0.0
    assert result.observation.info["metrics"]["success"] == 0.0


def test_without_shaping_reward_is_success_only() -> None:
    env = FrozenLake(FrozenLakeConfig(reward_shaping=False))
    env.reset("2", seed=0)
    rewards = [env.step(move).reward for move in env.shortest_path()]
    assert rewards[:-1] == [0.0] * (len(rewards) - 1) and rewards[-1] == 1.0


def test_every_observation_word_and_move_is_one_known_token() -> None:
    tokenizer = frozenlake_tokenizer()
    vocab = tokenizer.get_vocab()
    unk = vocab["<unk>"]
    env = FrozenLake(FrozenLakeConfig(size=6))
    text = env.reset("3", seed=0).text + " " + env.step("nonsense").observation.text
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert unk not in ids and len(ids) == len(text.split())
    for move in ACTIONS:
        assert tokenizer.encode(move, add_special_tokens=False).ids == [vocab[move]]
    assert set(WORDS) <= set(vocab)
