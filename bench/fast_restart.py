"""Fast restart: kill -9 of one worker → time to the next completed step, and steps redone.

Same job for every path: bench/fast_restart_worker.py, a plain 2-process gloo DDP toy (no
trainguard import), ~50 ms steps, checkpoint every 20 steps. Each path runs one job and kills
rank 1 with SIGKILL ``--kills`` times, always at the same points (step ≡ offset mod 20, the
offsets fixed and equal for all paths), once the job has run ``--settle-steps`` steps since its
last restart (and, on the warm path, once its warm processes are ready, as they are in steady
state). Per kill: seconds from the kill to the first step the restarted group completes, and
the steps redone (last step done before the kill minus the step it resumed from).

Paths, side by side in one run:
- ``torchrun``
- ``trainguard``: ``trainguard run --no-tg-warm`` (cold restarts, the path before warm restarts)
- ``trainguard_warm``: ``trainguard run`` (warm restarts, the default)
- ``trainguard_warm_memory``: ``trainguard run``, the same toy with ``--tg-checkpoint``
  (trainguard's checkpoints: the memory tier every step), so a restart resumes from the last
  step, not the last disk checkpoint
- ``trainguard_inprocess``: only with ``--inprocess-example SCRIPT``, otherwise null. HOOK: point
  it at the in-process example once ``tg.run``/``@trainguard.restartable`` lands (e.g.
  examples/train_inprocess.py): run as ``SCRIPT --steps N --step-sleep 0.05``, it prints
  ``TG_STEP {"step": <0-based step done>, "rank", "pid", "gen", "time"}`` lines to stdout
  (a new ``gen`` after each in-process restart).
- torchft mode: the survivor's pause under torchft and ``trainguard run --ft`` (trainguard/testing/ft.py,
  as bench/ft.py; ``--ft-kills 0`` skips it).

trainguard's best path (``trainguard_steps_redone``, ``best_over_torchrun``) is the fastest
path that redoes at most one step (median), else the fastest path.

Prints a table and ends with one JSON line: torchrun_worker_mttr_s, trainguard_worker_mttr_s,
trainguard_warm_mttr_s, trainguard_inprocess_mttr_s, trainguard_steps_redone, torchft_pause_s,
trainguard_ft_pause_s, trainguard_ft_survivor_crashes (medians; more keys after them).

    PYTHONPATH=. python bench/fast_restart.py [--kills 5] [--ft-kills 5]
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
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.chaos.procs import kill_tree  # noqa: E402

WORKER = REPO / "bench" / "fast_restart_worker.py"
CKPT_EVERY = 20
OFFSETS = [7, 13, 3, 17, 10, 5, 15, 1, 12, 8]
"""Kill points (step mod CKPT_EVERY), the same for every path."""
WARM_PATHS = ("trainguard_warm", "trainguard_warm_memory", "trainguard_inprocess")
"""Killed only once their warm processes are ready (their steady state)."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAINGUARD = [sys.executable, "-m", "trainguard", "run"]


@dataclass
class PathResult:
    name: str
    mttr_s: list[float] = field(default_factory=list)
    redone: list[int] = field(default_factory=list)
    warm: list[bool] = field(default_factory=list)
    hung: int = 0
    note: str = ""

    def med(self, xs: list) -> float | None:
        return round(statistics.median(xs), 3) if xs else None


class StepLog:
    """Follows OUT/steps_<rank>.log: (step, time, pid, generation) per completed step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[int, float, int, str]] = []
        self._pos = 0

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind("\n") + 1
        self._pos += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            s, t, pid, gen = line.split()
            self.lines.append((int(s), float(t), int(pid), gen))

    @property
    def last(self) -> tuple[int, float, int, str] | None:
        return self.lines[-1] if self.lines else None


class TGStepLog(StepLog):
    """The in-process example's ``TG_STEP {json}`` lines for one rank, from the launcher log."""

    def __init__(self, path: Path, rank: int) -> None:
        super().__init__(path)
        self.rank = rank

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self._pos += end
        for line in chunk[:end].decode(errors="replace").splitlines():
            if not line.startswith("TG_STEP "):
                continue
            rec = json.loads(line[len("TG_STEP ") :])
            if rec["rank"] == self.rank:
                self.lines.append((rec["step"] + 1, rec["time"], rec["pid"], str(rec["gen"])))


def _events(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def _warm_ready(run_dir: Path) -> bool:
    """Both local ranks have a ready warm process since the last start."""
    ready = 0
    for e in _events(run_dir):
        if e["kind"] == "workers_started":
            ready = 0
        elif e["kind"] == "warm_ready":
            ready += 1
    return ready >= 2


def _started_warm(run_dir: Path) -> bool:
    starts = [e for e in _events(run_dir) if e["kind"] == "workers_started"]
    return bool(starts) and all(w.get("warm") for w in starts[-1]["workers"])


def run_path(
    name: str, cmd: list[str], root: Path, *, kills: int, settle: int, timeout: float
) -> PathResult:
    """``kills`` samples; a job whose restart hangs (torchrun's shared store) is counted in
    ``hung``, ended, and a fresh job takes over (at most 3 × ``kills`` hangs)."""
    res = PathResult(name)
    job = 0
    while len(res.mttr_s) < kills and res.hung < 3 * kills:
        _one_job(res, name, cmd, root / f"{name}-{job}", kills, settle, timeout)
        job += 1
    return res


def _one_job(
    res: PathResult, name: str, cmd: list[str], d: Path, kills: int, settle: int, timeout: float
) -> None:
    out, run_dir = d / "out", d / "run"
    d.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", str(kills + 1)]
    if cmd[: len(TRAINGUARD)] == TRAINGUARD:  # trainguard (--no-tg-warm included)
        args += ["--tg-run-dir", str(run_dir)]
        # Its job-wide backoff off: the bench kills every few seconds, which trainguard's
        # policy reads as a job failing without progress (a plain script commits no
        # checkpoint it could see) and answers with 1, 2, 4 s waits; torchrun has none.
        env["TRAINGUARD_RECOVERY_BACKOFF_BASE_S"] = "0"
    log = open(d / "launcher.log", "wb")  # noqa: SIM115
    if name == "trainguard_inprocess":
        script = [str(INPROCESS_EXAMPLE), "--steps", "10000000", "--step-sleep", "0.05"]
        r0, r1 = TGStepLog(d / "launcher.log", 0), TGStepLog(d / "launcher.log", 1)
    else:
        script = [str(WORKER), "--out", str(out)]
        if name == "trainguard_warm_memory":
            script.append("--tg-checkpoint")
        r0, r1 = StepLog(out / "steps_0.log"), StepLog(out / "steps_1.log")
    p = subprocess.Popen(
        [*cmd, *args, *script], cwd=d, env=env, stdout=log, stderr=log, start_new_session=True
    )
    try:
        while len(res.mttr_s) < kills:
            i = len(res.mttr_s)
            gen_before = _wait_kill_point(
                p, r0, r1, run_dir, name, settle, OFFSETS[i % len(OFFSETS)], timeout
            )
            if gen_before is None:
                res.hung += 1
                res.note = (
                    f"{res.hung} job(s) without a kill point or a step within {timeout:.0f} s"
                )
                return
            last_before = r0.last
            victim = r1.last[2] if r1.last else None
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            first_after = _wait_next_generation(p, r0, gen_before, timeout)
            if first_after is None:
                res.hung += 1
                res.note = f"{res.hung} restart(s) without a step within {timeout:.0f} s"
                return
            done_before = max(s for s, t, _, g in r0.lines if t <= t_kill and g == gen_before)
            res.mttr_s.append(first_after[1] - t_kill)
            res.redone.append(done_before - (first_after[0] - 1))
            res.warm.append(_started_warm(run_dir))
            print(
                f"  {name:<22} kill {i}: next step after {res.mttr_s[-1]:.2f} s, "
                f"redone {res.redone[-1]}, last step before {last_before[0]}",
                flush=True,
            )
    finally:
        kill_tree(p)
        log.close()


INPROCESS_EXAMPLE: Path | None = None


def _wait_kill_point(
    p: subprocess.Popen, r0: StepLog, r1: StepLog, run_dir: Path, name: str, settle: int,
    offset: int, timeout: float,
) -> str | None:  # fmt: skip
    """Wait until the current generation has done ``settle`` steps, (warm path) its warm
    processes are ready, and rank 0 just completed a step ≡ offset (mod CKPT_EVERY)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        r0.poll()
        r1.poll()
        last = r0.last
        if last is not None and r1.last is not None and r1.last[3] == last[3]:
            if (
                last[0] % CKPT_EVERY == offset
                and sum(1 for line in r0.lines if line[3] == last[3]) >= settle
                and (name not in WARM_PATHS or _warm_ready(run_dir))
            ):
                return last[3]
        time.sleep(0.005)
    return None


def _wait_next_generation(
    p: subprocess.Popen, r0: StepLog, gen: str, timeout: float
) -> tuple[int, float, int, str] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        r0.poll()
        for line in r0.lines:
            if line[3] != gen and int(line[3]) > int(gen):
                return line
        time.sleep(0.005)
    return None


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    global INPROCESS_EXAMPLE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--settle-steps", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=60.0, help="per wait (s)")
    ap.add_argument(
        "--paths",
        default="torchrun,trainguard,trainguard_warm,trainguard_warm_memory,trainguard_inprocess",
    )
    ap.add_argument("--inprocess-example", default=None, help="in-process restart example")
    ap.add_argument("--ft-kills", type=int, default=5)
    args = ap.parse_args()
    if args.inprocess_example:
        INPROCESS_EXAMPLE = Path(args.inprocess_example).resolve()
    cmds = {
        "torchrun": TORCHRUN,
        "trainguard": [*TRAINGUARD, "--no-tg-warm"],
        "trainguard_warm": TRAINGUARD,
        "trainguard_warm_memory": TRAINGUARD,
        "trainguard_inprocess": TRAINGUARD,
    }
    results: dict[str, PathResult] = {}
    ft: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="bench-fast-restart-") as tmp:
        for name in args.paths.split(","):
            if name == "trainguard_inprocess" and INPROCESS_EXAMPLE is None:
                results[name] = PathResult(name, note="no --inprocess-example: not measured")
                continue
            t0 = time.monotonic()
            results[name] = run_path(
                name, cmds[name], Path(tmp), kills=args.kills, settle=args.settle_steps,
                timeout=args.timeout,
            )  # fmt: skip
            print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
        if args.ft_kills > 0:
            from bench._support import base_env
            from trainguard.testing.ft import run_kills

            for mode in ("torchft", "trainguard"):
                r = run_kills(
                    mode, Path(tmp) / f"ft-{mode}", kills=args.ft_kills, timeout_s=180,
                    env=base_env(),
                )  # fmt: skip
                ft[mode] = r
                print(
                    f"ft {mode}: pause {_fmt(r.pauses_s)} s, survivor crashes {r.survivor_crashes}",
                    flush=True,
                )
    print()
    print(f"{'path':<22} {'kills':>5} {'warm':>5} {'hung':>4} {'next step s median (min-max)':>30} "
          f"{'redone median (min-max)':>24}")  # fmt: skip
    for name, r in results.items():
        redone = _fmt([float(x) for x in r.redone])
        print(
            f"{name:<22} {len(r.mttr_s):>5} {sum(r.warm):>5} {r.hung:>4} {_fmt(r.mttr_s):>30} "
            f"{redone:>24}  {r.note}"
        )
    for mode, r in ft.items():
        print(f"ft {mode:<19} {len(r.pauses_s):>5} {'':>5} {'':>4} {_fmt(r.pauses_s):>30}")

    def mttr(name: str) -> float | None:
        r = results.get(name)
        return r.med(r.mttr_s) if r else None

    tg_paths = [
        n
        for n in ("trainguard", "trainguard_warm", "trainguard_warm_memory", "trainguard_inprocess")
        if mttr(n)
    ]
    bounded = [n for n in tg_paths if (results[n].med(results[n].redone) or 0) <= 1]
    best = min(bounded or tg_paths, key=lambda n: mttr(n) or 0.0) if tg_paths else None
    tr = mttr("torchrun")
    out: dict[str, object] = {
        "torchrun_worker_mttr_s": tr,
        "trainguard_worker_mttr_s": mttr("trainguard"),
        "trainguard_warm_mttr_s": mttr("trainguard_warm"),
        "trainguard_inprocess_mttr_s": mttr("trainguard_inprocess"),
        "trainguard_steps_redone": results[best].med(results[best].redone) if best else None,
        "torchft_pause_s": _ft(ft, "torchft", "pause"),
        "trainguard_ft_pause_s": _ft(ft, "trainguard", "pause"),
        "trainguard_ft_survivor_crashes": _ft(ft, "trainguard", "crashes"),
        "torchft_survivor_crashes": _ft(ft, "torchft", "crashes"),
        "trainguard_warm_memory_mttr_s": mttr("trainguard_warm_memory"),
        "best_trainguard_path": best,
        "best_over_torchrun": round(mttr(best) / tr, 3) if best and tr else None,
        "torchrun_steps_redone": results["torchrun"].med(results["torchrun"].redone)
        if "torchrun" in results
        else None,
        "kills": args.kills,
        "hung": {n: r.hung for n, r in results.items()},
    }
    print(json.dumps(out))


def _ft(ft: dict, mode: str, what: str) -> float | int | None:
    r = ft.get(mode)
    if r is None:
        return None
    if what == "crashes":
        return r.survivor_crashes
    return round(r.pause_median_s, 3) if r.pauses_s else None


if __name__ == "__main__":
    main()
