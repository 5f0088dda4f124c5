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
(``fr_overhead_pct``, recorder on vs off: two jobs at once, paced block by block).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from trainguard.chaos.procs import kill_tree  # noqa: E402  (ends workers in their own sessions, by PID)

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


def _end(p: subprocess.Popen | None, root: Path) -> None:
    if p is not None:
        kill_tree(p)
    for f in (root / "pids").glob("*"):
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


def _launch_nodes(
    which: str, root: Path, args: list[str], env_extra: dict[str, str], port: int
) -> list[subprocess.Popen]:
    """Two agents ("nodes" nodeA, nodeB), one worker each, c10d rendezvous on
    127.0.0.1:``port``."""
    procs = []
    for node in ("nodeA", "nodeB"):
        env = base_env()
        env.update(TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0", TRAINGUARD_TELEMETRY_ENABLED="false",
                   TRAINGUARD_HEALTH_HANG_TIMEOUT_S=str(TIMEOUT_S), SLURMD_NODENAME=node)  # fmt: skip
        env.update(env_extra)
        launcher = (
            [sys.executable, "-m", "trainguard", "run", "--tg-run-dir", str(root / "run")]
            if which == "trainguard"
            else [sys.executable, "-m", "torch.distributed.run"]
        )
        cmd = [*launcher, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "rel", "--monitor-interval", "0.1", str(PLAIN), *args]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
    return procs


def release_once(base: Path, which: str, how: str, wait_s: float) -> dict[str, float | None]:
    """Rank 1 (one node) dies before its all_reduce at step 10 while rank 0 (the other node)
    waits in it. ``how``: ``kill`` (SIGKILL, its connections held open by a child: a peer
    that vanished without closing them), ``lost`` (its launcher and it SIGSTOPped: a node
    frozen or cut off), ``stop`` (SIGSTOP, its launcher running), ``close`` (SIGKILL,
    connections closed). Returns ``release_s``: seconds from the death to the survivor out of its
    collective (an error, or its process gone), None after ``wait_s``; for trainguard also
    ``after_verdict_s``: from its first hang verdict or peer_failed event to the release."""
    root = base / f"{which}-rel-{how}-{time.monotonic_ns()}"
    root.mkdir()
    args = ["--at-step", "10", "--steps", "40", "--step-s", "0.05"]
    args += ["--stop-rank", "1"] if how in ("stop", "lost") else ["--kill-rank", "1"]
    args += ["--stop-node"] if how == "lost" else []
    args += ["--keep-sockets"] if how == "kill" else []
    import torch.distributed as dist

    from trainguard.testing.ports import free_port

    # the rendezvous store lives here, as on a node that is not the one lost (were it hosted
    # by the dead rank's agent, its exit would end torchrun's other agent through the store)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs = _launch_nodes(which, root, args, {}, port)
    out: dict[str, float | None] = {"release_s": None, "after_verdict_s": None}
    try:
        deadline = time.monotonic() + 180
        pid0 = None
        released = None
        while time.monotonic() < deadline:
            if pid0 is None:
                pid0 = int(_read_float(root / "pids" / "rank_0") or 0) or None
            died = _read_float(root / "hang_at")
            if died is not None:
                released = _read_float(root / "released_rank_0")
                if released is None and pid0 and _gone(pid0):
                    released = time.time()
                if released is not None:
                    out["release_s"] = released - died
                    break
                if time.time() - died > wait_s:
                    break
            time.sleep(0.01)
        events = root / "run" / "events.jsonl"
        if released is not None and events.exists():
            marks = [
                ev["time"]
                for ev in map(json.loads, events.read_text().splitlines())
                if ev["kind"] in ("hang_detected", "peer_failed")
            ]
            if marks:
                out["after_verdict_s"] = released - min(marks)
        return out
    finally:
        for p in procs:
            kill_tree(p)
        _end(None, root)
        del store


def _read_float(path: Path) -> float | None:
    """A number a worker writes (None while absent or half written)."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def _gone(pid: int) -> bool:
    """Exited (or a zombie its launcher has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


FR_CODE = r"""
import os, sys, time, torch, torch.distributed as dist
from trainguard.core.flight_recorder import start_in_worker
start_in_worker()  # what trainguard's start-up hook runs first in a worker (when asked to)
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1024)
x = torch.randn(256, 256)
def step():
    for _ in range(4):
        x @ x  # a little compute, then the step's collectives
    dist.all_reduce(t)
    dist.broadcast(t, 0)
for _ in range(20):
    step()
ctl = open(sys.argv[1]) if rank == 0 else None  # the bench's pacing: one block at a time
res = open(sys.argv[2], "w") if rank == 0 else None
n = torch.zeros(1, dtype=torch.int64)
while True:
    if rank == 0:
        n[0] = int(ctl.readline() or 0)
    dist.broadcast(n, 0)  # the other job's block runs while this job waits here
    if not n.item():
        break
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n.item()):
        step()
    dist.barrier()
    wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0])
    dist.all_reduce(cpu)  # CPU time of every thread of both ranks (the watcher's included)
    if rank == 0:
        res.write(f"{wall / n.item()} {cpu.item() / n.item()}\n")
        res.flush()
dist.destroy_process_group()
"""


def _open_writer(fifo: Path, proc: subprocess.Popen, timeout: float = 300.0) -> Any:
    """The write end of ``fifo`` once its reader (``proc``'s rank 0) opened it; an error, not
    a wait forever, when ``proc`` ended or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the paced job never opened {fifo} (exit {proc.poll()})") from e
            time.sleep(0.05)
            continue
        os.set_blocking(fd, True)
        return os.fdopen(fd, "w")


def fr_overhead(base: Path, steps: int, rounds: int) -> dict[str, object]:
    """Step time of a small gloo loop (torchrun, 2 processes) with trainguard's collective
    watcher on (what its start-up hook starts: torch's flight recorder at trainguard's buffer
    size, the watcher thread reading it every ``collective_poll_interval_s`` and writing the
    progress record) and off (plain torchrun).

    Both jobs run at once and the bench paces them: one block of ``steps`` steps at a time, in
    the order off, on, on, off, off, on, ... (the job not in its block waits in a broadcast,
    using no CPU). So each "on" block has an "off" block next to it in time, and the slow
    spells of a shared machine (seconds long, up to ±30 % here) fall on both alike. ``rounds``
    pairs; the overhead is the median of the pairs' on/off ratios, with a bootstrap 95 %
    interval of that median; wall time and CPU time (both ranks, all threads) per step."""
    import random

    from trainguard.core import flight_recorder
    from trainguard.core.contracts import envvars

    script = base / "fr_step.py"
    script.write_text(FR_CODE)
    procs: dict[str, subprocess.Popen] = {}
    ctl: dict[str, object] = {}
    res: dict[str, object] = {}
    run_dir = base / "fr-run"
    (run_dir / "progress").mkdir(parents=True, exist_ok=True)
    # the watcher reads its cadence from the run's config.json (the defaults here)
    (run_dir / "config.json").write_text(json.dumps({"trainguard": {"health": {}, "runtime": {}}}))
    try:
        for mode in ("off", "on"):
            env = base_env()
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            if mode == "on":
                env.update({
                    flight_recorder.FR_BUFFER_ENV: str(flight_recorder.FR_BUFFER_DEFAULT),
                    envvars.RUN_DIR: str(run_dir),
                    envvars.PROGRESS_DIR: str(run_dir / "progress"),
                })  # fmt: skip
            fifo_ctl, fifo_res = base / f"fr-{mode}.ctl", base / f"fr-{mode}.res"
            os.mkfifo(fifo_ctl)
            os.mkfifo(fifo_res)
            procs[mode] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", str(script), str(fifo_ctl), str(fifo_res)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            ctl[mode] = _open_writer(fifo_ctl, procs[mode])  # once the job's rank 0 opened it
            res[mode] = open(fifo_res)  # noqa: SIM115  (rank 0 opens it right after ``ctl``)

        def block(mode: str) -> tuple[float, float]:
            ctl[mode].write(f"{steps}\n")  # type: ignore[attr-defined]
            ctl[mode].flush()  # type: ignore[attr-defined]
            wall, cpu = res[mode].readline().split()  # type: ignore[attr-defined]
            return float(wall), float(cpu)

        for mode in ("off", "on"):  # warm-up blocks, not counted
            block(mode)
        walls: dict[str, list[float]] = {"on": [], "off": []}
        cpus: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(rounds):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                wall, cpu = block(mode)
                walls[mode].append(wall)
                cpus[mode].append(cpu)
        for mode in ("off", "on"):
            ctl[mode].write("0\n")  # type: ignore[attr-defined]
            ctl[mode].flush()  # type: ignore[attr-defined]
            procs[mode].wait(timeout=60)
        # the watcher really ran: its progress records exist
        assert list((run_dir / "progress").glob("collectives_rank_*")), "no collective records"
    finally:
        for f in (*ctl.values(), *res.values()):
            f.close()  # type: ignore[attr-defined]
        for p in procs.values():
            if p.poll() is None:
                kill_tree(p.pid)

    def summary(xs: dict[str, list[float]]) -> dict[str, float]:
        ratios = [a / b for a, b in zip(xs["on"], xs["off"], strict=True)]
        rng = random.Random(0)
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        return {
            "on": statistics.median(xs["on"]),
            "off": statistics.median(xs["off"]),
            "pct": 100 * (statistics.median(ratios) - 1),
            "lo": 100 * (boot[50] - 1),
            "hi": 100 * (boot[1949] - 1),
            "rmin": min(ratios),
            "rmax": max(ratios),
        }

    w, c = summary(walls), summary(cpus)
    return {
        "fr_step_s_on": round(w["on"], 6),
        "fr_step_s_off": round(w["off"], 6),
        "fr_overhead_pct": round(w["pct"], 2),
        "fr_overhead_pct_ci95": [round(w["lo"], 2), round(w["hi"], 2)],
        "fr_pair_ratio_min": round(w["rmin"], 4),
        "fr_pair_ratio_max": round(w["rmax"], 4),
        "fr_cpu_per_step_s_on": round(c["on"], 6),
        "fr_cpu_per_step_s_off": round(c["off"], 6),
        "fr_cpu_overhead_pct": round(c["pct"], 2),
        "fr_cpu_overhead_pct_ci95": [round(c["lo"], 2), round(c["hi"], 2)],
        "fr_pairs": rounds,
        "fr_block_steps": steps,
    }


FR_COST_CODE = r"""
import json, os, sys, time, torch, torch.distributed as dist
from trainguard.core.flight_recorder import _default_pg_status
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(16)
def per_call(n):
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / n
per_call(500)
coll = min(per_call(2000) for _ in range(15))  # min: the least disturbed pass (shared box)
poll = None
if os.environ.get("TORCH_FR_BUFFER_SIZE"):
    def one_poll(n):
        t0 = time.perf_counter()
        for _ in range(n):
            _default_pg_status()
        return (time.perf_counter() - t0) / n
    poll = min(one_poll(200) for _ in range(10))
print(json.dumps({"collective_s": coll, "poll_s": poll}))
dist.destroy_process_group()
"""


def fr_cost(base: Path, rounds: int) -> dict[str, object]:
    """The flight recorder's cost per collective, without the network: a one-process gloo
    group (the collective is nearly all overhead), recorder on vs off in alternating
    processes, the least disturbed pass of each; and one watcher poll (the recorder's status
    read). The overhead on a step is then (collectives per step x the per-collective cost +
    polls per step x the poll cost) / step time."""
    script = base / "fr_cost.py"
    script.write_text(FR_COST_CODE)
    got: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for i in range(rounds):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            env = base_env()
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            if mode == "on":
                env["TORCH_FR_BUFFER_SIZE"] = "2000"
            out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                                 text=True, timeout=300)  # fmt: skip
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    on = statistics.median(r["collective_s"] for r in got["on"])
    off = statistics.median(r["collective_s"] for r in got["off"])
    diffs = [
        a["collective_s"] - b["collective_s"] for a, b in zip(got["on"], got["off"], strict=True)
    ]
    poll = statistics.median(r["poll_s"] for r in got["on"])
    return {
        "fr_collective_us_on": round(on * 1e6, 2),
        "fr_collective_us_off": round(off * 1e6, 2),
        "fr_record_cost_us": round((on - off) * 1e6, 2),
        "fr_record_cost_us_pairs": [round(d * 1e6, 2) for d in diffs],
        "fr_poll_us": round(poll * 1e6, 1),
    }


def diagnosis_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description="hang diagnosis: localize, release, FR overhead")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--torchrun-wait", type=float, default=30.0)
    ap.add_argument("--release-wait", type=float, default=60.0)
    ap.add_argument("--release-only", action="store_true")
    ap.add_argument("--fr-only", action="store_true")
    ap.add_argument("--fr-cost-only", action="store_true")
    ap.add_argument("--cases", default="kill,lost,stop,close", help="survivor release cases")
    ap.add_argument("--fr-steps", type=int, default=50, help="steps per paced block")
    ap.add_argument("--fr-rounds", type=int, default=3)
    ap.add_argument("--fr-pairs", type=int, default=200, help="paced on/off block pairs")
    args = ap.parse_args(argv)

    def med(xs: list[float | None]) -> float | None:
        got = [x for x in xs if x is not None]
        return round(statistics.median(got), 3) if got else None

    out: dict[str, object] = {}
    if args.fr_cost_only:
        with tempfile.TemporaryDirectory(prefix="tg-hangdiag-") as tmp:
            print(json.dumps({**fr_cost(Path(tmp), args.fr_rounds),
                              "load_avg": list(os.getloadavg())}))  # fmt: skip
        return
    with tempfile.TemporaryDirectory(prefix="tg-hangdiag-") as tmp:
        base = Path(tmp)
        if not (args.release_only or args.fr_only):
            loc = [localize_once(base, "trainguard", 60) for _ in range(args.runs)]
            tr_loc = localize_once(base, "torchrun", args.torchrun_wait)
            out.update({
                "trainguard_localize_s": med(loc),
                "torchrun_localize_s": None if tr_loc is None else round(tr_loc, 3),
                "torchrun_localize_note": "torchrun names no collective; exit time if it exits"
                f" at all (null: still waiting after {args.torchrun_wait:g} s)",
            })  # fmt: skip
        release: dict[str, dict[str, object]] = {}
        for how in () if args.fr_only else args.cases.split(","):
            for which in ("trainguard", "torchrun"):
                runs = [release_once(base, which, how, args.release_wait)
                        for _ in range(args.runs)]  # fmt: skip
                release.setdefault(how, {})[which] = {
                    "release_s": med([r["release_s"] for r in runs]),
                    "after_verdict_s": med([r["after_verdict_s"] for r in runs]),
                    "runs_s": [r["release_s"] for r in runs],
                }
        if not args.release_only:
            out.update(fr_cost(base, args.fr_rounds))
            out.update(fr_overhead(base, args.fr_steps, args.fr_pairs))
    for how, by in release.items():
        for which, r in by.items():
            print(f"{how:5s} {which:10s} release {r['release_s']} s "
                  f"(after verdict {r['after_verdict_s']}) runs {r['runs_s']}", file=sys.stderr)  # fmt: skip
    out.update({
        "trainguard_survivor_release_s": release.get("kill", {}).get("trainguard", {}).get("release_s"),
        "torchrun_survivor_release_s": release.get("kill", {}).get("torchrun", {}).get("release_s"),
        "survivor_release_note": "peer SIGKILLed on another node, its connections held open (a"
        " lost node); null: still in the collective after"
        f" {args.release_wait:g} s (the process-group timeout is 30 min)",
        "release": release,
        "release_wait_s": args.release_wait,
        "hang_timeout_s": TIMEOUT_S,
        "load_avg": list(os.getloadavg()),
    })  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "diagnosis":
    diagnosis_main(sys.argv[2:])
    sys.exit(0)


if __name__ == "__main__":
    main()
