"""The framework internals the integrations use (trainguard/integrations/_frameworks.py):
each one exists on the installed transformers / Lightning, only that module names them, and a
broken one turns into a warning, an event and resume off, never an exception."""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_torch_privates import missing
from trainguard.integrations import _frameworks
from trainguard.integrations._frameworks import PRIVATES, TESTED, check_version, guarded

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"


def test_every_framework_private_used_exists() -> None:
    gone = [m for m in (missing(*p) for p in PRIVATES) if m is not None]
    versions = {f: check_version(f) for f in TESTED}
    assert not gone, (
        f"framework internals the integrations use are missing on {versions}: {gone}; adapt "
        "trainguard/integrations/_frameworks.py and the callbacks"
    )


def test_only_the_integrations_name_the_framework_privates() -> None:
    names = {name for _, _, name in PRIVATES if name.startswith("_")}
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "integrations":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in names:
                users.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.attr}")
    assert users == []


def test_the_installed_frameworks_are_in_the_tested_range() -> None:
    for framework, (_, lo, hi) in TESTED.items():
        found = check_version(framework)
        assert found is not None, framework
        assert lo <= tuple(int(x) for x in found.split(".")[:2]) <= hi, (framework, found)


def test_a_broken_internal_is_one_warning_and_one_event(caplog: pytest.LogCaptureFixture) -> None:
    emitted: list[tuple[str, dict]] = []
    tg = SimpleNamespace(rank=0, events=SimpleNamespace(emit=lambda k, **f: emitted.append((k, f))))

    def renamed() -> None:
        raise AttributeError("'_TrainingEpochLoop' object has no attribute '_batches_that_stepped'")

    with caplog.at_level(logging.WARNING, logger=_frameworks.__name__):
        ok, value = guarded(tg, "lightning", "restoring trainguard's snapshot", renamed)
    assert (ok, value) == (False, None)
    assert [r.getMessage() for r in caplog.records] == [
        "trainguard: lightning integration: restoring trainguard's snapshot failed "
        "(AttributeError: '_TrainingEpochLoop' object has no attribute '_batches_that_stepped'); "
        "training goes on with resume off"
    ]
    [(kind, fields)] = emitted
    assert kind == "integration_degraded" and fields["framework"] == "lightning"
    assert "_batches_that_stepped" in fields["error"]
    assert guarded(tg, "lightning", "x", lambda: 3) == (True, 3)
