"""Warm restarts, acceptance: a plain script (no trainguard import) restarted after kill -9
sees what torchrun gives it, side by side with torchrun, real processes.

One job per launcher, 2 ranks, ``--max-restarts 1``, stdout redirected to torch's log files
(``--redirects 1``), stderr inherited: attempt 0 sleeps and rank 1 is kill -9'd from outside
(under trainguard once its warm processes for the restart are ready); attempt 1 rank 1
raises under ``@record``, which ends the job (exit 1, error file, root-cause report). The other
exit paths (``sys.exit(N)``, ``sys.exit("msg")``, signals, ``-m``) are compared warm vs cold in
tests/test_warm_pool.py. Values that legitimately differ between the two
launchers: ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_ERROR_FILE`` (per-run
values) and trainguard's own ``TRAINGUARD_*`` (its agent→worker facts).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.launch_utils import WORKERS, base_env, popen
from tests.procs import alive, kill_tree

PLAN_WORKER = str(WORKERS / "restart_plan.py")
PER_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def _wait_for(what: str, cond, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"launcher exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _events(run_dir: Path, kind: str) -> list[dict]:
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def _warm_ready_after_start(run_dir: Path) -> list[dict]:
    started = _events(run_dir, "workers_started")
    if not started:
        return []
    return [e for e in _events(run_dir, "warm_ready") if e["time"] >= started[0]["time"]]


def _job(which: str, tmp_path: Path) -> dict:
    """Run the job under ``which`` in tmp_path/job, then move that directory to tmp_path/which
    (both launchers see the same paths)."""
    job = tmp_path / "job"
    job.mkdir()
    run_dir = tmp_path / f"{which}-run"
    dump = job / "dump"
    env = base_env(DUMP_DIR=str(dump), PLAN="0:sleep,1:raise", TRAINGUARD_WARM_PRESTART_DELAY_S="0")
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
            str(job / "logs"), "--redirects", "1"]  # fmt: skip
    if which == "trainguard":
        args += ["--tg-run-dir", str(run_dir)]
    p = popen(which, [*args, PLAN_WORKER, "--opt", "a b"], cwd=job, env=env)
    try:
        # both ranks wrote attempt 0's dump before the kill (a slow rank 0 killed in the group
        # teardown first would leave none)
        _wait_for(
            "attempt 0",
            lambda: all((dump / f"env_0_{r}.json").exists() for r in (0, 1)),
            p,
        )
        if which == "trainguard":  # the warm processes for the restart, started after attempt 0
            _wait_for("warm processes", lambda: len(_warm_ready_after_start(run_dir)) >= 2, p)
        victim = json.loads((dump / "env_0_1.json").read_text())["pid"]
        os.kill(victim, signal.SIGKILL)
        out, err = p.communicate(timeout=180)
    finally:
        kill_tree(p)
    job.rename(tmp_path / which)
    dumps = {}
    for f in (tmp_path / which / "dump").glob("env_*_*.json"):
        _, restart, rank = f.stem.split("_")
        dumps[(int(restart), int(rank))] = json.loads(f.read_text())
    return {"rc": p.returncode, "stdout": out, "stderr": err, "dumps": dumps, "run_dir": run_dir}


def _logs(root: Path) -> dict[str, str]:
    """attempt_N/<local rank>/<file> → content, under torch's log dir (run id left out)."""
    out = {}
    for f in (root / "logs").glob("*/attempt_*/*/*"):
        out["/".join(f.parts[-3:])] = f.read_text()
    return out


@pytest.mark.slow
def test_warm_restart_matches_torchrun(tmp_path: Path) -> None:
    tr = _job("torchrun", tmp_path)
    tg = _job("trainguard", tmp_path)

    # exit-code behaviour: both fail on attempt 1 with rank 1's uncaught exception, reported
    # from its error file
    for r in (tr, tg):
        assert r["rc"] == 1, r["stderr"][-3000:]
        root = r["stderr"].split("Root Cause")[1]
        assert re.search(r"rank\s*: 1 \(local_rank: 1\)\n\s*exitcode\s*: 1 ", root)
        assert "RuntimeError: planned failure at restart 1" in root
    assert sorted(tr["dumps"]) == sorted(tg["dumps"]) == [(a, r) for a in range(2) for r in (0, 1)]

    # trainguard ran both attempts from its warm processes: attempt 0 from those it started as
    # it started, attempt 1 from those it started for the restart
    started = {e["attempt"]: e["workers"] for e in _events(tg["run_dir"], "workers_started")}
    assert {a: [w["warm"] for w in ws] for a, ws in started.items()} == {
        0: [True, True],
        1: [True, True],
    }
    for key in tr["dumps"]:
        a, b = tr["dumps"][key], tg["dumps"][key]
        ea = {k: v for k, v in a.pop("env").items() if not k.startswith("TRAINGUARD_")}
        eb = {k: v for k, v in b.pop("env").items() if not k.startswith("TRAINGUARD_")}
        assert {k: v for k, v in ea.items() if k not in PER_RUN} == {
            k: v for k, v in eb.items() if k not in PER_RUN
        }, key
        assert set(ea) == set(eb)
        for e in (ea, eb):  # the per-run values have torch's shape
            assert re.fullmatch(
                rf".*/logs/[^/]+/attempt_{key[0]}/{key[1]}/error\.json",
                e["TORCHELASTIC_ERROR_FILE"],
            ), e["TORCHELASTIC_ERROR_FILE"]
        a.pop("pid"), b.pop("pid")
        assert a == b, key  # argv, orig_argv, cwd, __name__, sys.path[0], stdio buffering
        assert a["argv"] == [PLAN_WORKER, "--opt", "a b"] and a["name"] == "__main__"

    # stdout went to torch's per-rank files, stderr to the launcher's, for warm workers too
    la, lb = _logs(tmp_path / "torchrun"), _logs(tmp_path / "trainguard")
    assert {k: v for k, v in la.items() if k.endswith("stdout.log")} == {
        k: v for k, v in lb.items() if k.endswith("stdout.log")
    }
    assert lb["attempt_1/1/stdout.log"] == "out rank 1 restart 1\n"
    for r in (tr, tg):
        assert "err rank 1 restart 1" in r["stderr"]
        assert "out rank" not in r["stdout"]
    # @record's error file of attempt 1 (uncaught exception in a warm worker)
    for d in ("torchrun", "trainguard"):
        (err_file,) = (tmp_path / d / "logs").glob("*/attempt_1/1/error.json")
        msg = json.loads(err_file.read_text())["message"]["message"]
        assert msg == "RuntimeError: planned failure at restart 1"

    # the pool is gone with the agent, by PID; none was started after the last restart
    # (--max-restarts 1: attempt 1's workers can never be restarted)
    zygotes = [e["pid"] for e in _events(tg["run_dir"], "warm_ready")]
    assert len(zygotes) == 2 and not any(alive(pid) for pid in zygotes)


@pytest.mark.parametrize(
    ("remaining", "max_nodes", "possible"),
    [(1, 1, True), (0, 1, False), (0, 2, True), (3, 4, True)],
)
def test_warm_processes_only_while_a_restart_can_follow(
    remaining: int, max_nodes: int, possible: bool
) -> None:
    """A warm process is started only for a restart that can still happen: restarts left,
    or more than one node (a membership change restarts without using one)."""
    from trainguard.runtime.warm.plugin import restart_possible

    ctx = SimpleNamespace(
        agent_restarts=2,
        launch_config=SimpleNamespace(max_nodes=max_nodes, max_restarts=2 + remaining),
    )
    assert restart_possible(ctx) is possible  # type: ignore[arg-type]
