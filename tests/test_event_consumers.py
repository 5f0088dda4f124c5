"""The event contract on the consumer side: every event kind the source compares anything
with (report, pager, summary, goodput, recorder, ...) is registered in
trainguard/core/contracts/event_kinds.py, and so is every field read from an event inside a branch that
matched one kind; a consumer in another package than the kind's emitters compares with the
kind's constant, never a literal. (tests/test_event_kinds.py holds the emitters to it.)"""

from __future__ import annotations

import ast
from pathlib import Path

from trainguard.core.contracts import event_kinds
from trainguard.core.contracts.event_kinds import KINDS, by_name

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"
CONSTANTS = {
    name: value
    for name, value in vars(event_kinds).items()
    if name.isupper() and isinstance(value, str) and value in KINDS
}
COMMON = {"time", "kind", "node", "attempt", "agent_restarts", "rank", "generation"}
"""Fields every event (or every agent's / worker's event) carries (trainguard.core.events)."""
RECORD_KINDS = {"step", "log", "span", "sniff"}
"""The kinds of the per-rank metrics records (``metrics/rank_R.jsonl``, trainguard.core.contracts.metrics),
which the same readers match: not events."""
OTHER_KINDS = {
    "trainguard/chaos/faults.py": "a fault's kind (kill, hang, slow, exit)",
    "trainguard/checkpoint/jsoncodec.py": "an encoded value's type",
    "trainguard/checkpoint/memtier/store.py": "a snapshot's tier (local, replica)",
    "trainguard/telemetry/prometheus.py": "a metric's type (counter, histogram)",
}
"""Modules where a ``kind`` is something else than an event's."""
EVENT_NAMES = {"e", "ev", "event", "evt", "rec", "r", "x"}
"""Names the source gives an event dict (``e.get("kind")``)."""


def _is_kind_expr(node: ast.AST) -> bool:
    """``kind``, ``e["kind"]``, ``e.get("kind")`` (``str(...)`` around either)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str":
        return bool(node.args) and _is_kind_expr(node.args[0])
    if isinstance(node, ast.Name):
        return node.id in ("kind", "event_kind")
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return (
            node.func.attr == "get"
            and bool(node.args)
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "kind"
        )
    return False


def _kinds_in(node: ast.AST) -> list[str] | None:
    """The kinds a comparator names: a literal, a constant, or a tuple/list/set of them
    (None: something else, e.g. a variable)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return [CONSTANTS[node.id]]
    if isinstance(node, ast.Attribute) and node.attr in CONSTANTS:
        return [CONSTANTS[node.attr]]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        out: list[str] = []
        for elt in node.elts:
            got = _kinds_in(elt)
            if got is None:
                return None
            out += got
        return out
    return None


def _compared_kinds(test: ast.AST) -> list[tuple[list[str], ast.Compare]]:
    found = []
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(_is_kind_expr(s) for s in sides):
            continue
        if isinstance(node.ops[0], ast.In | ast.NotIn) and not _is_kind_expr(node.left):
            continue  # "hang" in kind: a substring test, not a kind
        for s in sides:
            if _is_kind_expr(s):
                continue
            kinds = _kinds_in(s)
            if kinds is not None:
                found.append((kinds, node))
    return found


def _field_reads(nodes: list[ast.stmt] | ast.AST) -> list[tuple[str, int]]:
    """``ev.get("f")`` / ``ev["f"]`` on an event-named variable."""
    out = []
    roots = nodes if isinstance(nodes, list) else [nodes]
    for root in roots:
        for node in ast.walk(root):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in EVENT_NAMES
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.append((node.args[0].value, node.lineno))
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id in EVENT_NAMES
                and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)
            ):
                out.append((node.slice.value, node.lineno))
    return out


def _foreign_literals(tree: ast.AST, package: str) -> list[tuple[str, int]]:
    """Kinds compared as a string literal in ``package`` that no module of ``package`` emits."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for _, cmp in _compared_kinds(node):
            for lit in ast.walk(cmp):
                if not (isinstance(lit, ast.Constant) and lit.value in KINDS):
                    continue
                if package not in {e.split(".")[0] for e in by_name(lit.value).emitters}:
                    out.append((lit.value, lit.lineno))
    return out


def test_consumers_in_other_packages_compare_with_the_constants() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "trainguard/core/contracts/event_kinds.py" or rel in OTHER_KINDS:
            continue
        package = rel.split("/")[1].removesuffix(".py")
        for kind, line in _foreign_literals(ast.parse(path.read_text()), package):
            bad.append(f"{rel}:{line}: {kind!r} (use event_kinds.{kind.upper()})")
    assert bad == [], "a literal kind another package emits: " + "; ".join(bad)
    code = "def f(e):\n    return e.get('kind') == 'worker_failed'\n"
    assert _foreign_literals(ast.parse(code), "telemetry") == [("worker_failed", 2)]
    assert _foreign_literals(ast.parse(code), "runtime") == []  # the emitter's own package


def _scan() -> tuple[list[str], list[str], int, int]:
    """(unregistered kinds compared, unregistered fields read, kinds seen, branches seen)."""
    bad_kinds, bad_fields, n_kinds, n_branches = [], [], 0, 0
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "trainguard/core/contracts/event_kinds.py" or rel in OTHER_KINDS:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for kinds, cmp in _compared_kinds(node) if isinstance(node, ast.Compare) else []:
                for k in kinds:
                    n_kinds += 1
                    if k not in KINDS and k not in RECORD_KINDS:
                        bad_kinds.append(f"{rel}:{cmp.lineno}: kind {k!r}")
            if not isinstance(node, ast.If):
                continue
            matched = {k for kinds, c in _compared_kinds(node.test) for k in kinds if k in KINDS}
            if len(matched) != 1 or not any(
                isinstance(c.ops[0], ast.Eq) for _, c in _compared_kinds(node.test)
            ):
                continue
            (kind,) = matched
            n_branches += 1
            allowed = COMMON | set(by_name(kind).fields)
            for f, line in _field_reads([node.test, *node.body]):
                if f not in allowed:
                    bad_fields.append(f"{rel}:{line}: field {f!r} of {kind!r}")
    return bad_kinds, bad_fields, n_kinds, n_branches


def test_every_kind_compared_and_field_read_is_registered() -> None:
    bad_kinds, bad_fields, n_kinds, n_branches = _scan()
    assert n_kinds > 20 and n_branches > 5  # the scan sees the consumers
    assert bad_kinds == [], "compared with kinds nothing registers: " + "; ".join(bad_kinds)
    assert bad_fields == [], (
        "read fields the kind's EventSpec does not list (add them to its fields, or read "
        "what the emitter writes): " + "; ".join(bad_fields)
    )


def test_the_scan_catches_an_unknown_kind_and_an_unknown_field(tmp_path: Path) -> None:
    code = (
        "def f(ev):\n"
        "    if ev.get('kind') in ('preflight', 'probe'):\n"
        "        pass\n"
        "    if ev['kind'] == 'job_finished':\n"
        "        return ev.get('restart_count')\n"
    )
    tree = ast.parse(code)
    kinds = [
        k
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        for ks, _ in _compared_kinds(n)
        for k in ks
    ]
    assert "probe" in kinds and "probe" not in KINDS
    branch = next(
        n for n in ast.walk(tree) if isinstance(n, ast.If) and "job_finished" in ast.unparse(n.test)
    )
    reads = {f for f, _ in _field_reads(branch.body)}
    assert "restart_count" in reads and "restart_count" not in by_name("job_finished").fields
