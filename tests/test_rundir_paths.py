"""The run directory's layout is spelled in one place (trainguard/core/contracts/rundir.py): no other
module joins a run directory with one of its top-level names (``run_dir / "telemetry"``); it
asks :class:`~trainguard.core.contracts.rundir.RunDir`."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from trainguard.core.contracts.rundir import DumpDir, RunDir

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"

STILL_SPELLED = {
    # The rollout fleet's modules, being restructured: LocalEngines' logs (RunDir.role_log) and
    # the weight store (RunDir.weights); empty this set then.
    ("rl/weights.py", "rl"),
}
"""(module, name) joins left outside RunDir."""


def layout_names() -> set[str]:
    """The first component, under the root, of every path RunDir gives (its top-level names,
    with any node, rank or attempt in them replaced by a pattern)."""
    root = RunDir("/r")
    names = set()
    for name, member in inspect.getmembers(RunDir):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            got = getattr(root, name)
        elif inspect.isfunction(member):
            if isinstance(inspect.getattr_static(RunDir, name), staticmethod):
                continue
            params = list(inspect.signature(member).parameters.values())[1:]
            if any(p.annotation not in ("int", int, "str", str) for p in params):
                continue  # takes a path (dump_dir_ok), not a name
            args = [0 if p.annotation in ("int", int) else "X" for p in params]
            got = member(root, *args)
        else:
            continue
        if isinstance(got, DumpDir):
            got = got.path
        if isinstance(got, Path):
            names.add(got.relative_to(root.root).parts[0].replace("X", "*"))
    return names


def spelled(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """(module, name) of every ``<path> / "<name>..."`` outside rundir.py whose first
    component is one of the layout's names."""
    names = layout_names()
    patterns = [re.compile(re.escape(n).replace(r"\*", ".*") + r"\Z") for n in names]
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == "core/contracts/rundir.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)):
                continue
            right, prefix_only = n.right, False
            if isinstance(right, ast.JoinedStr) and right.values:
                right, prefix_only = right.values[0], True  # f"prometheus_{node}.json"
            if isinstance(right, ast.Constant) and isinstance(right.value, str):
                first = right.value.split("/")[0]
                if prefix_only and "/" not in right.value:
                    hit = any(n.split("*")[0].startswith(first) and first for n in names)
                else:
                    hit = any(p.match(first) for p in patterns)
                if hit:
                    found.add((rel, first))
    return found


def test_the_layout_names_are_the_documented_ones() -> None:
    names = layout_names()
    for expected in ("events.jsonl", "telemetry", "roles", "rl", "health", "logs", "report.html",
                     "prometheus_*.json", "agent.mark"):  # fmt: skip
        assert expected in names, (expected, names)


def test_no_module_spells_a_run_directory_path() -> None:
    found = spelled()
    assert found <= STILL_SPELLED, (
        f"run-directory paths spelled outside trainguard/core/contracts/rundir.py (add them to RunDir "
        f"and use it): {sorted(found - STILL_SPELLED)}"
    )
    assert STILL_SPELLED <= found, f"gone: take off STILL_SPELLED: {STILL_SPELLED - found}"


def test_the_scan_finds_a_path(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        'from pathlib import Path\nP = Path("run") / "telemetry" / "x.json"\n'
        'Q = Path("run") / f"prometheus_{1}.json"\nR = Path("x") / "unrelated"\n'
    )
    assert spelled(tmp_path) == {("m.py", "telemetry"), ("m.py", "prometheus_")}
