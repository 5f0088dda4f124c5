"""Hang detection latency: a rank stopped with SIGSTOP mid-run, trainguard vs torchrun.

The job is ``tests/health_fixtures/health_worker.py`` (2 processes, gloo all-reduce per step);
rank 1 stops itself with SIGSTOP inside step 8 and writes the time first. trainguard runs with
``[health] hang_timeout_s = 5``: its latency is the ``hang_detected`` event time minus the stop
time (median of ``--runs``). torchrun runs with default settings: its latency is the time until
torchrun notices anything (it exits, or any worker exits); after ``--torchrun-wait`` seconds
(60) without that it is recorded as not detected (``null``, ``torchrun_detected: false``).

    python bench/hang_detect.py [--runs 3 --torchrun-wait 60]

Prints one JSON line: trainguard_detect_s, torchrun_detect_s, and details.

    python bench/hang_detect.py diagnosis [--runs 1 --torchrun-wait 30]

runs a plain torch.distributed script (``tests/workers/plain_collectives.py``, no trainguard
import) instead and prints ``trainguard_localize_s`` (divergence → the hang_diagnosis event that
names the collective), ``trainguard_survivor_release_s`` and ``torchrun_survivor_release_s``
(a peer SIGKILLed before its collective → the survivor out of its collective, by an error or by
its launcher) and the flight recorder's overhead on a small gloo training step
(``fr_overhead_pct``, recorder on vs off, alternating runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.procs import kill_tree  # noqa: E402  (ends workers in their own sessions, by PID)

WORKER = REPO / "tests" / "health_fixtures" / "health_worker.py"
WORKER_ARGS = [
    "--steps",
    "100",
    "--compute-s",
    "0.05",
    "--sleep",
    "--stop-rank",
    "1",
    "--stop-at-step",
    "8",
]
TIMEOUT_S = 5.0


def base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def trainguard_once(root: Path) -> float | None:
    run_dir = root / f"tg-{time.monotonic_ns()}"
    env = base_env()
    env.update(
        TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(TIMEOUT_S),
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
    )
    cmd = [
        sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
        "--tg-run-dir", str(run_dir), str(WORKER), *WORKER_ARGS,
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # The SIGSTOPped worker (and any other) is ended by PID even if trainguard did not.
        kill_tree(p)
    stopped = float((run_dir / "stopped_at").read_text())
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev["kind"] == "hang_detected":
            return ev["time"] - stopped
    print(f"trainguard did not report a hang (rc {p.returncode})", file=sys.stderr)
    return None


def torchrun_once(root: Path, wait_s: float) -> tuple[float | None, str]:
    run_dir = root / f"torchrun-{time.monotonic_ns()}"
    env = base_env()
    env["TRAINGUARD_RUNTIME_RUN_DIR"] = str(run_dir)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(WORKER), *WORKER_ARGS,
    ]  # fmt: skip
    p = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        marker = run_dir / "stopped_at"
        while not marker.exists():
            if time.monotonic() > deadline or p.poll() is not None:
                raise RuntimeError("torchrun job did not reach the stop")
            time.sleep(0.05)
        time.sleep(0.05)
        stopped = float(marker.read_text())
        while time.time() - stopped < wait_s:
            if p.poll() is not None:
                return time.time() - stopped, f"torchrun exited with {p.returncode}"
            time.sleep(0.1)
        return None, f"not detected after {wait_s:g} s (torchrun still waiting)"
    finally:
        # torchrun never ends the stopped worker; it runs in a session of its own, so a
        # process-group kill misses it: end the whole tree by PID.
        kill_tree(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--torchrun-wait", type=float, default=60.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-hang-") as tmp:
        root = Path(tmp)
        tg = [trainguard_once(root) for _ in range(args.runs)]
        tr, note = torchrun_once(root, args.torchrun_wait)
    found = [t for t in tg if t is not None]
    out = {
        "trainguard_detect_s": round(statistics.median(found), 3) if found else None,
        "torchrun_detect_s": None if tr is None else round(tr, 3),
        "torchrun_detected": tr is not None,
        "torchrun_note": note,
        "torchrun_wait_s": args.torchrun_wait,
        "hang_timeout_s": TIMEOUT_S,
        "trainguard_runs_s": [None if t is None else round(t, 3) for t in tg],
    }
    print(json.dumps(out))


# -- diagnosis, survivor release and flight-recorder overhead on a plain torch.distributed script
PLAIN = REPO / "tests" / "workers" / "plain_collectives.py"


def _launch(which: str, root: Path, args: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    env = base_env()
    env.update(TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0", TRAINGUARD_TELEMETRY_ENABLED="false")
    env.update(env_extra)
    launcher = (
        [sys.executable, "-m", "trainguard", "run", "--tg-run-dir", str(root / "run")]
        if which == "trainguard"
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    cmd = [*launcher, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
           "--monitor-interval", "0.1", str(PLAIN), *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def _end(p: subprocess.Popen, root: Path) -> None:
    kill_tree(p)
    for f in (root / "pids").glob("rank_*"):
        try:
            os.kill(int(f.read_text()), 9)
        except (ProcessLookupError, ValueError):
            pass


def localize_once(base: Path, which: str, wait_s: float) -> float | None:
    """Divergent path (rank 1 calls an extra all_reduce at step 10): seconds from the divergence
    to trainguard's hang_diagnosis event naming the collective; torchrun: to it exiting."""
    root = base / f"{which}-loc-{time.monotonic_ns()}"
    root.mkdir()
    p = _launch(which, root, ["--diverge-rank", "1", "--at-step", "10", "--steps", "40"],
                {"TRAINGUARD_HEALTH_HANG_TIMEOUT_S": str(TIMEOUT_S)})  # fmt: skip
    try:
        deadline = time.monotonic() + 120 + wait_s
        while time.monotonic() < deadline:
            if which == "trainguard" and (root / "run" / "events.jsonl").exists():
                for line in (root / "run" / "events.jsonl").read_text().splitlines():
                    ev = json.loads(line)
                    if ev["kind"] == "hang_diagnosis" and ev.get("op"):
                        return ev["time"] - float((root / "hang_at").read_text())
            if (root / "hang_at").exists():
                since = time.time() - float((root / "hang_at").read_text())
                if p.poll() is not None and which == "torchrun":
                    return since
                if since > wait_s:
                    return None
            time.sleep(0.1)
        return None
    finally:
        _end(p, root)


def release_once(base: Path, which: str) -> float | None:
    """Rank 1 SIGKILLed before its all_reduce at step 10: seconds until the survivor (rank 0)
    left its collective (an error) or was ended by the launcher, whichever came first."""
    root = base / f"{which}-rel-{time.monotonic_ns()}"
    root.mkdir()
    p = _launch(which, root, ["--kill-rank", "1", "--at-step", "10", "--steps", "40",
                              "--step-s", "0.2"], {})  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        pid0 = None
        while time.monotonic() < deadline:
            if pid0 is None and (root / "pids" / "rank_0").exists():
                pid0 = int((root / "pids" / "rank_0").read_text() or 0) or None
            if (root / "hang_at").exists():
                killed = float((root / "hang_at").read_text())
                if (root / "released_rank_0").exists():
                    return float((root / "released_rank_0").read_text()) - killed
                if pid0 and not Path(f"/proc/{pid0}").exists():
                    return time.time() - killed
                if time.time() - killed > 60:
                    return None
            time.sleep(0.01)
        return None
    finally:
        _end(p, root)


FR_CODE = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
x = torch.randn(256, 256)
def step():
    for _ in range(4):
        x @ x  # a little compute, then the step's collectives
    dist.all_reduce(t)
    dist.broadcast(t, 0)
for _ in range(20):
    step()
dist.barrier()
t0 = time.perf_counter()
for _ in range(int(sys.argv[1])):
    step()
dist.barrier()
if dist.get_rank() == 0:
    print((time.perf_counter() - t0) / int(sys.argv[1]))
dist.destroy_process_group()
"""


def fr_overhead(base: Path, steps: int, rounds: int) -> dict[str, object]:
    """Step time of a small gloo loop with the flight recorder on (trainguard's buffer size)
    and off, alternating runs; median of each."""
    script = base / "fr_step.py"
    script.write_text(FR_CODE)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            env = base_env()
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            if mode == "on":
                env["TORCH_FR_BUFFER_SIZE"] = "2000"
            out = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", str(script), str(steps)],
                env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            times[mode].append(float(out.stdout.strip().splitlines()[-1]))
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "fr_step_s_on": round(on, 6),
        "fr_step_s_off": round(off, 6),
        "fr_overhead_pct": round(100 * (on - off) / off, 2),
        "fr_runs_s": times,
    }


def diagnosis_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="hang diagnosis: localize, release, FR overhead")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--torchrun-wait", type=float, default=30.0)
    ap.add_argument("--fr-steps", type=int, default=300)
    ap.add_argument("--fr-rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tg-hangdiag-") as tmp:
        base = Path(tmp)
        loc = [localize_once(base, "trainguard", 60) for _ in range(args.runs)]
        tr_loc = localize_once(base, "torchrun", args.torchrun_wait)
        rel = [release_once(base, "trainguard") for _ in range(args.runs)]
        tr_rel = [release_once(base, "torchrun") for _ in range(args.runs)]
        fr = fr_overhead(base, args.fr_steps, args.fr_rounds)

    def med(xs: list[float | None]) -> float | None:
        got = [x for x in xs if x is not None]
        return round(statistics.median(got), 3) if got else None

    print(json.dumps({
        "trainguard_localize_s": med(loc),
        "torchrun_localize_s": None if tr_loc is None else round(tr_loc, 3),
        "torchrun_localize_note": "torchrun names no collective; exit time if it exits at all"
        f" (null: still waiting after {args.torchrun_wait:g} s)",
        "trainguard_survivor_release_s": med(rel),
        "torchrun_survivor_release_s": med(tr_rel),
        "hang_timeout_s": TIMEOUT_S,
        **fr,
    }))  # fmt: skip


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "diagnosis":
    diagnosis_main(sys.argv[2:])
    sys.exit(0)


if __name__ == "__main__":
    main()
