"""The event contract (trainguard/core/contracts/event_kinds.py) matches the code: every kind the
source emits is registered, and every registered kind is emitted somewhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainguard.core.contracts import event_kinds
from trainguard.core.contracts.event_kinds import EVENTS, KINDS

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"
EMITTERS = {"emit", "_emit", "_emit_rank0", "publish"}
"""Calls that write or publish an event; their first argument is the kind."""
CONSTANTS = {
    name: value
    for name, value in vars(event_kinds).items()
    if name.isupper() and isinstance(value, str)
}
HOW = (
    "register it: add EventSpec(name=KIND, emitters=(MODULE,), fields=(...), "
    "description=...) to EVENTS in trainguard/core/contracts/event_kinds.py (MODULE relative to "
    "trainguard, e.g. 'runtime.agent'; fields: the keyword arguments of the emit call)"
)


def _func_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def scan(path: Path, rel: str) -> tuple[dict[str, list[str]], list[str]]:
    """(kind → where it is emitted, problems: emit calls whose kind cannot be read)."""
    tree = ast.parse(path.read_text())
    emitted: dict[str, list[str]] = {}
    problems: list[str] = []
    forwarding = set()  # functions that forward their ``kind`` argument to an emitter
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in EMITTERS:
            forwarding.add(fn)
    forwarded_names = {fn.args.args[1].arg for fn in forwarding if len(fn.args.args) > 1}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _func_name(node) in EMITTERS and node.args):
            continue
        where = f"{rel}:{node.lineno}"
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            emitted.setdefault(arg.value, []).append(where)
        elif isinstance(arg, ast.Name | ast.Attribute):
            name = arg.id if isinstance(arg, ast.Name) else arg.attr
            if name in CONSTANTS or name == "MSG_STRAGGLER_SCORES":
                kind = CONSTANTS.get(name, event_kinds.STRAGGLER_SCORES)
                emitted.setdefault(kind, []).append(where)
            elif not (isinstance(arg, ast.Name) and name in forwarded_names):
                problems.append(
                    f"{where}: the kind {ast.unparse(arg)} is not a literal or a constant of trainguard.core.contracts.event_kinds"
                )
        else:
            problems.append(f"{where}: the kind {ast.unparse(arg)} is not a literal")
    return emitted, problems


def scan_package() -> tuple[dict[str, list[str]], list[str]]:
    emitted: dict[str, list[str]] = {}
    problems: list[str] = []
    for p in sorted(PACKAGE.rglob("*.py")):
        got, bad = scan(p, str(p.relative_to(PACKAGE.parent)))
        for k, w in got.items():
            emitted.setdefault(k, []).extend(w)
        problems += bad
    return emitted, problems


def test_every_emitted_kind_is_registered() -> None:
    emitted, problems = scan_package()
    assert not problems, "\n".join(problems)
    unregistered = {k: w for k, w in emitted.items() if k not in KINDS}
    assert not unregistered, (
        "event kinds emitted but not registered: "
        + "; ".join(f"{k!r} at {', '.join(w)}" for k, w in sorted(unregistered.items()))
        + f". {HOW}"
    )


def test_every_registered_kind_is_emitted() -> None:
    emitted, _ = scan_package()
    never = sorted(KINDS - set(emitted))
    assert not never, (
        f"registered event kinds that no code emits: {never}; remove their EventSpec from "
        "trainguard/core/contracts/event_kinds.py or emit them"
    )


def test_registered_emitters_are_where_the_kind_is_emitted() -> None:
    emitted, _ = scan_package()
    wrong = []
    for spec in EVENTS:
        modules = {
            w.split(":")[0][len("trainguard/") : -len(".py")].replace("/", ".")
            for w in emitted.get(spec.name, [])
        }
        if set(spec.emitters) != modules:
            wrong.append(
                f"{spec.name}: registered {sorted(spec.emitters)}, emitted in {sorted(modules)}"
            )
    assert not wrong, "\n".join(wrong)


def test_names_are_unique() -> None:
    names = [s.name for s in EVENTS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("source", "unregistered"),
    [
        ("def f(ev):\n    ev.emit('no_such_kind', x=1)\n", {"no_such_kind"}),
        ("def f(ev):\n    ev.emit('restart')\n", set()),
        (
            "from trainguard.core.contracts.event_kinds import JOB_FINISHED\nev.emit(JOB_FINISHED)\n",
            set(),
        ),
    ],
)
def test_the_scan_finds(tmp_path: Path, source: str, unregistered: set[str]) -> None:
    p = tmp_path / "m.py"
    p.write_text(source)
    emitted, problems = scan(p, "m.py")
    assert not problems
    assert set(emitted) - KINDS == unregistered


def test_a_computed_kind_is_a_problem(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("def f(ev, k):\n    ev.emit('x_' + k)\n")
    assert scan(p, "m.py")[1]
