"""The layering of the package (docs/architecture.md), checked by import-linter and grimp."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

from tests.launch_utils import REPO, base_env


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "lint-imports"
    cmd = [str(exe)] if exe.exists() else [shutil.which("lint-imports") or "lint-imports"]
    env = base_env()
    env["PYTHONPATH"] = str(cwd)  # the copy under test, not the repo
    return subprocess.run(
        [*cmd, "--no-cache", "--no-logo"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_keeps_its_contracts() -> None:
    r = _lint_imports(REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "5 kept, 0 broken" in r.stdout, r.stdout[-2000:]


def test_a_wrong_import_fails_lint_imports_naming_it(tmp_path: Path) -> None:
    """In a scratch copy: the core importing the agent, and one feature importing another."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(
        REPO / "trainguard", tmp_path / "trainguard", ignore=shutil.ignore_patterns("__pycache__")
    )
    events = tmp_path / "trainguard" / "core" / "events.py"
    events.write_text(
        events.read_text() + "\nfrom trainguard.runtime.agent import TrainGuardAgent\n"
    )
    interval = tmp_path / "trainguard" / "checkpoint" / "interval.py"
    interval.write_text(interval.read_text() + "\nimport trainguard.telemetry.mfu\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout[-3000:]
    out = r.stdout
    assert "trainguard.core.events -> trainguard.runtime.agent" in out, out[-4000:]
    assert "trainguard.checkpoint.interval -> trainguard.telemetry.mfu" in out, out[-4000:]
    assert "The core imports nothing of trainguard above it BROKEN" in out
    assert "Features are independent of each other BROKEN" in out


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_among_trainguard_modules() -> None:
    sys.path.insert(0, str(REPO))
    try:
        graph = grimp.build_graph("trainguard", cache_dir=None)
    finally:
        sys.path.remove(str(REPO))
    assert len(graph.modules) > 50
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_the_worker_start_up_hook_is_a_thin_file_import_linter_sees_behind() -> None:
    """runtime/_zygote has no ``__init__.py`` (it is a PYTHONPATH entry, not a package), so
    import-linter never reads ``sitecustomize.py``: the file imports one module of the package
    and nothing else, and that module (contract ``worker-hook``) imports only the core."""
    import ast

    hook = REPO / "trainguard" / "runtime" / "_zygote" / "sitecustomize.py"
    assert sorted(p.name for p in hook.parent.iterdir() if p.suffix == ".py") == [
        "sitecustomize.py"
    ]
    imported = set()
    for node in ast.walk(ast.parse(hook.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert {m for m in imported if m.startswith("trainguard")} == {"trainguard.runtime.workerhook"}
    assert imported - {"trainguard.runtime.workerhook"} <= {"os", "sys"}
    graph = grimp.build_graph("trainguard")
    ours = {
        m
        for m in graph.find_modules_directly_imported_by("trainguard.runtime.workerhook")
        if m.startswith("trainguard")
    }
    assert ours and all(m.startswith("trainguard.core") for m in ours), ours
