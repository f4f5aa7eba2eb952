"""FrozenLake as text: maps, rendering, moves, the shaping and the word-level tokenizer."""

from __future__ import annotations

import itertools

import pytest

from stoker.actor.frozenlake import (
    FrozenLake,
    FrozenLakeConfig,
    goal_distances,
    make_map,
    parse_action,
    potentials,
)
from stoker.conversation.frozenlake_words import ACTIONS, INSTRUCTION, WORDS
from stoker.conversation.tokenization import frozenlake_tokenizer


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


def test_episodes_on_the_same_map_do_not_share_a_position() -> None:
    """Concurrent episodes of one map share its (read-only) transition table, never its state."""
    first, second = FrozenLake(FrozenLakeConfig()), FrozenLake(FrozenLakeConfig())
    first.reset("1", seed=0)
    second.reset("1", seed=1)
    for move in first.shortest_path():
        first.step(move)
    assert first._state != 0 and second._state == 0
    assert second.step(second.shortest_path()[0]).observation.info["state"] != 0
    first.reset("1", seed=2)
    assert first._state == 0


def test_expert_path_succeeds_and_shaped_return_telescopes() -> None:
    env = FrozenLake(FrozenLakeConfig(reward_shaping=True))
    env.reset("1", seed=0)
    phi = potentials(env._desc)
    rewards = [env.step(move).reward for move in env.shortest_path()]
    # G = R + Phi(goal) - Phi(s0) with R = 1 and Phi(goal) = 0
    assert sum(rewards) == pytest.approx(1.0 - phi[0])
    assert all(r > 0 for r in rewards)  # every step of a shortest path gets closer


def test_potentials_are_bounded_and_a_hole_is_below_its_safe_neighbours() -> None:
    for seed in range(4):
        desc = make_map(4, 0.2, seed)
        phi = potentials(desc).reshape(4, 4)
        assert phi[3, 3] == 0.0 and desc[3][3] == "G"
        assert ((-1.0 <= phi) & (phi <= 0.0)).all()
        for r, c in itertools.product(range(4), range(4)):
            if desc[r][c] != "H":
                continue
            safe = [phi[r + dr, c + dc] for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0))
                    if 0 <= r + dr < 4 and 0 <= c + dc < 4 and desc[r + dr][c + dc] != "H"]
            assert phi[r, c] < max(safe)  # stepping into the hole never beats the best safe step


def _shaped_return(seed: int, moves: tuple[str, ...]) -> tuple[float, bool]:
    env = FrozenLake(FrozenLakeConfig(reward_shaping=True))
    env.reset(str(seed), seed=0)
    total, success = 0.0, False
    for move in moves:
        result = env.step(move)
        total += result.reward
        success = result.observation.info["metrics"]["success"] == 1.0
        if result.terminated:
            break
    return total, success


@pytest.mark.parametrize("seed", [0, 1])
def test_shaping_keeps_the_optimum_exactly_the_goal_reaching_move_sequences(seed: int) -> None:
    # Every 6-move sequence (a shortest path is 6 moves on these maps): the best shaped return is
    # reached by exactly the sequences that reach the goal.
    outcomes = [_shaped_return(seed, moves) for moves in itertools.product(ACTIONS, repeat=6)]
    best = max(total for total, _ in outcomes)
    assert any(success for _, success in outcomes)
    for total, success in outcomes:
        assert success == (total == pytest.approx(best))


def test_progress_before_falling_in_is_worth_more_than_falling_in_at_once() -> None:
    # Map 0 (SFFF/HHFF/FHHF/HFFG) opens with `right`; the other example maps open with `down`. A
    # policy that gets two steps right on map 0 before it falls in must score above one that falls
    # in at once, or that map's GRPO group has no signal (what kept it unsolved before).
    assert make_map(4, 0.2, 0) == ["SFFF", "HHFF", "FHHF", "HFFG"]
    fell_at_once, _ = _shaped_return(0, ("down",))
    fell_later, _ = _shaped_return(0, ("right", "right", "down", "down"))
    assert fell_later > fell_at_once
    stalled, _ = _shaped_return(0, ("up",) * 8)  # bumping into the edge for the whole episode
    assert fell_later > stalled


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
