"""A worker's environment under ``trainguard run`` is torchrun's plus documented
``TRAINGUARD_*`` names (:data:`trainguard.core.contracts.envvars.ALL`, listed in
docs/reference/environment.md; a plugin's ``worker_env`` may declare no other), for every way
torch starts a worker (``--start-method spawn`` / ``fork``, a ``--no-python`` program):
trainguard's start-up hook leaves nothing behind, in the script nor in any Python it starts.
Real launchers, side by side.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.launch_utils import WORKERS, base_env, launch
from trainguard.core import flight_recorder
from trainguard.core.contracts import envvars
from trainguard.recovery.plugin import ERROR_FILE_HOOK
from trainguard.runtime.workerhook import HOOK_DIR

TREE = str(WORKERS / "env_tree.py")
VARYING = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "DUMP_DIR"}
"""Values that differ between two launches by design (ports, ids, per-launch paths)."""
ADDED = set(envvars.ALL) - {envvars.WORKER_HOOKS}
"""What trainguard may add to the environment a script sees (WORKER_HOOKS is removed by the
hook before the script runs)."""


def _launch_both(tmp_path: Path, mode: str) -> dict[str, dict]:
    out = {}
    for which in ("torchrun", "trainguard"):
        d = tmp_path / which
        (d / "dump").mkdir(parents=True)
        args = ["--standalone", "--nproc-per-node", "2"]
        if mode == "no_python":
            script = d / "w.sh"
            # the program's own environment, then a Python it starts
            script.write_text(
                f'#!/bin/sh\nenv -0 > "$DUMP_DIR/sh_$RANK.env"\nexec "{sys.executable}" "{TREE}"\n'
            )
            script.chmod(0o755)
            args += ["--no-python", str(script)]
        else:
            args += ["--start-method", mode, TREE]
        if which == "trainguard":
            # fork: cold starts (the hook's entries in the initial environment); spawn: the
            # node's first start from its warm processes (started before the entries existed)
            cold = ["--no-tg-warm"] if mode == "fork" else []
            args = ["--tg-run-dir", str(d / "run"), *cold, *args]
        r = launch(which, args, cwd=tmp_path, env=base_env(DUMP_DIR=str(d / "dump")))
        assert r.returncode == 0, f"{which} failed:\n{r.stderr[-3000:]}"
        dumps = {}
        for rank in (0, 1):
            dump = json.loads((d / "dump" / f"tree_{rank}.json").read_text())
            if mode == "no_python":
                raw = (d / "dump" / f"sh_{rank}.env").read_bytes().split(b"\0")
                dump["program"] = dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)
            dumps[rank] = dump
        out[which] = dumps
    return out


def _diff(torchrun: dict[str, str], trainguard: dict[str, str]) -> list[str]:
    """What trainguard's environment has that torchrun's has not (besides :data:`ADDED`), or
    lacks, or holds with another value."""
    problems = []
    for k in sorted(set(torchrun) | set(trainguard)):
        if k in ADDED and k not in torchrun:
            continue
        if k not in trainguard or k not in torchrun:
            problems.append(f"{k}: torchrun {torchrun.get(k)!r}, trainguard {trainguard.get(k)!r}")
        elif k not in VARYING and torchrun[k] != trainguard[k]:
            problems.append(f"{k}: torchrun {torchrun[k]!r}, trainguard {trainguard[k]!r}")
    return problems


@pytest.mark.parametrize("mode", ["spawn", "fork", "no_python"])
def test_worker_environment_is_torchruns_plus_documented_names(tmp_path: Path, mode: str) -> None:
    res = _launch_both(tmp_path, mode)
    for rank in (0, 1):
        tr, tg = res["torchrun"][rank], res["trainguard"][rank]
        views = ["env", "child"] + (["program"] if mode == "no_python" else [])
        for view in views:
            assert _diff(tr[view], tg[view]) == [], (mode, rank, view)
            assert HOOK_DIR not in tg[view].get("PYTHONPATH", ""), (mode, view)
        # trainguard's own names are there (the comparison above is not vacuous)
        assert tg["env"][envvars.RUN_DIR] == str(tmp_path / "trainguard" / "run")
        if mode == "no_python":
            # a program trainguard cannot hook gets no hook at all
            assert HOOK_DIR not in tg["initial"].get("PYTHONPATH", "")
            assert envvars.WORKER_HOOKS not in tg["initial"]
        elif mode == "spawn":
            # a warm process: started with the hook first (it waited there for its worker),
            # and handed the environment above, entries included, with the worker
            assert tg["initial"]["PYTHONPATH"].split(os.pathsep)[0] == HOOK_DIR
            assert envvars.ZYGOTE_FD in tg["initial"]
            assert envvars.WORKER_HOOKS not in tg["initial"]
        else:
            # the hook did run in the Python worker (by default hang detection declares its
            # flight-recorder watcher, recovery its error-file excepthook) and took itself off
            # again before the script
            assert tg["initial"]["PYTHONPATH"].split(os.pathsep)[0] == HOOK_DIR
            assert envvars.ZYGOTE_FD not in tg["initial"]
            entries = set(tg["initial"][envvars.WORKER_HOOKS].split(","))
            assert {flight_recorder.WORKER_HOOK, ERROR_FILE_HOOK} <= entries, entries


def test_a_failing_hook_entry_is_one_line_and_the_script_runs(tmp_path: Path) -> None:
    """A real interpreter started as the agent starts a worker (the hook first on
    PYTHONPATH): an entry that does not import or raises is reported in one line each, the
    good one runs, the script runs, and neither the hook's directory nor its list is left."""
    import subprocess

    from trainguard.runtime.workerhook import check_entry

    mod = tmp_path / "tg_test_hooks.py"
    mod.write_text(
        "import os\n"
        "def good():\n    os.environ['TG_TEST_HOOK_RAN'] = '1'\n"
        "def bad():\n    raise RuntimeError('boom')\n"
    )
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([HOOK_DIR, str(tmp_path), env["PYTHONPATH"]])
    env[envvars.WORKER_HOOKS] = "tg_test_missing:f,tg_test_hooks:bad,tg_test_hooks:good"
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert seen["TG_TEST_HOOK_RAN"] == "1"
    assert envvars.WORKER_HOOKS not in seen
    assert HOOK_DIR not in seen["PYTHONPATH"].split(os.pathsep)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 2, p.stderr
    assert "tg_test_missing:f failed (ModuleNotFoundError" in lines[0]
    assert "tg_test_hooks:bad failed (RuntimeError: boom)" in lines[1]
    with pytest.raises(ValueError, match="not a 'module:function' name"):
        check_entry("trainguard.core.flight_recorder")
