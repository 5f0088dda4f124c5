"""One spelling per vocabulary: the values that cross package lines (failure causes, verdicts,
recovery actions, role names, event kinds) are spelled in one place in trainguard/core, and
every other module reads them from there.

The scan is ast-based: a tuple, list, set, dict or enum body outside a vocabulary's definition
that holds several of its values is a second spelling, and fails here with where it is."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainguard.core.config.roles import ROLE_NAMES
from trainguard.core.contracts import envvars, metrics
from trainguard.core.contracts.actions import Cause, RecoveryAction, Verdict
from trainguard.core.contracts.event_kinds import KINDS

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"


@dataclass(frozen=True)
class Vocabulary:
    name: str
    values: frozenset[str]
    owners: frozenset[tuple[str, str]]
    """(module relative to trainguard/, class or constant name): where it is spelled."""
    at_least: int
    """Values of this vocabulary one collection must hold to count as a second spelling (the
    short common words of a vocabulary, such as ``restart``, appear in others' too)."""


_ACTIONS = "core/contracts/actions.py"
VOCABULARIES = [
    Vocabulary(
        "failure cause (trainguard.core.contracts.actions.Cause)",
        frozenset(c.value for c in Cause),
        frozenset({(_ACTIONS, "Cause")}),
        3,
    ),
    Vocabulary(
        "verdict (trainguard.core.contracts.actions.Verdict; its actions are RecoveryAction's)",
        frozenset(v.value for v in Verdict),
        frozenset({(_ACTIONS, "Verdict"), (_ACTIONS, "RecoveryAction")}),
        3,
    ),
    Vocabulary(
        "recovery action (trainguard.core.contracts.actions.RecoveryAction)",
        frozenset(a.value for a in RecoveryAction),
        frozenset({(_ACTIONS, "RecoveryAction")}),
        3,
    ),
    Vocabulary(
        "role name (trainguard.core.contracts.metrics.ROLES)",
        frozenset(metrics.ROLES),
        # envvars.ROLE_URLS / ROLE_TOKENS: role → its URL / token variable, keyed by every role
        # (held equal to ROLES below; envvars imports nothing of trainguard: workers read it at
        # start-up)
        frozenset(
            {
                ("core/contracts/metrics.py", "ROLES"),
                ("core/contracts/envvars.py", "ROLE_URLS"),
                ("core/contracts/envvars.py", "ROLE_TOKENS"),
            }
        ),
        2,
    ),
]

KINDS_BY_CONSTANT_ONLY = ("fleet", "chaos", "recovery/plugin.py")
"""Packages and modules that name event kinds only through trainguard.core.contracts.event_kinds'
constants (never a literal ``"node_refused"``)."""


def _strings(nodes: list[ast.expr | None]) -> set[str]:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = n.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def collections(tree: ast.Module) -> list[tuple[int, str | None, set[str]]]:
    """(line, the class or constant it defines, its string values) of every literal
    collection and enum-like class body."""
    owner_of: dict[int, str] = {}
    for n in tree.body:
        if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    owner_of[id(n.value)] = t.id
    found: list[tuple[int, str | None, set[str]]] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Tuple | ast.List | ast.Set):
            found.append((n.lineno, owner_of.get(id(n)), _strings(list(n.elts))))
        elif isinstance(n, ast.Dict):
            found.append((n.lineno, owner_of.get(id(n)), _strings(list(n.keys))))
        elif isinstance(n, ast.ClassDef):
            values = [s.value for s in n.body if isinstance(s, ast.Assign)]
            found.append((n.lineno, n.name, _strings(list(values))))
    return found


def second_spellings(root: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        for line, defines, values in collections(ast.parse(path.read_text())):
            for v in VOCABULARIES:
                if (rel, defines) in v.owners:
                    continue
                common = values & v.values
                if len(common) >= v.at_least:
                    problems.append(
                        f"trainguard/{rel}:{line}: {sorted(common)} spell the {v.name} "
                        "again; import it from there"
                    )
    return problems


def literal_kinds(root: Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if not any(rel == m or rel.startswith(m + "/") for m in KINDS_BY_CONSTANT_ONLY):
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and n.value in KINDS and id(n) not in docs:
                problems.append(
                    f"trainguard/{rel}:{n.lineno}: the event kind {n.value!r} as a literal; "
                    "use its constant in trainguard/core/contracts/event_kinds.py (add one there)"
                )
    return problems


def test_no_vocabulary_is_spelled_twice() -> None:
    problems = second_spellings()
    assert not problems, "\n".join(problems)


def test_event_kinds_only_through_the_registry() -> None:
    problems = literal_kinds()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        'CAUSES = ("user_code", "hardware", "network")\n',
        "class V(str, Enum):\n    A = 'stop'\n    B = 'evict'\n    C = 'rollback'\n",
        'URLS = {"rollout": 1, "reward": 2}\n',
    ],
)
def test_the_scan_finds_a_second_spelling(tmp_path: Path, source: str) -> None:
    (tmp_path / "mod.py").write_text(source)
    assert len(second_spellings(tmp_path)) == 1, source


def test_the_scan_finds_a_literal_kind(tmp_path: Path) -> None:
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "mod.py").write_text('"""node_refused in a docstring."""\n'
                                               'emit("node_refused")\n')  # fmt: skip
    assert [p.split(":")[1] for p in literal_kinds(tmp_path)] == ["2"]


def test_derived_tuples_match_their_enums() -> None:
    assert metrics.ATTRIBUTION_CAUSES == tuple(c.value for c in Cause)
    assert ROLE_NAMES == metrics.ROLES
    assert set(envvars.ROLE_URLS) == set(metrics.ROLES)
    assert set(envvars.ROLE_TOKENS) == set(metrics.ROLES)


def test_a_verdict_that_is_an_action_is_that_action() -> None:
    actions = {a.value for a in RecoveryAction}
    for v in Verdict:
        if v.value in actions:
            assert v.action is RecoveryAction(v.value)
        else:  # rollback and retry: restarts (from the last checkpoint; once the store answers)
            assert v.action is RecoveryAction.RESTART
    # Verdict spells none of the actions' values itself: they are RecoveryAction's
    tree = ast.parse((PACKAGE / _ACTIONS).read_text())
    verdict = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Verdict")
    own = _strings([s.value for s in verdict.body if isinstance(s, ast.Assign)])
    assert not own & actions, own & actions


def test_every_exit_code_means_one_thing() -> None:
    """The exit codes trainguard gives meaning to (a worker's to its agent, ``trainguard
    run``'s to a scheduler) are distinct: a batch script or an agent that reads one code
    never takes it for another."""
    import trainguard.core.failures as failures
    import trainguard.core.inprocess as inprocess
    import trainguard.runtime.workerhook as workerhook

    codes: dict[int, list[str]] = {}
    for mod in (failures, inprocess, workerhook):
        for name, value in vars(mod).items():
            if name.endswith("_EXIT_CODE") and isinstance(value, int):
                codes.setdefault(value, []).append(f"{mod.__name__}.{name}")
    assert len(codes) >= 6, codes
    shared = {c: names for c, names in codes.items() if len(names) > 1}
    assert not shared, f"exit codes with two meanings: {shared}"
