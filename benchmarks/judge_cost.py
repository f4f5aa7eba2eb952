"""What judging an honest fix costs: `run_tests` on the bundled `median` task, this tree vs a git ref.

    python benchmarks/judge_cost.py [--baseline main] [--runs 10] [--rounds 2]

Both trees are taken with `git archive` and laid out as the `stoker` package (as .ci/check does),
then timed in alternating fresh processes under the isolation in use (`STOKER_SANDBOX_ISOLATION`
picks the rlimits fallback): the median of ``--runs`` `run_tests` after one warm-up, per round,
in wall time and in CPU time of the run's processes (the harness, bwrap: steadier on a loaded machine).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPONENTS = ("actor", "buffer", "learner", "model", "rollout", "operator", "sizing")
TIMED = """
import resource, statistics, sys, tempfile, time
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # this tree, not the checkout's
sys.path.insert(0, sys.argv[1])
from stoker.actor.swe import SweEnvironment, solution_commands
env = SweEnvironment(tempfile.mkdtemp() + "/s")
env.reset("median", 0)
for command in solution_commands("median")[:-1]:
    env.step(command)
env.step("run_tests")  # warm-up: the isolation probes
times, cpu = [], []
for _ in range(int(sys.argv[2])):
    start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    assert env.step("run_tests").reward == 1.0
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    times.append(time.perf_counter() - start)
    cpu.append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)
print(f"{statistics.median(times) * 1000:.0f} ms wall, {statistics.median(cpu) * 1000:.0f} ms CPU of the run's processes")
"""


def package_tree(ref: str, into: Path) -> Path:
    """``ref``'s files as an importable ``stoker`` package under ``into/pkg``."""
    source, package = into / "src", into / "pkg" / "stoker"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    shutil.copytree(source / "stoker", package)
    for name in COMPONENTS:
        if (source / name).is_dir():
            (package / name).symlink_to(source / name)
    (package / "v1").symlink_to(source / "protos" / "stoker" / "v1")
    return into / "pkg"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--candidate", default="HEAD")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        trees = {ref: package_tree(ref, Path(work) / str(i)) for i, ref in enumerate((args.baseline, args.candidate))}
        for round_ in range(args.rounds):
            for ref, tree in trees.items():
                done = subprocess.run([sys.executable, "-c", TIMED, str(tree), str(args.runs)], capture_output=True, text=True)
                result = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
                print(f"round {round_ + 1}  {ref:>12}: median run_tests {result}", flush=True)


if __name__ == "__main__":
    main()
