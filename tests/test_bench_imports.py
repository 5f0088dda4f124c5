"""Benchmarks measure the project's code: no bench/ module imports the test suite's helpers
(tests.*). What both share (ports, the etcd and PostgreSQL services, the torchft kill harness,
the goodput lineage) is in trainguard.testing."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_imports(root: Path = BENCH) -> set[tuple[str, str]]:
    found = set()
    for path in sorted(root.glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(n, ast.ImportFrom) and n.module:
                names = [n.module]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            for name in names:
                if name == "tests" or name.startswith("tests."):
                    found.add((path.name, name))
    return found


def test_no_bench_imports_the_tests() -> None:
    found = bench_imports()
    assert not found, f"bench imports test code: {sorted(found)}"


def test_the_scan_finds_an_import(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("from tests.launch_utils import base_env\nimport tests.procs\n")
    assert bench_imports(tmp_path) == {("b.py", "tests.launch_utils"), ("b.py", "tests.procs")}
