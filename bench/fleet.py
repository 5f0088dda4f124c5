"""Fleet health: failure verdicts vs torchrun, lemon nodes, the fleet database under load and
through an outage. Real processes: `trainguard run` / torchrun jobs of 2 gloo ranks on
tests/workers/faulty.py (a plain script: no trainguard import, no ``@record``), a real
PostgreSQL (Debian's ``postgresql``, a throwaway cluster on loopback).

- user error: every rank multiplies tensors of mismatched shapes at step 0, ``--max-restarts 3``:
  restarts spent and seconds from launch to exit, trainguard vs torchrun (``--runs`` each);
- transient faults: kill -9 of a rank, SIGSTOP of a rank (the hang detector ends it), a NaN
  (``FloatingPointError``) and a flaky one-off exception, each in the first attempt: jobs that a
  "user code" verdict stopped (must be 0);
- lemon: a node with 3 hardware incidents from earlier jobs in the fleet database is refused at
  the next job's start and the spare runs in its place;
- database: 1 000 writers (10 processes x 100 agents' writers) put 5 records each into
  PostgreSQL at once: records lost; a job whose PostgreSQL is stopped mid-run (a rank killed
  while it is down) finishes, and its records land once the server is back;
- sniff tests: a 2-rank gloo job (tests/workers/recovery_worker.py, a 50 ms step) with the
  default sniff settings (``sniff_interval_s = 5``, ``sniff_budget = 0.005``, window 5) trains
  ``--sniff-warm-s`` (90 s) unthrottled (``sniff_overhead``: the largest share of a rank's time since
  its first step spent in sniffs, at its last sniff before the throttle), then rank 1 is
  throttled to about half speed for real (trainguard.chaos.throttle: a SIGSTOP/SIGCONT duty cycle
  over 4 ms, else a cgroup's quota and half weight, else taskset onto a busy core): ``degraded_rank_flagged_s`` is the
  time from the throttle to the ``sniff_degraded`` event naming rank 1 (null if not in 120 s;
  a sniff at which a rank looks slow is followed by confirming sniffs 5/3 s apart).

    python bench/fleet.py [--runs 3] [--only user_error,transient,lemon,db,sniff]

Ends with one JSON line: user_error_restarts, torchrun_user_error_restarts,
user_error_to_exit_s, torchrun_user_error_to_exit_s (medians), transient_faults_stopped,
lemon_refused, db_records_lost_1000, db_down_job_ok, degraded_rank_flagged_s, sniff_overhead.
Not measured here: XID chaos (tested with a dcgm-exporter endpoint in
tests/test_recovery_jobs.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._support import base_env  # noqa: E402
from trainguard.chaos.procs import kill_tree  # noqa: E402
from trainguard.chaos.throttle import throttle  # noqa: E402
from trainguard.testing.net import wait_listening  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402
from trainguard.testing.postgres import Postgres  # noqa: E402

FAULTY = REPO / "tests" / "workers" / "faulty.py"
STEPPER = REPO / "tests" / "workers" / "recovery_worker.py"
LAUNCHER = {
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def env(**extra: str) -> dict[str, str]:
    return base_env(
        TRAINGUARD_TELEMETRY_ENABLED="false",
        TRAINGUARD_CHECKPOINT_MEMORY_TIER="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
        TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
        TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        TRAINGUARD_RECOVERY_BACKOFF_BASE_S="0",
        **extra,
    )


def job(which: str, d: Path, fault: str, *extra: str, e: dict[str, str] | None = None,
        timeout: float = 400) -> tuple[int | None, float, int, str]:  # fmt: skip
    """(exit code, seconds to exit, restarts, stderr) of one job in ``d``; the exit code is
    None when the job was still running after ``timeout`` s (then ended, by PID)."""
    d.mkdir(parents=True, exist_ok=True)
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
            "--monitor-interval", "0.1"]  # fmt: skip
    if which == "trainguard":
        args += ["--tg-run-dir", str(d / "run")]
    t0 = time.monotonic()
    err_path = d / "stderr.txt"
    with open(err_path, "w") as err:
        p = subprocess.Popen(
            LAUNCHER[which] + args + [str(FAULTY), "--fault", fault, *extra],
            cwd=d, env=e or env(TRAINGUARD_RUNTIME_RUNS_ROOT=str(d / "runs")),
            stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(p)
    took = time.monotonic() - t0
    starts = (d / "starts").read_text().splitlines() if (d / "starts").exists() else []
    return rc, took, max(0, len(starts) - 1), err_path.read_text()


def user_error(root: Path, runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"tg_r": [], "tg_s": [], "tr_r": [], "tr_s": [], "tg_h": [],
                                   "tr_h": []}  # fmt: skip
    for i in range(runs):
        for which, k in (("trainguard", "tg"), ("torchrun", "tr")):
            rc, took, restarts, err = job(which, root / f"user_{which}_{i}", "shape")
            how = f"exit {rc}" if rc is not None else "ended after 400 s (a restarted attempt hung)"
            print(f"  user error  {which:<10} run {i}: {how}, {restarts} restarts, {took:.1f} s")
            out[f"{k}_r"].append(restarts)
            out[f"{k}_h"].append(int(rc is None))
            out[f"{k}_s"].append(took)
    return out


def transient(root: Path) -> int:
    stopped = 0
    for fault, extra in (("kill", ()), ("stop", ()), ("nan", ()), ("flaky", ())):
        e = env(
            TRAINGUARD_RUNTIME_RUNS_ROOT=str(root / "runs"), TRAINGUARD_HEALTH_HANG_TIMEOUT_S="5"
        )
        rc, took, restarts, err = job("trainguard", root / f"transient_{fault}", fault,
                                      "--steps", "40", *extra, e=e)  # fmt: skip
        evs = [json.loads(x) for x in (root / f"transient_{fault}" / "run" / "events.jsonl")
               .read_text().splitlines()]  # fmt: skip
        user_stop = any(
            ev["kind"] == "failure_attributed" and ev["cause"] == "user_code"
            and ev["verdict"] == "stop" for ev in evs
        )  # fmt: skip
        causes = [ev["cause"] for ev in evs if ev["kind"] == "failure_attributed"]
        print(f"  transient   {fault:<10} exit {rc}, {restarts} restart(s), causes {causes}, "
              f"{took:.1f} s")  # fmt: skip
        stopped += int(user_stop or rc == 93)
    return stopped


def lemon(root: Path) -> bool:
    from trainguard.fleet.db import Record, open_db

    runs = root / "lemon_runs"
    with open_db("", runs_root=runs) as db:
        db.write([Record(node="n0", kind="failure", cause="hardware", verdict="evict",
                         job=f"earlier{i}", attempt=0) for i in range(3)])  # fmt: skip
    e = env(TRAINGUARD_RUNTIME_RUNS_ROOT=str(runs))
    port, run_dir = free_port(), root / "lemon_job"
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for node in ("n1", "n0", "n2"):
            procs[node] = subprocess.Popen(
                LAUNCHER["trainguard"] + ["--nnodes", "2", "--nproc-per-node", "1",
                "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", "lemon", "--tg-run-dir", str(run_dir),
                str(FAULTY), "--fault", "none", "--steps", "5"],
                cwd=root, env={**e, "SLURMD_NODENAME": node}, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                start_new_session=True,
            )  # fmt: skip
            if node == "n1":
                wait_listening(port)
            if node == "n0":
                procs[node].wait(timeout=300)
        codes = {n: p.wait(timeout=400) for n, p in procs.items()}
    finally:
        for p in procs.values():
            kill_tree(p)
    evs = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    refused = any(ev["kind"] == "node_refused" and ev.get("lemon") for ev in evs)
    started = {ev["node"] for ev in evs if ev["kind"] == "workers_started"}
    print(f"  lemon       exits {codes}, refused {refused}, ran on {sorted(started)}")
    return refused and codes == {"n1": 0, "n0": 94, "n2": 0} and started == {"n1", "n2"}


def _writers(url: str, n: int, per: int, tag: int) -> int:
    from trainguard.fleet.db import Record, open_db
    from trainguard.fleet.writer import FleetWriter

    ws = [FleetWriter(lambda: open_db(url, runs_root="."), retry_s=0.5) for _ in range(n)]
    for i, w in enumerate(ws):
        for k in range(per):
            w.put(Record(node=f"p{tag}-a{i}", kind="failure", cause="network", job=f"j{k}"))
    return sum(w.close(300) for w in ws)


def db_load(pg: Postgres) -> int:
    procs, per_proc, per = 10, 100, 5
    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    with ctx.Pool(procs) as pool:
        left = sum(pool.starmap(_writers, [(pg.url, per_proc, per, t) for t in range(procs)]))
    from trainguard.fleet.db import open_db

    with open_db(pg.url, runs_root=".") as db:
        got = db.count()
    want = procs * per_proc * per
    print(f"  database    {procs * per_proc} writers x {per}: {got} of {want} records in "
          f"{time.monotonic() - t0:.1f} s ({left} left unwritten)")  # fmt: skip
    return want - got


def db_down(root: Path, pg: Postgres) -> bool:
    from trainguard.fleet.db import open_db

    d = root / "db_down"
    d.mkdir()
    e = env(TRAINGUARD_FLEET_URL=pg.url, TRAINGUARD_FLEET_RETRY_S="0.5",
            TRAINGUARD_FLEET_FLUSH_TIMEOUT_S="60", SLURMD_NODENAME="dbdown")  # fmt: skip
    p = subprocess.Popen(
        LAUNCHER["trainguard"] + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
        "--tg-run-dir", str(d / "run"), str(FAULTY), "--fault", "kill", "--at-step", "30",
        "--steps", "200", "--step-s", "0.1"],
        cwd=d, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    events = d / "run" / "events.jsonl"

    def seen(kind: str) -> bool:
        return events.exists() and f'"{kind}"' in events.read_text()

    try:
        deadline = time.monotonic() + 300
        while not seen("workers_started") and time.monotonic() < deadline:
            time.sleep(0.2)
        pg.stop()  # the database goes away mid-run
        while not seen("failure_attributed") and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # the writer meets the outage
        pg.start()
        rc = p.wait(timeout=400)
    finally:
        kill_tree(p)
    with open_db(pg.url, runs_root=".") as db:
        landed = db.history("dbdown")
    fleet = [json.loads(x) for x in events.read_text().splitlines() if '"fleet_records"' in x]
    print(
        f"  db down     exit {rc}, records landed {len(landed)}, agent: {fleet[-1] if fleet else None}"
    )
    return rc == 0 and bool(landed) and bool(fleet) and fleet[-1]["waiting"] == 0


def _lines(path: Path, kind: str) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [r for x in path.read_text().splitlines() if f'"{kind}"' in x
            for r in [json.loads(x)] if r.get("kind") == kind]  # fmt: skip


def sniff(root: Path, warm_s: float) -> tuple[float | None, float | None]:
    """(seconds from the throttle to the flag, sniff overhead before it)."""
    d = root / "sniff"
    d.mkdir()
    run = d / "run"
    e = env(TRAINGUARD_RUNTIME_RUNS_ROOT=str(d / "runs"), OMP_NUM_THREADS="1",
            TRAINGUARD_FLEET_SNIFF_INTERVAL_S="5", TRAINGUARD_HEALTH_STRAGGLER_DETECTION="false",
            SLURMD_NODENAME="sniffbench")  # fmt: skip
    p = subprocess.Popen(
        LAUNCHER["trainguard"] + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        "--tg-run-dir", str(run), str(STEPPER), "--steps", "10000000", "--step-s", "0.05",
        "--until-file", str(d / "stop")],
        cwd=d, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    events = run / "events.jsonl"
    flagged_s: float | None = None
    overhead: float | None = None
    try:
        deadline = time.monotonic() + 300
        while not _lines(events, "workers_started") and time.monotonic() < deadline:
            time.sleep(0.5)
        while time.monotonic() < deadline:  # warm_s of training since the first step
            got = _lines(run / "metrics" / "rank_0.jsonl", "sniff")
            if got and float(got[-1]["elapsed_s"]) >= warm_s:  # type: ignore[arg-type]
                break
            time.sleep(0.5)
        last = [_lines(run / "metrics" / f"rank_{r}.jsonl", "sniff") for r in (0, 1)]
        if all(last):
            overhead = max(float(x[-1]["overhead"]) for x in last)  # type: ignore[arg-type]
        pids = {int(w["rank"]): int(w["pid"]) for ev in _lines(events, "workers_started")
                for w in ev["workers"]}  # type: ignore[attr-defined]  # fmt: skip
        with throttle(pids[1]) as how:
            t0 = time.time()
            end = time.monotonic() + 120
            while time.monotonic() < end and p.poll() is None:
                got = [ev for ev in _lines(events, "sniff_degraded")
                       if ev.get("rank") == 1 and float(ev["time"]) >= t0]  # type: ignore[arg-type]  # fmt: skip
                if got:
                    flagged_s = float(got[0]["time"]) - t0  # type: ignore[arg-type]
                    break
                time.sleep(0.2)
        wrong = [(ev["rank"], round(float(ev["time"]) - t0, 1))  # type: ignore[arg-type]
                 for ev in _lines(events, "sniff_degraded")
                 if ev.get("rank") != 1 or float(ev["time"]) < t0]  # type: ignore[arg-type]  # fmt: skip
        recs = [_lines(run / "metrics" / f"rank_{r}.jsonl", "sniff") for r in (0, 1)]
        counts = [len(x) for x in recs]
        confirming = [sum(1 for x in r if x.get("confirming")) for r in recs]
        print(f"  sniff       throttled by {how}: rank 1 flagged after "
              f"{'-' if flagged_s is None else f'{flagged_s:.1f} s'}, false flags (rank, s from "
              f"the throttle) {wrong}; overhead before {overhead}; sniffs per rank {counts} "
              f"(confirming {confirming}); load {os.getloadavg()[0]:.1f}")  # fmt: skip
    finally:
        (d / "stop").touch()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(p)
    return flagged_s, overhead


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="user_error,transient,lemon,db,sniff")
    ap.add_argument("--sniff-warm-s", type=float, default=90.0)
    a = ap.parse_args()
    only = set(a.only.split(","))
    root = Path(tempfile.mkdtemp(prefix="tg-bench-fleet-"))
    print(f"bench/fleet.py in {root} (a loaded shared 2-core machine: times are indicative)")
    result: dict[str, object] = {}
    med = statistics.median
    if "user_error" in only:
        u = user_error(root, a.runs)
        print()
        print(f"{'':<28}{'trainguard':>12}{'torchrun':>12}{'ratio':>8}")
        print(f"{'user error: restarts':<28}{med(u['tg_r']):>12.0f}{med(u['tr_r']):>12.0f}")
        ratio = med(u["tg_s"]) / med(u["tr_s"]) if med(u["tr_s"]) else float("nan")
        print(f"{'user error: s to exit':<28}{med(u['tg_s']):>12.1f}{med(u['tr_s']):>12.1f}"
              f"{ratio:>8.2f}")  # fmt: skip
        result.update({
            "user_error_restarts": med(u["tg_r"]),
            "torchrun_user_error_restarts": med(u["tr_r"]),
            "user_error_to_exit_s": round(med(u["tg_s"]), 2),
            "torchrun_user_error_to_exit_s": round(med(u["tr_s"]), 2),
            "torchrun_user_error_hung_runs": int(sum(u["tr_h"])),
            "user_error_hung_runs": int(sum(u["tg_h"])),
        })  # fmt: skip
    if "transient" in only:
        result["transient_faults_stopped"] = transient(root)
    if "lemon" in only:
        result["lemon_refused"] = lemon(root)
    if "db" in only:
        pg = Postgres(max_connections=100)
        try:
            result["db_records_lost_1000"] = db_load(pg)
            result["db_down_job_ok"] = db_down(root, pg)
        finally:
            pg.close()
    if "sniff" in only:
        flagged_s, overhead = sniff(root, a.sniff_warm_s)
        result["degraded_rank_flagged_s"] = None if flagged_s is None else round(flagged_s, 1)
        result["sniff_overhead"] = None if overhead is None else round(overhead, 5)
    result["runs"] = a.runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
