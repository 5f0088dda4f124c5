"""Two torchft replica groups of examples/ft_ddp.py, one of them kill -9'd again and again.

Used by tests/test_ft.py (a few kills) and bench/ft.py (30 kills per mode, side by side):

- ``mode="trainguard"``: each group is ``trainguard run --ft`` (the first one starts the
  lighthouse); the workers use ``tg.ft_wrap`` (trainguard's guarded comm hook).
- ``mode="torchft"``: torchft alone: its own ``torchft_lighthouse`` (same timeouts) and one
  ``torchrun`` per group; the workers use ``torchft.DistributedDataParallel`` as documented.

Each kill waits until the victim group's (re)started worker has committed a few steps with the
survivor, SIGKILLs that worker (its launcher restarts it, it heals from the survivor), and
measures the survivor's pause from its per-step log: the first committed step after the kill
minus the last one before it. A survivor crash is a second worker PID in the survivor's log or
a survivor launcher that exits non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, TypeVar

from trainguard.chaos.procs import kill_tree
from trainguard.core.config import setting_env
from trainguard.testing.net import wait_listening
from trainguard.testing.ports import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ft_ddp.py"
"""The example both groups run (the source checkout's)."""
LAUNCHERS: dict[str, list[str]] = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}
LIGHTHOUSE_FLAGS = ["--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "100"]
LIGHTHOUSE_FLAGS += ["--quorum_tick_ms", "50", "--min_replicas", "1"]


@dataclass
class FTResult:
    mode: str
    kills: int
    pauses_s: list[float] = field(default_factory=list)
    survivor_pids: list[int] = field(default_factory=list)
    survivor_crashes: int = 0
    survivor_rc: int | None = None
    victim_rc: int | None = None
    final: dict[int, dict[str, object]] = field(default_factory=dict)
    run_dirs: dict[int, Path] = field(default_factory=dict)
    logs: dict[int, Path] = field(default_factory=dict)

    @property
    def pause_median_s(self) -> float | None:
        return statistics.median(self.pauses_s) if self.pauses_s else None

    @property
    def weights_equal(self) -> bool:
        return len(self.final) == 2 and self.final[0]["w"] == self.final[1]["w"]


class Record(TypedDict, total=False):
    """One line of a group's step log (examples/ft_ddp.py ``--step-log``)."""

    pid: int
    step: int
    t: float
    participants: int


T = TypeVar("T")


def _records(path: Path) -> list[Record]:
    out: list[Record] = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _wait(
    cond: Callable[[], T | None], timeout: float, what: str, procs: list[subprocess.Popen[bytes]]
) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: launcher {p.args!r} exited with {p.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def run_kills(
    mode: str,
    workdir: Path,
    *,
    kills: int,
    steps_between: int = 5,
    step_time_s: float = 0.05,
    timeout_s: float = 120.0,
    env: dict[str, str],
) -> FTResult:
    """Run the two groups, kill group 1's worker ``kills`` times, end both at the same step.
    ``env``: the launchers' environment (the caller's: the test suite's or the bench's)."""
    workdir.mkdir(parents=True, exist_ok=True)
    res = FTResult(mode=mode, kills=kills)
    port = free_port()
    stop_file = workdir / "stop_at"
    stop_file.unlink(missing_ok=True)
    env = {**env, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
    env[setting_env("ft", "lighthouse_port")] = str(port)
    env.setdefault("RUST_LOG", "warn")
    procs: list[subprocess.Popen[bytes]] = []
    outs = []
    try:
        if mode == "torchft":
            lh = workdir / "lighthouse.log"
            lh_out = open(lh, "wb")  # noqa: SIM115
            outs.append(lh_out)
            binary = str(Path(sys.executable).parent / "torchft_lighthouse")
            procs.append(
                subprocess.Popen(
                    [binary, "--bind", f"127.0.0.1:{port}", *LIGHTHOUSE_FLAGS],
                    stdout=lh_out,
                    stderr=lh_out,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
            wait_listening(port, timeout=30)
        groups: dict[int, subprocess.Popen[bytes]] = {}
        for rg in (0, 1):
            log = workdir / f"rg{rg}.steps.jsonl"
            log.unlink(missing_ok=True)
            res.logs[rg] = log
            run_dir = workdir / f"run_rg{rg}"
            res.run_dirs[rg] = run_dir
            script = [str(EXAMPLE), "--steps", "1000000", "--step-time", str(step_time_s)]
            script += ["--step-log", str(log), "--out", str(workdir), "--stop-file", str(stop_file)]
            common = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1000"]
            common += ["--monitor-interval", "0.1"]
            if mode == "torchft":
                cmd = LAUNCHERS["torchrun"] + common + [*script, "--plain-torchft"]
            else:
                cmd = LAUNCHERS["trainguard"] + ["--ft", "--tg-run-dir", str(run_dir)]
                cmd += common + [*script, "--ckpt-every", "20"]
            out = open(workdir / f"rg{rg}.out", "wb")  # noqa: SIM115
            outs.append(out)
            groups[rg] = subprocess.Popen(
                cmd,
                cwd=workdir,
                env={**env, "REPLICA_GROUP_ID": str(rg)},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            procs.append(groups[rg])
        live = list(groups.values())

        def committed(rg: int, pid: int | None = None) -> list[Record]:
            recs = _records(res.logs[rg])
            return [r for r in recs if pid is None or r["pid"] == pid]

        killed: set[int] = set()
        for _ in range(kills):
            # the victim's current worker has trained a few steps together with the survivor
            def ready() -> int | None:
                recs = [r for r in committed(1) if r["pid"] not in killed]
                if len(recs) < steps_between:
                    return None
                pid = recs[-1]["pid"]
                mine = [r for r in recs if r["pid"] == pid]
                surv = committed(0)
                if len(mine) >= steps_between and surv and surv[-1]["step"] >= mine[-1]["step"]:
                    return pid
                return None

            victim = _wait(ready, timeout_s, "victim group trains again", live)
            before = committed(0)
            t_kill = time.time()
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
            last_before = max((r["t"] for r in before), default=t_kill)

            def resumed(last_before: float = last_before, t_kill: float = t_kill) -> float | None:
                # the longest gap between the survivor's committed steps from its last one
                # before the kill to its first one without the dead group
                times = [last_before]
                for r in committed(0):
                    if r["t"] > last_before:
                        times.append(r["t"])
                        if r["t"] > t_kill and r.get("participants") == 1:
                            return max(b - a for a, b in zip(times, times[1:], strict=False))
                return None

            try:
                res.pauses_s.append(_wait(resumed, timeout_s, "survivor commits a step", live))
            except RuntimeError:
                break  # a launcher gave up: counted below
        # end both groups at the same step, after the victim rejoined
        if groups[0].poll() is None and groups[1].poll() is None:

            def rejoined() -> bool:
                recs = [r for r in committed(1) if r["pid"] not in killed]
                return len(recs) >= 2

            try:
                _wait(rejoined, timeout_s, "victim rejoins for the end", live)
            except RuntimeError:
                pass
            target = max((r["step"] for r in committed(0)), default=0) + 15
            stop_file.write_text(str(target))
        for rg, p in groups.items():
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            if rg == 0:
                res.survivor_rc = rc
            else:
                res.victim_rc = rc
        res.survivor_pids = list(dict.fromkeys(r["pid"] for r in committed(0)))
        res.survivor_crashes = max(0, len(res.survivor_pids) - 1)
        if res.survivor_rc not in (0, None) and res.survivor_crashes == 0:
            res.survivor_crashes = 1
        for rg in (0, 1):
            path = workdir / f"rg{rg}_final.json"
            if path.exists():
                res.final[rg] = json.loads(path.read_text())
        return res
    finally:
        for p in procs:
            kill_tree(p)
        for f in outs:
            f.close()
