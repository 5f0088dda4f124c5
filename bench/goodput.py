"""Goodput under faults: effective training time ratio (ETTR), torchrun vs trainguard.

The same script (examples/fault_toy.py, 2-process gloo DDP, ``--step-sleep`` per step, a disk
checkpoint every 20 steps) runs for ``--minutes`` under each launcher, with the same fault
schedule: every ``--fault-every`` seconds after the launcher starts, in rotation,

- ``kill``: SIGKILL of rank 1 (from outside, by PID);
- ``hang``: rank 1 sleeps forever inside a step (its heartbeat thread keeps beating);
- ``nan``: rank 0's batch of its current step turns bad for good (a NaN loss, every visit).

ETTR = productive step time / wall time. Productive time is measured by the script itself,
the same way for both launchers (trainguard/testing/lineage.py): the step executions the final weights
descend from (a parameter hash before and after every step), counting only steps whose loss is
finite. Redone steps, discarded steps and every step after the model went NaN are lost time.

How each launcher meets the faults:
- torchrun (``--max-restarts 100``) restarts both workers on a kill; they resume from the last
  disk checkpoint. trainguard's rollback is switched off (``TRAINGUARD_ROLLBACK_ENABLED=false``)
  and so are its preemption handlers (a plain script dies on torchrun's teardown SIGTERM): a
  NaN just stays, so from the first NaN on nothing is productive under torchrun (it is
  credited with what it had made when its model went NaN for good). torchrun has no hang detection of its own; the script's
  gloo collective timeout (``--pg-timeout``, set to trainguard's hang timeout below) ends the
  survivor's wait, torchrun sees it fail and restarts the group.
- trainguard run (same flags) restores from the node's memory tier, detects the hang after
  ``--hang-timeout`` seconds without progress (``[health] hang_timeout_s``; trainguard's
  automatic default would be max(60 s, 5 x the median step), far longer than these faults
  are apart), and rolls back a NaN loss (``[rollback]`` defaults).

    python bench/goodput.py                 # 5 minutes per launcher, a fault every 30 s
    python bench/goodput.py --minutes 1     # development

Prints a table and ends with one JSON line with trainguard_ettr and torchrun_ettr (medians
over ``--runs``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from trainguard.chaos.procs import descendants, kill_tree  # noqa: E402
from trainguard.testing.lineage import chain, productive_s, read_timing  # noqa: E402

TOY = REPO / "examples" / "fault_toy.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}
ROTATION = ("kill", "hang", "nan")


def _env(which: str, run_dir: Path, hang_timeout: float) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env["PYTHONPATH"] = str(REPO)
    env["TRAINGUARD_RUNTIME_RUN_DIR"] = str(run_dir)
    env["TRAINGUARD_CHECKPOINT_PERSIST_MODE"] = "thread"
    if which == "torchrun":
        env["TRAINGUARD_ROLLBACK_ENABLED"] = "false"
        env["TRAINGUARD_CHECKPOINT_PREEMPTION_SIGNALS"] = ""
    else:
        env["TRAINGUARD_HEALTH_HANG_TIMEOUT_S"] = str(hang_timeout)
    return env


def _kill_rank1(ctl: Path, launcher_pid: int) -> bool:
    try:
        pid = int((ctl / "pid_1").read_text())
    except (OSError, ValueError):
        return False
    if pid not in descendants(launcher_pid):  # restarting right now: nothing to kill
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def once(which: str, root: Path, args: argparse.Namespace) -> dict:
    d = root / f"{which}-{time.monotonic_ns()}"
    ctl = d / "ctl"
    ctl.mkdir(parents=True)
    timing = d / "timing.jsonl"
    cmd = [
        *LAUNCHERS[which], "--standalone", "--nproc-per-node", "2", "--max-restarts", "100",
        "--monitor-interval", "0.1", str(TOY), "--steps", str(10**9),
        "--step-sleep", str(args.step_sleep), "--ckpt-every", "20", "--ctl", str(ctl),
        "--state-dir", str(ctl), "--timing", str(timing), "--pg-timeout", str(args.hang_timeout),
    ]  # fmt: skip
    duration = args.minutes * 60
    log = (d / "launcher.log").open("w")
    t0 = time.time()
    p = subprocess.Popen(
        cmd, cwd=d, env=_env(which, d / "run", args.hang_timeout), stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    injected: dict[str, int] = dict.fromkeys(ROTATION, 0)
    missed = 0
    try:
        k = 1
        while True:
            t_fault = k * args.fault_every
            if t_fault >= duration:
                break
            time.sleep(max(0.0, t0 + t_fault - time.time()))
            if p.poll() is not None:
                break
            kind = ROTATION[(k - 1) % len(ROTATION)]
            if kind == "kill":
                ok = _kill_rank1(ctl, p.pid)
            else:
                (ctl / "fault.tmp").write_text(f"{k} {kind}")
                os.replace(ctl / "fault.tmp", ctl / "fault")
                ok = True
            injected[kind] += ok
            missed += not ok
            k += 1
        time.sleep(max(0.0, t0 + duration - time.time()))
        t_end = time.time()
        ended_early = p.poll()
    finally:
        kill_tree(p)
        log.close()
    execs = read_timing(timing)
    prod = productive_s(execs, until=t_end)
    good = chain(execs, until=t_end)
    steps = len(execs)
    out = {
        "launcher": which,
        "wall_s": t_end - t0,
        "productive_s": prod,
        "ettr": prod / (t_end - t0),
        "steps_run": steps,
        "steps_kept": sum(1 for e in good if e["loss"] not in ("nan", "inf")),
        "final_loss": good[-1]["loss"] if good else None,
        "injected": injected,
        "missed": missed,
        "ended_early": ended_early,
        "dir": str(d),
    }
    if which == "trainguard":
        out.update(_telemetry(d / "run", t_end))
    return out


def _telemetry(run_dir: Path, t_end: float) -> dict:
    """trainguard's own accounting of the same run (its report's goodput), for comparison."""
    from trainguard.core.events import read_events
    from trainguard.core.goodput import compute_goodput
    from trainguard.telemetry.report import load_run

    events = list(read_events(run_dir))
    recs = [r for rs in load_run(run_dir).records.values() for r in rs]
    g = compute_goodput(events, recs, now=t_end)
    return {
        "telemetry_ettr": g.ettr,
        "telemetry_lost_s": {k: round(v, 2) for k, v in g.lost_s.items()},
        "rollbacks": sum(1 for e in events if e["kind"] == "loss_rollback"),
        "hangs": sum(1 for e in events if e["kind"] == "hang_detected"),
        "restarts": sum(1 for e in events if e["kind"] == "restart"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--step-sleep", type=float, default=0.1)
    ap.add_argument("--hang-timeout", type=float, default=3.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--launchers", default="torchrun,trainguard")
    ap.add_argument("--keep", default=None, help="keep the run directories under this path")
    args = ap.parse_args()
    launchers = args.launchers.split(",")
    results: dict[str, list[dict]] = {w: [] for w in launchers}
    with tempfile.TemporaryDirectory(prefix="tg-goodput-") as tmp:
        root = Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for _ in range(args.runs):
            for which in launchers:
                r = once(which, root, args)
                results[which].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "dir"}), file=sys.stderr)
    print(
        f"\n{args.minutes:g} min per run, a fault every {args.fault_every:g} s "
        f"({'/'.join(ROTATION)}), {args.step_sleep:g} s steps, hang timeout "
        f"{args.hang_timeout:g} s\n"
    )
    hdr = f"{'launcher':<11} {'ETTR':>6} {'productive s':>12} {'wall s':>7} {'steps run':>9} "
    hdr += f"{'steps kept':>10} {'faults k/h/n':>12} {'final loss':>12} {'tg telemetry ETTR':>17}"
    print(hdr)
    print("-" * len(hdr))
    med: dict[str, float | None] = {}
    for which, rs in results.items():
        med[which] = statistics.median(r["ettr"] for r in rs) if rs else None
        for r in rs:
            inj = r["injected"]
            tel = r.get("telemetry_ettr")
            print(
                f"{which:<11} {r['ettr']:>6.3f} {r['productive_s']:>12.1f} {r['wall_s']:>7.1f} "
                f"{r['steps_run']:>9} {r['steps_kept']:>10} "
                f"{'/'.join(str(inj[k]) for k in ROTATION):>12} "
                f"{str(r['final_loss'])[:12]:>12} {'' if tel is None else f'{tel:.3f}':>17}"
            )
    tg = results.get("trainguard", [])
    if tg:
        lost = tg[-1].get("telemetry_lost_s", {})
        print("\ntrainguard's own badput by cause (last run): "
              + ", ".join(f"{k} {v:.1f} s" for k, v in lost.items() if v))  # fmt: skip
    print(
        json.dumps({"trainguard_ettr": med.get("trainguard"), "torchrun_ettr": med.get("torchrun")})
    )


if __name__ == "__main__":
    main()
