"""The user docs stay true to the code: links resolve, named files and commands exist, and the
tables that restate code (RBAC, conditions, event reasons, metrics) match it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stoker.cli import SUBCOMMANDS, build_parser
from stoker.operator.rbac import OPERATOR_RULES
from stoker.status import CONDITION_TYPES

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# Pages this project owes its users (docs/operator.md is the operator's own reference).
REQUIRED = {"install.md", "local.md", "gke.md", "sizing.md", "metrics.md", "troubleshooting.md", "architecture.md", "gitops.md"}


def text(name: str) -> str:
    return (DOCS / name).read_text()


def test_every_promised_page_exists() -> None:
    assert REQUIRED <= {p.name for p in PAGES}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    prose = re.sub(r"`[^`\n]*`", "", page.read_text())  # code spans (regex patterns) hold no links
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_repository_files_exist(page: Path) -> None:
    """Paths such as `examples/gke-v5e-frozenlake.yaml`, `helm/stoker/values.yaml`, `examples/gitops/`
    (a file with an extension, or a folder with its slash; `stoker/actor` is an image name)."""
    top = r"(?:examples|helm|crds|docs|operator|stoker|tests|benchmarks|learner|actor|buffer|runner)"
    pattern = rf"(?<![\w/.:-])({top}/(?:[\w-]+/)*(?:[\w-]+\.[a-z]+|[\w-]+/|))(?![\w*<])"
    found = set(re.findall(pattern, page.read_text()))
    for path in found:
        assert (REPO / path).exists(), f"{page.name} names {path}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_stoker_commands_are_real_subcommands(page: Path) -> None:
    # A command starts a line (code blocks) or an inline code span; "helm install stoker helm/..." is not one.
    for command in re.findall(r"(?:^\s*|`)stoker ([a-z][a-z-]*)", page.read_text(), re.M):
        assert command in SUBCOMMANDS, f"{page.name} mentions `stoker {command}`, not a stoker subcommand"


def test_architecture_has_a_diagram() -> None:
    assert "```mermaid" in text("architecture.md")


def test_install_rbac_table_matches_the_operator_table() -> None:
    """docs/install.md lists what the chart grants; it must say what operator/rbac.py says."""
    documented: dict[tuple[str, str], set[str]] = {}
    for group, resources, verbs in re.findall(r"^\| `?([\w.-]+)`? \| (`[\w/]+`(?:, `[\w/]+`)*) \| ([a-z, ]+) \|", text("install.md"), re.M):
        for resource in re.findall(r"`([\w/]+)`", resources):
            documented[("" if group == "core" else group, resource)] = {v.strip() for v in verbs.split(",")}
    expected = {(r.api_group, r.resource): set(r.verbs) for r in OPERATOR_RULES if r.scope == "namespace" and not r.peering}
    assert documented == expected, {k: (documented.get(k), expected.get(k)) for k in documented.keys() | expected.keys() if documented.get(k) != expected.get(k)}


def test_troubleshooting_explains_every_condition_and_its_reasons() -> None:
    page = text("troubleshooting.md")
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]*) \|", page, re.M)}
    assert set(CONDITION_TYPES) <= set(rows), f"undocumented conditions: {set(CONDITION_TYPES) - set(rows)}"
    status_code = "\n".join(p.read_text() for p in (REPO / "operator").glob("*.py"))
    for condition, reasons in rows.items():
        for reason in re.findall(r"`(\w+)`", reasons):
            assert f'"{reason}"' in status_code, f"troubleshooting.md: {condition} reason {reason} is not one the operator sets"


def test_event_reasons_named_in_docs_are_emitted_by_the_operator() -> None:
    operator_code = "\n".join(p.read_text() for p in (REPO / "operator").glob("*.py"))
    # "events `A` and `B` (Warning)", "events `A` / `B`", "event `A`": the reasons after "event(s)".
    runs = re.findall(r"events?\s((?:`\w+`(?:\s\(\w+\))?(?:,?\s(?:and|or|/)\s|,\s)?)+)", text("troubleshooting.md"))
    reasons = {r for run in runs for r in re.findall(r"`(\w+)`", run)} - {"FailedScaleUp"}  # that one is GKE's
    assert {"TightenedAdmission", "ScaledDownActors", "ScaledUpActors", "RelaxedAdmission", "ReapedZombieSandboxes"} <= reasons
    for reason in reasons:
        assert f'"{reason}"' in operator_code, f"troubleshooting.md names event {reason}, which the operator never posts"


def documented_commands(page: Path) -> list[list[str]]:
    """Each `stoker ...` line inside the page's fenced code blocks, as argv (pipes and comments cut)."""
    commands = []
    for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].split(" | ", 1)[0].split(" && ", 1)[0].strip()
            match = re.match(r"^(?:\.venv/bin/)?stoker (.*)$", line)
            if match:
                commands.append(shlex.split(match.group(1)))
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_documented_stoker_command_lines_parse(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag a page tells users to type is one the real parser accepts."""
    for argv in documented_commands(page):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exc:
            if exc.code in (0, None):  # --help / --version
                continue
            pytest.fail(f"{page.name}: `stoker {' '.join(argv)}` is rejected: {capsys.readouterr().err.strip()}")


def exported_metrics() -> set[str]:
    """Names the learner, the buffer and the operator really expose (counters with `_total`)."""
    from prometheus_client import generate_latest

    from stoker.buffer.metrics import build_registry
    from stoker.learner.metrics import MetricsSink
    from stoker.operator.metrics import OperatorMetrics
    from stoker.v1 import buffer_pb2

    buffer_registry, _ = build_registry(lambda: buffer_pb2.BufferStats())
    names: set[str] = set()
    for registry in (buffer_registry, MetricsSink(None).registry, OperatorMetrics().registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                if name.endswith("_created"):
                    continue
                names.add(name if kind != "counter" or name.endswith("_total") else f"{name}_total")
    return names


def mentioned_metrics(body: str) -> set[str]:
    names = set(re.findall(r"\b(stoker_(?:learner|buffer|rljob|operator)_\w+)", body))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def test_metrics_page_documents_every_exported_metric_and_only_those() -> None:
    exported, documented = exported_metrics(), mentioned_metrics(text("metrics.md"))
    assert exported - documented == set(), "exported but undocumented"
    assert documented - exported == set(), "documented but not exported"


def test_dashboard_queries_only_exported_metrics() -> None:
    import json

    dashboard = json.loads((DOCS / "dashboards" / "stoker.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = mentioned_metrics("\n".join(queries))
    assert used and used <= exported_metrics(), used - exported_metrics()
    # Every other page that names a metric names a real one, too.
    for page in PAGES:
        assert mentioned_metrics(page.read_text()) <= exported_metrics(), page.name


def test_install_values_table_names_real_chart_values() -> None:
    import yaml

    values = yaml.safe_load((REPO / "helm" / "stoker" / "values.yaml").read_text())
    table = text("install.md").split("| Value | Default | Meaning |", 1)[1].split("\n\n", 1)[0]
    keys = [k for row in table.splitlines()[2:] for k in re.findall(r"`([\w.]+)`", row.split("|")[1])]
    assert len(keys) > 10
    for key in keys:
        node = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"install.md documents {key}, which values.yaml lacks"
            node = node[part]
