"""FrozenLake as a text environment, built on gymnasium's ``FrozenLakeEnv``.

Each observation is the grid with the player's cell marked, one word per cell::

    reach G and avoid H . you are P . answer with one move : left down right up .
    P F F F | F H F H | F F F H | H F F G |

The model answers with a move word; the first of ``left|down|right|up`` in its text is taken. An
answer without one does not move the player and still costs the turn (the next observation starts
with ``invalid move .``). Every word here is one token of ``frozenlake_tokenizer()``, so a move is
exactly one sampled token.

Reward: 1 on reaching the goal, else 0, reported as ``metrics["success"]``. With shaping on, each
step also earns the potential difference (Ng, Harada & Russell 1999), undiscounted (gamma = 1):

    F(s, s') = Phi(s') - Phi(s),   Phi(s) = -min(d(s), 2n) / (2n),

where n is the map side and d(s) the shortest-path length from s to the goal over non-hole cells;
a hole counts ``HOLE_STEPS`` (2) steps further than its nearest safe neighbour, so Phi(goal) = 0
and falling in is always worse than the best safe step from beside the hole. The shaped return
telescopes: G = R + Phi(s_T) - Phi(s_0), with R in {0, 1} the true reward and s_T the last state.
Every Phi is <= 0 with equality only at the goal, and R = 1 only at the goal, so G <= 1 - Phi(s_0)
with equality exactly when the goal is reached: the policies that reach the goal remain exactly
the optimal ones on the default, deterministic lake (tested by enumerating move sequences). Among
failures, ending closer to the goal is worth more -- including falling into a hole after some
progress, which is what gives a map a learning signal while the policy still falls in on it: with
every hole at one flat, lowest potential, a policy that fell in early on a map could only improve
by standing still against an edge, and that map stayed unsolved. Ng et al.'s "never changes the
optimal policy" needs equal potentials at all terminal states, so on a *slippery* lake, where no
policy is sure to succeed, the shaping may favour a path that gets closer before it risks a hole.
Within a GRPO group (same map, same s_0) the -Phi(s_0) term is shared and cancels in the
advantages.
"""

from __future__ import annotations

import copy
import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv, generate_random_map

from stoker.actor.environments import EnvironmentProblem, Observation, StepResult
from stoker.conversation.frozenlake_words import ACTIONS, INSTRUCTION, INVALID, ROW_END

# A hole is shaped as this many steps further from the goal than its nearest safe neighbour.
HOLE_STEPS = 2


def parse_action(text: str) -> int | None:
    """The first move word in the model's text, as gymnasium's action index; None when absent."""
    for word in text.replace(".", " ").split():
        if word in ACTIONS:
            return ACTIONS.index(word)
    return None


def make_map(size: int, hole_probability: float, seed: int) -> list[str]:
    """A random map with a guaranteed path from S to G (gymnasium checks solvability)."""
    return list(generate_random_map(size=size, p=1.0 - hole_probability, seed=seed))


def goal_distances(desc: list[str]) -> np.ndarray:
    """Shortest-path length from every cell to G over non-hole cells (-1 when unreachable)."""
    n_rows, n_cols = len(desc), len(desc[0])
    dist = np.full((n_rows, n_cols), -1, dtype=np.int64)
    goal = next((r, c) for r in range(n_rows) for c in range(n_cols) if desc[r][c] == "G")
    dist[goal] = 0
    queue = deque([goal])
    while queue:
        r, c = queue.popleft()
        for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0)):
            nr, nc = r + dr, c + dc
            if 0 <= nr < n_rows and 0 <= nc < n_cols and dist[nr, nc] < 0 and desc[nr][nc] != "H":
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return dist


def potentials(desc: list[str]) -> np.ndarray:
    """Phi per cell (see the module docstring), flattened in gymnasium's state order."""
    size = len(desc)
    cap = 2 * size
    dist = goal_distances(desc)
    steps = np.where(dist < 0, cap, dist)
    for r, row in enumerate(desc):
        for c, cell in enumerate(row):
            if cell == "H":
                safe = [
                    dist[r + dr, c + dc]
                    for dr, dc in ((0, -1), (1, 0), (0, 1), (-1, 0))
                    if 0 <= r + dr < size and 0 <= c + dc < size and dist[r + dr, c + dc] >= 0
                ]
                steps[r, c] = min(safe) + HOLE_STEPS if safe else cap
    return (-np.minimum(steps, cap) / cap).reshape(-1).astype(np.float64)


def render(desc: list[str], state: int) -> str:
    """The grid as words, the player's cell shown as P, each row closed by ``|``."""
    size = len(desc[0])
    words: list[str] = []
    for r, row in enumerate(desc):
        for c, cell in enumerate(row):
            words.append("P" if r * size + c == state else cell)
        words.append(ROW_END)
    return " ".join(words)


@dataclass(frozen=True)
class _Lake:
    desc: list[str]
    potentials: np.ndarray
    env: FrozenLakeEnv  # a template: episodes step shallow copies of it


@functools.lru_cache(maxsize=256)
def _lake(size: int, hole_probability: float, map_seed: int, slippery: bool) -> _Lake:
    desc = make_map(size, hole_probability, map_seed)
    return _Lake(desc, potentials(desc), FrozenLakeEnv(desc=desc, is_slippery=slippery))


@dataclass
class FrozenLakeConfig:
    size: int = 4
    slippery: bool = False
    hole_probability: float = 0.2
    reward_shaping: bool = True


class FrozenLake:
    """One FrozenLake episode; the task id is the map seed."""

    def __init__(self, config: FrozenLakeConfig):
        self.config = config
        self._env: FrozenLakeEnv | None = None
        self._desc: list[str] = []
        self._phi = np.zeros(0)
        self._state = 0
        self._invalid = 0
        self._steps = 0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> FrozenLake:
        def get(key: str, camel: str, default: Any) -> Any:
            return options.get(camel, options.get(key, default))

        return cls(
            FrozenLakeConfig(
                size=int(get("size", "size", 4)),
                slippery=bool(get("slippery", "slippery", False)),
                hole_probability=float(get("hole_probability", "holeProbability", 0.2)),
                reward_shaping=bool(get("reward_shaping", "rewardShaping", True)),
            )
        )

    def reset(self, task_id: str, seed: int) -> Observation:
        try:
            map_seed = int(task_id)
        except ValueError:
            raise EnvironmentProblem(f"frozenlake task id {task_id!r}; expected an integer map seed") from None
        lake = _lake(self.config.size, self.config.hole_probability, map_seed, self.config.slippery)
        self._desc, self._phi = lake.desc, lake.potentials
        # gymnasium builds the map's transition table in __init__ (5 % of an actor's CPU under
        # py-spy at 2 x 256 episodes); it is read-only, so episodes share one per map.
        self._env = copy.copy(lake.env)
        state, _ = self._env.reset(seed=seed)
        self._state = int(state)
        self._invalid = self._steps = 0
        return Observation(f"{INSTRUCTION}\n{render(self._desc, self._state)}", self._info(False))

    def step(self, action: str) -> StepResult:
        if self._env is None:
            raise EnvironmentProblem("step before reset")
        self._steps += 1
        move = parse_action(action)
        if move is None:
            self._invalid += 1
            text = f"{INVALID}\n{render(self._desc, self._state)}"
            return StepResult(Observation(text, self._info(False)), 0.0, False)
        before = self._state
        state, reward, terminated, truncated, _ = self._env.step(move)
        self._state = int(state)
        success = bool(terminated and reward > 0)
        shaped = float(reward)
        if self.config.reward_shaping:
            shaped += float(self._phi[self._state] - self._phi[before])
        observation = Observation(render(self._desc, self._state), self._info(success))
        return StepResult(observation, shaped, bool(terminated), bool(truncated))

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    def _info(self, success: bool) -> dict[str, Any]:
        return {
            "metrics": {
                "success": 1.0 if success else 0.0,
                "invalid_actions": float(self._invalid),
                "steps": float(self._steps),
            },
            "state": self._state,
        }

    # Used by tests and scripted policies: the moves of one shortest safe path from the current state.
    def shortest_path(self) -> list[str]:
        size = self.config.size
        dist = goal_distances(self._desc)
        r, c = divmod(self._state, size)
        moves: list[str] = []
        deltas = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
        while dist[r, c] > 0:
            for name, (dr, dc) in deltas.items():
                nr, nc = r + dr, c + dc
                if 0 <= nr < size and 0 <= nc < size and dist[nr, nc] == dist[r, c] - 1:
                    moves.append(name)
                    r, c = nr, nc
                    break
        return moves


def expert_move(observation_words: Sequence[str], size: int) -> str:
    """The next move of a shortest safe path, read off the last grid in some observation words.

    A scripted expert that sees only what the model sees (tests, baselines, demonstrations).
    """
    cells = [w for w in observation_words if w in ("S", "F", "H", "G", "P")][-size * size :]
    desc = ["".join("F" if c == "P" else c for c in cells[r * size : (r + 1) * size]) for r in range(size)]
    state = cells.index("P")
    dist = goal_distances(desc)
    r, c = divmod(state, size)
    for name, (dr, dc) in (("left", (0, -1)), ("down", (1, 0)), ("right", (0, 1)), ("up", (-1, 0))):
        nr, nc = r + dr, c + dc
        if 0 <= nr < size and 0 <= nc < size and dist[nr, nc] == dist[r, c] - 1 and dist[nr, nc] >= 0:
            return name
    return "left"
