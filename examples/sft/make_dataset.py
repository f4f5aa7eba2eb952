"""Writes demos.jsonl beside this file: the SFT example's conversations (deterministic).

    python examples/sft/make_dataset.py

Each line is one chat conversation (``messages`` with roles) answering a sum of two digits from 0
to 4, the same prompts the answers example (examples/answers.yaml) plays, so the SFT stage's
export can warm-start that RL stage (docs/stages.md).
"""

from __future__ import annotations

import json
from pathlib import Path


def conversations() -> list[dict[str, object]]:
    return [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        for a in range(5)
        for b in range(5)
    ]


if __name__ == "__main__":
    out = Path(__file__).with_name("demos.jsonl")
    out.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    print(f"wrote {out} ({len(conversations())} conversations)")
