"""Guard: `trainguard run` accepts exactly torchrun's flags (plus its own), same meaning."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed import run as torchrun

from trainguard.runtime.launcher import build_parser

OWN = {
    "--config",
    "--tg-run-dir",
    "--ft",
    "--tg-restart-budget",
    "--tg-warm",
    "--no-tg-warm",
    "--tg-role",
}


def _actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in p._actions for opt in a.option_strings}


def test_same_flags_same_meaning() -> None:
    theirs, ours = _actions(torchrun.get_args_parser()), _actions(build_parser())
    assert set(ours) - set(theirs) == OWN
    assert set(theirs) <= set(ours)
    for opt, a in theirs.items():
        b = ours[opt]
        # local helper types are new function objects per parser: compare by name
        type_a = getattr(a.type, "__qualname__", a.type)
        type_b = getattr(b.type, "__qualname__", b.type)
        assert (a.dest, a.default, type_a, a.choices, a.nargs, type(a)) == (
            b.dest,
            b.default,
            type_b,
            b.choices,
            b.nargs,
            type(b),
        ), opt
    # trainguard's own options are no prefix of a torchrun flag and vice versa
    for own in OWN:
        assert not any(
            t.startswith(own) or own.startswith(t + "-") for t in theirs if t.startswith("--")
        ), own


@pytest.mark.parametrize(
    ("env", "dest", "value"),
    [
        ({"PET_NPROC_PER_NODE": "3"}, "nproc_per_node", "3"),
        ({"PET_MAX_RESTARTS": "4"}, "max_restarts", 4),
        ({"PET_STANDALONE": "1"}, "standalone", True),
        ({"PET_RDZV_ENDPOINT": "h:1"}, "rdzv_endpoint", "h:1"),
    ],
)
def test_pet_env_defaults(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], dest: str, value: object
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = torchrun.get_args_parser().parse_args(["x.py"])
    b = build_parser().parse_args(["x.py"])
    assert getattr(a, dest) == getattr(b, dest) == value


def test_underscore_aliases_parse_the_same() -> None:
    argv = ["--nproc_per_node", "2", "--max_restarts", "1", "--rdzv_backend", "c10d", "s.py", "--a"]
    a = vars(torchrun.get_args_parser().parse_args(argv))
    b = vars(build_parser().parse_args(argv))
    assert {k: v for k, v in b.items() if not k.startswith("tg_")} == a
