"""Benchmarks measure the project's code: no bench/ module imports the test suite's helpers
(tests.*), but for the ones listed below, each still to be moved."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"

STILL_IMPORTED = {
    # the torchft kill harness, shared with tests/test_ft.py
    ("fast_restart.py", "tests.ft_harness"),
    ("ft.py", "tests.ft_harness"),
    # the goodput lineage of a chain of restarts, shared with tests/test_rollback.py
    ("goodput.py", "tests.lineage"),
    # an etcd server (TLS, auth), shared with the etcd, spares and security tests
    ("recovery.py", "tests.services.etcd_service"),
    ("rendezvous_scale.py", "tests.services.etcd_service"),
}
"""(bench module, tests module) imports left; take each off once the bench has its own."""


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
    assert found <= STILL_IMPORTED, f"bench imports test code: {sorted(found - STILL_IMPORTED)}"
    assert STILL_IMPORTED <= found, f"gone: take off STILL_IMPORTED: {STILL_IMPORTED - found}"


def test_the_scan_finds_an_import(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("from tests.services.postgres_service import Postgres\n")
    assert bench_imports(tmp_path) == {("b.py", "tests.services.postgres_service")}
