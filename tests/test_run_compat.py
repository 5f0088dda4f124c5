"""`trainguard run` vs `torchrun` on the same worker scripts, real processes, side by side."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.launch_utils import (
    CONTRACT,
    WORKERS,
    base_env,
    free_port,
    launch,
    popen,
    read_dumps,
)
from tests.mlp_reference import assert_same_as_reference
from tests.procs import kill_tree

DUMP = str(WORKERS / "dump_env.py")
BOTH = ("torchrun", "trainguard")


def _contract(dump: dict) -> dict[str, str | None]:
    return {k: dump["env"].get(k) for k in CONTRACT}


def _stable(c: dict[str, str | None]) -> dict[str, str | None]:
    """Contract values that must be equal between launchers (ports, ids, paths differ)."""
    drop = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    return {k: v for k, v in c.items() if k not in drop}


def _run_both(tmp_path: Path, args_for, env_extra=None) -> dict[str, dict]:
    """``args_for(which, d)`` under both launchers (the exit code is the tests' to check)."""
    out = {}
    for which in BOTH:
        d = tmp_path / which
        d.mkdir()
        env = base_env(DUMP_DIR=str(d / "dump"), **(env_extra or {}))
        r = launch(which, args_for(which, d), cwd=d, env=env)
        out[which] = {"result": r, "dumps": read_dumps(d / "dump"), "dir": d, "env": env}
    return out


SCRIPT_ARGS = ["--nproc-per-node", "7", "--standalone", "-m", "--max-restarts=9", "--", "-x", "--config", "y"]  # fmt: skip


def _entry(mode: str, d: Path) -> list[str]:
    """The entry point of ``mode`` (a script, ``-m``, ``--no-python``, ``--run-path``)."""
    if mode == "module":
        return ["-m", "tests.workers.dump_env", "x"]
    if mode == "no_python":
        script = d / "w.sh"
        script.write_text(f'#!/bin/sh\nexec "{os.sys.executable}" "{DUMP}" "$@"\n')
        script.chmod(0o755)
        return ["--no-python", str(script), "x"]
    if mode == "run_path":
        return ["--run-path", DUMP, "x"]
    return [DUMP, *SCRIPT_ARGS]


# One job per launcher for each entry mode, shared by the tests below (each job costs two
# agent starts); each also carries one exit behaviour that torchrun and trainguard must share:
# name -> (processes per node, log flags or None for no --log-dir, entry mode, extra launcher
# flags, worker env knobs (tests/workers/dump_env.py), the launcher's exit code).
JOBS: dict[str, tuple[int, list[str] | None, str, list[str], dict[str, str], int]] = {
    # rank 1 exits 1 on the first two attempts, --max-restarts 2: the job succeeds on attempt 2
    # (test_max_restarts_counts; trainguard's run directory: ..._writes_events_and_config)
    "script": (2, ["--redirects", "3"], "script", ["--max-restarts", "2"],
               {"EXIT_CODE": "1", "EXIT_UNTIL": "2", "EXIT_RANK": "1"}, 0),
    # rank 1 raises under torch's @record: exit 1 and the failure report
    # (test_worker_exit_1_same_exit_code_and_report)
    "module": (2, ["--tee", "3"], "module", [],
               {"RAISE_MESSAGE": "boom: the loss went NaN", "EXIT_RANK": "1"}, 1),
    # every rank exits 3: the launcher exits 1 (test_plain_exit_code_same)
    "no_python": (2, ["-r", "0:1,1:2"], "no_python", [], {"EXIT_CODE": "3"}, 1),
    # --run-path starts each worker as a function (multiprocessing): one torch import each
    "run_path": (1, None, "run_path", [], {}, 0),
}  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``jobs(name)``: the results of ``JOBS[name]`` under both launchers, run once; each
    exited with the job's exit code. trainguard's writes its run directory (``--tg-run-dir``)."""
    done: dict[str, dict[str, dict]] = {}

    def get(name: str) -> dict[str, dict]:
        if name not in done:
            nproc, log_flags, mode, flags, knobs, code = JOBS[name]

            def args(which: str, d: Path) -> list[str]:
                logs = [] if log_flags is None else ["--log-dir", str(d / "logs"), *log_flags]
                run_dir = ["--tg-run-dir", str(d / "run")] if which == "trainguard" else []
                return ["--standalone", "--nproc-per-node", str(nproc), *flags, *run_dir, *logs,
                        *_entry(mode, d)]  # fmt: skip

            res = _run_both(tmp_path_factory.mktemp(name), args, knobs)
            for which in BOTH:
                r = res[which]["result"]
                assert r.returncode == code, f"{which}: {r.returncode}\n{r.stderr[-3000:]}"
            done[name] = res
        return done[name]

    return get


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_standalone_worker_env_matches(jobs) -> None:  # type: ignore[no-untyped-def]
    res = jobs("script")  # three attempts (rank 1 exits 1 on the first two)
    tr, tg = res["torchrun"]["dumps"], res["trainguard"]["dumps"]
    assert sorted(tr) == sorted(tg) == [(a, r) for a in range(3) for r in (0, 1)]
    for key in tr:
        a, b = _contract(tr[key]), _contract(tg[key])
        assert {k for k, v in a.items() if v is not None} == {
            k for k, v in b.items() if v is not None
        }
        assert _stable(a) == _stable(b)
        assert a["OMP_NUM_THREADS"] == "1"
        # torch's env names that torchrun sets and trainguard must also set
        torch_names = {
            k for k in tr[key]["env"] if k.startswith(("TORCHELASTIC_", "PET_", "TORCH_"))
        }
        assert torch_names <= set(tg[key]["env"])
        assert tr[key]["argv"][1:] == tg[key]["argv"][1:]
        # byte for byte torchrun's value: trainguard handles SIGUSR1 in the agent without it
        sig = "TORCHELASTIC_SIGNALS_TO_HANDLE"
        assert tr[key]["env"][sig] == tg[key]["env"][sig] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    assert tg[(0, 0)]["env"]["TRAINGUARD_AGENT_RUN_DIR"]


def test_nnodes_range_two_agents_c10d(tmp_path: Path) -> None:
    for which in BOTH:
        d = tmp_path / which
        d.mkdir()
        port = free_port()
        env = base_env(DUMP_DIR=str(d / "dump"))
        args = [
            "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job-{which}",
            "--rdzv-conf", "last_call_timeout=5", DUMP,
        ]  # fmt: skip
        procs = [popen(which, args, cwd=d, env=env) for _ in range(2)]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        dumps = read_dumps(d / "dump")
        assert sorted(dumps) == [(0, 0), (0, 1)], which
        envs = [dumps[(0, r)]["env"] for r in (0, 1)]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
        assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "1"]
        assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {f"job-{which}"}
        assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in envs} == {"True"}


def test_static_rendezvous_node_rank(tmp_path: Path) -> None:
    contracts = {}
    for which in BOTH:
        d = tmp_path / which
        d.mkdir()
        port = free_port()
        env = base_env(DUMP_DIR=str(d / "dump"))
        procs = []
        for node_rank in (0, 1):
            args = [
                "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
                "--master-addr", "127.0.0.1", "--master-port", str(port), DUMP,
            ]  # fmt: skip
            procs.append(popen(which, args, cwd=d, env=env))
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
        dumps = read_dumps(d / "dump")
        assert sorted(dumps) == [(0, 0), (0, 1)]
        contracts[which] = {k: _stable(_contract(v)) for k, v in dumps.items()}
        assert {dumps[k]["env"]["MASTER_PORT"] for k in dumps} == {str(port)}
    assert contracts["torchrun"] == contracts["trainguard"]


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
@pytest.mark.parametrize("mode", ["module", "no_python", "run_path"])
def test_entrypoint_modes(jobs, mode: str) -> None:  # type: ignore[no-untyped-def]
    res = jobs(mode)
    nproc = JOBS[mode][0]
    for which in BOTH:
        dumps = res[which]["dumps"]
        assert sorted(dumps) == [(0, r) for r in range(nproc)], which
        assert all(d["argv"][-1] == "x" for d in dumps.values())
    for key in res["torchrun"]["dumps"]:
        a = _stable(_contract(res["torchrun"]["dumps"][key]))
        b = _stable(_contract(res["trainguard"]["dumps"][key]))
        assert a == b


def _tree(root: Path) -> list[str]:
    files = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            files.append(re.sub(r"^[^/]+/", "<run>/", rel))
    return files


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
@pytest.mark.parametrize("job", ["script", "module", "no_python"])  # --redirects, --tee, -r MAP
def test_log_dir_layout(jobs, job: str) -> None:  # type: ignore[no-untyped-def]
    flags = JOBS[job][1]
    assert flags is not None
    res = jobs(job)
    trees = {w: _tree(res[w]["dir"] / "logs") for w in BOTH}
    assert trees["torchrun"] == trees["trainguard"]
    assert any(t.endswith("stdout.log") for t in trees["trainguard"])
    for which in BOTH:
        logs = {
            p.relative_to(res[which]["dir"] / "logs").as_posix().split("/", 1)[1]: p.read_text()
            for p in (res[which]["dir"] / "logs").rglob("*.log")
        }
        if which == "torchrun":
            ref = logs
        else:
            assert logs == ref
    if "--tee" in flags:
        for which in BOTH:
            assert "hello from rank 1" in res[which]["result"].stdout


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_worker_exit_1_same_exit_code_and_report(jobs) -> None:  # type: ignore[no-untyped-def]
    # the module-entry job: rank 1 raises RuntimeError("boom: ...") under torch's @record
    results = {which: res["result"] for which, res in jobs("module").items()}
    for which, r in results.items():
        assert r.returncode == 1, which
        assert "ChildFailedError" in r.stderr
        assert "Root Cause (first observed failure)" in r.stderr
        assert "boom: the loss went NaN" in r.stderr
        assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", r.stderr), r.stderr[-2000:]
        assert "exitcode  : 1" in r.stderr

    def report(s: str) -> list[str]:
        block = s[s.index("Root Cause") :]
        lines = [
            ln
            for ln in block.splitlines()
            if re.match(r"^\s*(rank|exitcode|error_file|traceback|host)", ln.strip())
        ]
        norm = []
        for ln in lines:
            ln = re.sub(r"host\s*:.*", "host", ln)
            ln = re.sub(r"/[^ ]*error\.json", "<file>", ln)
            norm.append(re.sub(r"pid: \d+", "pid", ln))
        return norm

    assert report(results["torchrun"].stderr) == report(results["trainguard"].stderr)


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_plain_exit_code_same(jobs) -> None:  # type: ignore[no-untyped-def]
    # the --no-python job: every rank exits 3 (no error file); both launchers exit 1
    res = jobs("no_python")
    codes = {which: res[which]["result"].returncode for which in BOTH}
    assert codes["torchrun"] == codes["trainguard"] == 1
    for which in BOTH:
        assert "exitcode  : 3" in res[which]["result"].stderr, which


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_max_restarts_counts(jobs) -> None:  # type: ignore[no-untyped-def]
    restarts_job = jobs("script")  # --max-restarts 2, rank 1 exits 1 on attempts 0 and 1
    res = {}
    for which in BOTH:
        r = restarts_job[which]["result"]
        assert r.returncode == 0, r.stderr[-3000:]
        dumps = restarts_job[which]["dumps"]
        res[which] = sorted({k[0] for k in dumps})
        for (restart, _), dump in dumps.items():
            assert dump["env"]["TORCHELASTIC_RESTART_COUNT"] == str(restart)
            assert dump["env"]["TORCHELASTIC_MAX_RESTARTS"] == "2"
    assert res["torchrun"] == res["trainguard"] == [0, 1, 2]


def test_unknown_flag_is_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    # The same argparse error as torchrun's: exit 2, usage, then one error line naming the
    # flag; only the program name differs. Both parsers called in this process (the command's
    # path from the console script to an exit-2 line is run in test_run_badinput).
    from torch.distributed import run as torchrun

    from trainguard.cli.main import main

    parse = {"torchrun": torchrun.parse_args, "trainguard": lambda a: main(["run", *a])}
    last = {}
    for which in BOTH:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            parse[which](["--no-such-flag", "--standalone", DUMP])
        assert exit_.value.code == 2, which
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert lines[0].startswith("usage: "), (which, err)
        last[which] = lines[-1].split(": error: ", 1)
        assert len(last[which]) == 2, (which, lines[-1])
    assert last["torchrun"][1] == last["trainguard"][1] == "unrecognized arguments: --no-such-flag"
    assert last["trainguard"][0] == "trainguard run"


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_script_args_that_look_like_flags_pass_through(jobs) -> None:  # type: ignore[no-untyped-def]
    res = jobs("script")
    for which in BOTH:
        for dump in res[which]["dumps"].values():
            assert dump["argv"][1:] == SCRIPT_ARGS, which


@pytest.mark.parametrize("which", BOTH)
def test_sigterm_to_launcher_stops_every_worker(tmp_path: Path, which: str) -> None:
    env = base_env(DUMP_DIR=str(tmp_path / "dump"), SLEEP_S="300")
    p = popen(which, ["--standalone", "--nproc-per-node", "2", DUMP], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(read_dumps(tmp_path / "dump")) < 2:
            assert time.monotonic() < deadline, "workers did not start"
            assert p.poll() is None, p.communicate()[1][-2000:]
            time.sleep(0.2)
        pids = [d["pid"] for d in read_dumps(tmp_path / "dump").values()]
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # a failed wait above leaves the launcher and its workers running
            kill_tree(p)
    assert p.returncode != 0
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"{which}: workers {alive} survived SIGTERM to the launcher"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_train_mlp_bitwise_identical(tmp_path: Path) -> None:
    import torch

    example = str(Path(__file__).resolve().parent.parent / "examples" / "train_mlp.py")

    def run(which: str) -> dict:
        d = tmp_path / which
        d.mkdir()
        out = d / "final.pt"
        r = launch(
            which,
            ["--standalone", "--nproc-per-node", "2", example, "--steps", "30", "--out", str(out)],
            cwd=d,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return torch.load(out, weights_only=True)

    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(run, BOTH)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the in-process reference that the fault tests compare their jobs with is these bits
    assert_same_as_reference(a, 30)


@pytest.mark.xdist_group("compat_jobs")  # one worker runs the module's jobs once each
def test_trainguard_run_writes_events_and_config(jobs) -> None:  # type: ignore[no-untyped-def]
    import json

    job = jobs("script")["trainguard"]  # --max-restarts 2, rank 1 exits 1 on attempts 0 and 1
    r, env, run_dir = job["result"], job["env"], job["dir"] / "run"
    assert r.returncode == 0, r.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "launch" and kinds[-1] == "job_finished"
    for k in ("rendezvous", "workers_started", "worker_failed", "restart"):
        assert k in kinds, kinds
    for e in events:
        # one name per meaning: attempt (job-wide), agent_restarts (this agent's, torch's)
        assert {"time", "node", "attempt"} <= e.keys() and "restart_count" not in e
    agent_kinds = {"launch", "rendezvous", "workers_started", "worker_failed", "restart"}
    assert all("agent_restarts" in e for e in events if e["kind"] in agent_kinds)
    assert [e["agent_restarts"] for e in events if e["kind"] == "restart"] == [1, 2]
    # rank 0 may be reported too (terminated by the agent); the root cause is rank 1's exit
    failed = next(e for e in events if e["kind"] == "worker_failed" and e["root_cause"])
    assert failed["rank"] == 1 and failed["exitcode"] == 1 and failed["attempt"] == 0
    assert events[-1]["state"] == "succeeded" and events[-1]["attempt"] == 2
    rdzv = [e for e in events if e["kind"] == "rendezvous"]
    assert [e["attempt"] for e in rdzv] == [0, 1, 2]
    assert rdzv[0]["members"][0]["pid"] > 0
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["trainguard"]["runtime"]["run_dir"] == str(run_dir)
    assert cfg["torchrun"]["max_restarts"] == 2
    # settings reach the workers through config.json only: besides the user's own variables
    # they inherit, the agent adds facts (TRAINGUARD_AGENT_*), never a setting
    from trainguard.core.config import TrainGuardConfig

    sections = tuple(
        f"TRAINGUARD_{name.upper()}_" for name in TrainGuardConfig.__dataclass_fields__
    )
    dumps = job["dumps"]
    assert dumps
    for d in dumps.values():
        added = {k for k in d["env"] if k.startswith("TRAINGUARD_") and k not in env}
        assert any(k.startswith("TRAINGUARD_AGENT_") for k in added), added
        assert not [k for k in added if k.startswith(sections)], added


def _run_script(
    tmp_path: Path, code: str, max_restarts: int
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``code`` as a 2-process job under ``trainguard run``: the result and the events."""
    import json

    script = tmp_path / "job.py"
    script.write_text(code)
    run_dir = tmp_path / "run"
    r = launch(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
         "--tg-run-dir", str(run_dir), str(script)],
        cwd=tmp_path,
        env=base_env(),
    )  # fmt: skip
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return r, events


def test_a_survivor_torch_ends_in_the_same_second_is_never_the_root_cause(tmp_path: Path) -> None:
    # rank 1 dies by SIGKILL; rank 0, in no collective, lives until torch ends the group with a
    # SIGTERM, nearly always within the same whole second (torch's failure timestamps)
    r, events = _run_script(
        tmp_path,
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(1.0)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n",
        max_restarts=0,
    )
    assert r.returncode != 0, r.stderr[-3000:]
    failed = {e["rank"]: e for e in events if e["kind"] == "worker_failed"}
    assert failed[1]["signal"] == "SIGKILL" and failed[1]["root_cause"], failed
    assert not failed.get(0, {}).get("root_cause"), failed
    assert "rank 1" in r.stderr and "SIGKILL" in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def bad_error_files_job(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 2-process job under ``trainguard run`` (``--max-restarts 2``) for the two tests below,
    one fault per attempt. Attempt 0: rank 0 writes JSON torch's reader raises on ({}: KeyError
    'message'), rank 1 JSON nested past the recursion limit, and rank 1 plants a symlink at the
    name the repair once used for its temporary file; both exit 1. Attempt 1: rank 1 leaves half
    an error file (empty) and dies by SIGKILL, rank 0 first writes a marker line to stderr.
    Attempt 2 finishes. The result, the events and the symlink's target."""
    tmp = tmp_path_factory.mktemp("bad_error_files")
    victim = tmp / "victim.txt"
    victim.write_text("untouched\n")
    r, events = _run_script(
        tmp,
        "import os, signal, sys, time\n"
        "attempt, rank = os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['RANK']\n"
        "path = os.environ['TORCHELASTIC_ERROR_FILE']\n"
        "if attempt == '0':\n"
        "    if rank == '0':\n"
        "        open(path, 'w').write('{}')\n"
        "    else:\n"
        f"        os.symlink({str(victim)!r}, path + '.tmp')\n"
        "        open(path, 'w').write('{\"message\": ' + '[' * 100000 + ']' * 100000 + '}')\n"
        "    time.sleep(0.5)\n"
        "    sys.exit(1)\n"
        "if attempt == '1' and rank == '0':\n"
        "    print('ATTEMPT 1 STARTED', file=sys.stderr, flush=True)\n"
        "if attempt == '1' and rank == '1':\n"
        "    open(path, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(1.0)\n",
        max_restarts=2,
    )
    return {"result": r, "events": events, "victim": victim}


@pytest.mark.xdist_group("compat_error_files")  # one worker runs the module's job once
def test_a_worker_killed_while_writing_its_error_file_is_restarted(bad_error_files_job) -> None:  # type: ignore[no-untyped-def]
    # attempt 1 of the shared job: rank 1 leaves half an error file (empty) and dies by SIGKILL;
    # torch's reader raises on it, which must not end the agent: the job restarts and finishes
    r, events = bad_error_files_job["result"], bad_error_files_job["events"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "JSONDecodeError" not in r.stderr, r.stderr[-3000:]
    failed = [
        e for e in events if e["kind"] == "worker_failed" and e["root_cause"] and e["attempt"] == 1
    ]
    assert [(e["rank"], e["signal"]) for e in failed] == [(1, "SIGKILL")], failed
    assert events[-1]["kind"] == "job_finished" and events[-1]["attempt"] == 2, events[-1]


@pytest.mark.xdist_group("compat_error_files")  # one worker runs the module's job once
def test_an_error_file_torch_cannot_parse_is_replaced_and_the_job_restarts(
    bad_error_files_job,
) -> None:  # type: ignore[no-untyped-def]
    # attempt 0 of the shared job: both ranks leave an error file torch's reader raises on
    # (KeyError, RecursionError) and exit 1. The agent replaces both files, never writes
    # through the symlink, restarts, and reports each failure as worker_failed
    r, events = bad_error_files_job["result"], bad_error_files_job["events"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "KeyError" not in r.stderr and "RecursionError" not in r.stderr, r.stderr[-3000:]
    failed = sorted(e["rank"] for e in events if e["kind"] == "worker_failed" and e["attempt"] == 0)
    assert failed == [0, 1], [e for e in events if e["kind"] == "worker_failed"]
    # replaced before attempt 1 began (attempt 1's empty file is replaced too)
    assert "replaced" in r.stderr[: r.stderr.index("ATTEMPT 1 STARTED")], r.stderr[-3000:]
    assert bad_error_files_job["victim"].read_text() == "untouched\n"


@pytest.mark.parametrize(
    "content, accepted",
    [
        (
            '{"message": {"message": "x", "extraInfo": {"py_callstack": "", "timestamp": "1"}}}',
            True,
        ),
        ('{"message": "plain", "timestamp": 3}', True),
        ("{}", False),
        ("[]", False),
        ('{"message": {"message": "x", "extraInfo": {}}}', False),
        ('{"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}}', False),
        ('{"message": 5}', False),
        ('{"message": "x", "deep": ' + "[" * 100 + "]" * 100 + "}", False),
        ("not json", False),
    ],
)
def test_error_files_torch_accepts_are_the_ones_kept(
    tmp_path: Path, content: str, accepted: bool
) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainguard.runtime._torch import error_file_accepted

    path = tmp_path / "error.json"
    path.write_text(content)
    assert error_file_accepted(str(path)) is accepted
    if accepted:  # torch's own reader takes it
        ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))


def test_the_worker_error_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    import json

    from trainguard.core._torch import record_error_file

    path = tmp_path / "error.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError as e:
            record_error_file(e)
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "RuntimeError: boom"
    assert "boom" in data["message"]["extraInfo"]["py_callstack"]
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary left


def test_subprocess_env_unchanged_by_import() -> None:
    # `import trainguard` must not pull in torch or exporter libraries.
    code = "import sys, trainguard; bad=[m for m in ('torch','opentelemetry','prometheus_client','pynvml') if m in sys.modules]; print(bad)"
    out = subprocess.run(
        [os.sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), check=True
    )
    assert out.stdout.strip() == "[]"


def test_commands_that_start_no_worker_do_not_import_torch() -> None:
    # `trainguard watch` (one beside every sbatch job) and the plugins' shared base: a torch
    # import is ~1.5 s of CPU on a node that has none to spare at the job's start
    code = (
        "import sys, trainguard.cli.cmd_watch, trainguard.core.plugin, trainguard.dashboards.watch; "
        "print([m for m in ('torch',) if m in sys.modules])"
    )
    out = subprocess.run(
        [os.sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), check=True
    )
    assert out.stdout.strip() == "[]"


def test_unhealthy_group_without_restarts_fails_the_job(tmp_path: Path) -> None:
    """A plugin's UNHEALTHY verdict with no restarts left is a failure (exit 1 + report)."""
    import json
    import sys

    script = tmp_path / "w.py"
    script.write_text(
        "import time, trainguard\ntg = trainguard.init()\n"
        "for i in range(600):\n    with tg.step():\n        time.sleep(0.05)\n"
    )
    cmd = [sys.executable, str(WORKERS / "unhealthy_launcher.py"), "--standalone", "--nproc-per-node", "1",
           "--tg-run-dir", str(tmp_path / "run"), str(script)]  # fmt: skip
    p = subprocess.run(
        cmd, cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Root Cause (first observed failure)" in p.stderr
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "job_finished" and events[-1]["state"] == "failed"
    assert "worker_group_unhealthy" in [e["kind"] for e in events]
