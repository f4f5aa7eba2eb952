"""Writes arithmetic.jsonl beside this file: the answers example's tasks (deterministic).

    python examples/answers/make_dataset.py

Sums of two digits from 0 to 4, answered with one digit and scored by the numeric verifier; small
enough that a ~100k-parameter policy learns the table from scratch on a CPU in minutes.
"""

from __future__ import annotations

import json
from pathlib import Path


def tasks() -> list[dict[str, object]]:
    return [
        {"id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "verifier": "numeric", "answer": a + b}
        for a in range(5)
        for b in range(5)
    ]


if __name__ == "__main__":
    out = Path(__file__).with_name("arithmetic.jsonl")
    out.write_text("".join(json.dumps(task) + "\n" for task in tasks()))
    print(f"wrote {out} ({len(tasks())} tasks)")
