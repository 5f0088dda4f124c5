"""A watcher outside the job: ``trainguard watch RUN_DIR`` pages when the job goes silent.

A job's own pager (``PagerPlugin``) lives in its agents: a job whose agents all die at once
(SIGKILL, a frozen node, a cancelled batch step) says nothing. Every agent writes a heartbeat
file, ``heartbeats/<node>.json`` (its host, pid, process start, attempt, a counter), every
``[alerts] heartbeat_s``; the watcher, a separate process (``trainguard sbatch`` starts one on
the batch host, outliving the job step), reads the heartbeats and ``events.jsonl`` and pages
through the configured pager:

``TrainGuardJobSilent``
    no heartbeat and no event from any agent for ``silence_s`` (default: three heartbeats plus
    5 s) while the job has not ended: the job is frozen (SIGSTOP, a hung node, a lost file
    system). Resolved when a heartbeat comes again.
``TrainGuardJobLost``
    every agent the watcher can see (the ones on its own host, checked by pid and process
    start) is gone, and no ``job_finished`` event was written: the job ended without a word.
``TrainGuardJobQueued``
    no agent started ``queued_limit_s`` after the watcher did (with ``--slurm-job``: the job is
    still pending in Slurm's queue).

One incident pages once (its dedup key names the run and the incident), and says what the
watcher saw last: the newest event and heartbeat. A job that ends with its ``job_finished``
events pages nothing (a failed job is paged by its own agents) and the watcher exits 0;
after a ``TrainGuardJobLost`` it exits 3.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.atomicfile import make_dirs, write_atomic
from trainguard.core.config.alerts import AlertsConfig
from trainguard.core.contracts.event_kinds import JOB_FINISHED, LAUNCH
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.jsonl import JsonlTail
from trainguard.core.plugin import AgentContext, AgentPlugin
from trainguard.core.proctime import process_start_time
from trainguard.dashboards.pager import Page, Pager

__all__ = ["EXIT_LOST", "HeartbeatPlugin", "Watcher", "WatchVerdict", "silence_for"]

logger = logging.getLogger(__name__)

EXIT_LOST = 3
"""``trainguard watch``'s exit code when the job ended without a final event."""


def silence_for(cfg: AlertsConfig) -> float:
    """How long every agent may stay silent before the watcher pages."""
    return cfg.silence_s if cfg.silence_s is not None else 3 * cfg.heartbeat_s + 5.0


class HeartbeatPlugin(AgentPlugin):
    """Writes this agent's heartbeat file every ``heartbeat_s`` from a daemon thread (so a
    rendezvous or a long restart does not silence it; a stopped or killed agent does)."""

    name = "heartbeat"

    def __init__(self, ctx: AgentContext, interval_s: float) -> None:
        self._ctx = ctx
        self._path = RunDir(ctx.run_dir).heartbeat(ctx.events.node)
        self._interval = interval_s
        self._stop = threading.Event()
        self._seq = 0
        self._pid = os.getpid()
        self._start = process_start_time(self._pid)
        self.num_write_failures = 0
        self._beat()
        self._thread = threading.Thread(target=self._run, name="tg-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._seq += 1
        beat = {
            "time": time.time(), "node": self._ctx.events.node, "host": socket.gethostname(),
            "pid": self._pid, "process_start": self._start, "attempt": self._ctx.attempt,
            "seq": self._seq,
        }  # fmt: skip
        try:
            make_dirs(self._path.parent)
            write_atomic(self._path, json.dumps(beat))
        except OSError as e:
            self.num_write_failures += 1
            if self.num_write_failures == 1:
                logger.warning("heartbeat: cannot write %s: %s", self._path, e)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass(slots=True)
class WatchVerdict:
    """What one look at the run directory found."""

    state: str
    """``waiting`` (no agent yet), ``running``, ``silent``, ``lost``, ``finished``."""
    message: str
    seen: dict[str, Any] = field(default_factory=dict)


def _pid_alive(pid: int, start: float | None) -> bool:
    got = process_start_time(pid)
    if got is None:
        return False
    return start is None or abs(got - start) < 1.0


def _slurm_state(job_id: str) -> str | None:
    """The job's state in Slurm's queue (``PENDING``, ``RUNNING``...), None when unknown."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (
        out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    )


class Watcher:
    """Looks at a run directory (``look()``) and pages through ``pager`` (``step()``)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        cfg: AlertsConfig,
        pager: Pager | None,
        *,
        queued_limit_s: float | None = None,
        slurm_job: str | None = None,
        clock: Callable[[], float] = time.time,
        pid_alive: Callable[[int, float | None], bool] = _pid_alive,
        slurm_state: Callable[[str], str | None] = _slurm_state,
    ) -> None:
        self.run = RunDir(run_dir)
        self.cfg = cfg
        self.pager = pager
        self.silence_s = silence_for(cfg)
        self.queued_limit_s = queued_limit_s
        self.slurm_job = slurm_job
        self._clock = clock
        self._pid_alive = pid_alive
        self._slurm_state = slurm_state
        self._started = clock()
        self._host = socket.gethostname()
        self._tail = JsonlTail(self.run.events)
        self.launched: dict[str, dict[str, Any]] = {}
        self.finished: dict[str, dict[str, Any]] = {}
        self.last_event: dict[str, Any] | None = None
        self.pages: list[Page] = []
        self._firing: set[str] = set()
        self.run_id = self.run.root.name
        self.job_id = self._job_id()

    def _job_id(self) -> str:
        try:
            cfg = json.loads(self.run.config.read_text())
            return str(cfg.get("torchrun", {}).get("rdzv_id") or self.run_id)
        except (OSError, ValueError):
            return self.run_id

    # -- reading ---------------------------------------------------------------------------------
    def _read_events(self) -> None:
        for ev in self._tail.read():
            if not isinstance(ev, dict):
                continue
            self.last_event = ev
            node = str(ev.get("node", ""))
            if ev.get("kind") == LAUNCH:
                self.launched[node] = ev
                self.finished.pop(node, None)
            elif ev.get("kind") == JOB_FINISHED:
                self.finished[node] = ev

    def heartbeats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for path in sorted(self.run.heartbeats.glob("*.json")):
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(beat, dict) and isinstance(beat.get("time"), (int, float)):
                out[str(beat.get("node") or path.stem)] = beat
        return out

    def look(self) -> WatchVerdict:
        """One look: the job's state now (reads only; pages nothing)."""
        now = self._clock()
        beats = self.heartbeats()
        # the pids first, the events after: an agent that ended normally wrote its
        # job_finished before it exited, so its event is read whenever its pid is seen gone
        here_dead = {
            n: b for n, b in beats.items()
            if b.get("host") == self._host and isinstance(b.get("pid"), int)
            and not self._pid_alive(int(b["pid"]), b.get("process_start"))
        }  # fmt: skip
        self._read_events()
        seen = self.seen(beats)
        if not self.launched:
            return WatchVerdict("waiting", "no agent has started yet", seen)
        running = [n for n in self.launched if n not in self.finished]
        if not running:
            return WatchVerdict("finished", "every agent wrote job_finished", seen)
        if all(n in here_dead for n in running):
            return WatchVerdict(
                "lost",
                f"every agent of job {self.job_id} is gone without a final event "
                f"(nodes {', '.join(sorted(running))})",
                seen,
            )
        times = [float(b["time"]) for b in beats.values()]
        if self.last_event is not None:
            times.append(float(self.last_event.get("time") or 0.0))
        last = max(times, default=0.0)
        quiet = now - last
        if quiet > self.silence_s:
            return WatchVerdict(
                "silent",
                f"no heartbeat or event from job {self.job_id} for {quiet:.0f} s "
                f"(limit {self.silence_s:.0f} s): its agents are frozen or cut off",
                seen,
            )
        return WatchVerdict("running", f"last heard {quiet:.1f} s ago", seen)

    def seen(self, beats: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """What the watcher saw last (a page's details)."""
        newest = max(beats.values(), key=lambda b: float(b["time"]), default=None)
        ev = self.last_event
        return {
            "run_dir": str(self.run.root),
            "last_event": None if ev is None else {
                k: ev.get(k) for k in ("kind", "node", "attempt", "time", "state", "message")
                if ev.get(k) is not None
            },
            "last_heartbeat": newest,
            "runbook": f"trainguard events {self.run.root}; check the job's nodes (frozen, "
            "powered off, cut off from the run directory) and its scheduler's state",
        }  # fmt: skip

    # -- paging ----------------------------------------------------------------------------------
    def _page(self, incident: str, alertname: str, status: str, v: WatchVerdict) -> None:
        key = f"trainguard/{self.job_id}/watch/{incident}"
        if status == "firing":
            if key in self._firing:
                return
            self._firing.add(key)
        elif key not in self._firing:
            return
        else:
            self._firing.discard(key)
        now = self._clock()
        page = Page(
            key, alertname, status, v.message,
            {"severity": "critical", "component": "job", "job_id": self.job_id,
             "run_id": self.run_id, "node": "watch"},
            v.seen, starts_at=now, ends_at=now if status == "resolved" else None,
        )  # fmt: skip
        self.pages.append(page)
        logger.warning("watch: %s %s: %s", alertname, status, v.message)
        if self.pager is not None:
            self.pager.submit(page)

    def step(self) -> WatchVerdict:
        """One look, and the pages (or resolves) it calls for."""
        v = self.look()
        if v.state == "waiting" and self.queued_limit_s is not None:
            waited = self._clock() - self._started
            state = self._slurm_state(self.slurm_job) if self.slurm_job else None
            if waited > self.queued_limit_s and (self.slurm_job is None or state == "PENDING"):
                where = f"Slurm job {self.slurm_job} still {state}" if state else "no agent"
                v = WatchVerdict(
                    "queued",
                    f"job {self.job_id} not started {waited:.0f} s after the watcher "
                    f"({where}; limit {self.queued_limit_s:.0f} s)",
                    v.seen,
                )
                self._page("queued", "TrainGuardJobQueued", "firing", v)
        if v.state in ("running", "finished", "lost"):
            self._page("queued", "TrainGuardJobQueued", "resolved",
                       WatchVerdict(v.state, f"job {self.job_id} started", v.seen))  # fmt: skip
        if v.state == "silent":
            self._page("silent", "TrainGuardJobSilent", "firing", v)
        elif v.state in ("running", "finished"):
            self._page("silent", "TrainGuardJobSilent", "resolved",
                       WatchVerdict(v.state, f"job {self.job_id} heard from again", v.seen))  # fmt: skip
        if v.state == "lost":
            self._page("lost", "TrainGuardJobLost", "firing", v)
        return v

    def step_ended(self, rc: int) -> WatchVerdict:
        """The job step (every agent) has ended with exit code ``rc``: page when an agent that
        started wrote no final event."""
        self._read_events()
        seen = self.seen(self.heartbeats())
        missing = sorted(n for n in self.launched if n not in self.finished)
        if not missing:
            return WatchVerdict("finished", "every agent wrote job_finished", seen)
        v = WatchVerdict(
            "lost",
            f"the job step of {self.job_id} ended (exit {rc}) without a final event from "
            f"node(s) {', '.join(missing)}: its agents were killed or the step was cancelled",
            seen,
        )
        self._page("lost", "TrainGuardJobLost", "firing", v)
        return v

    def run_until_done(self, poll_s: float = 1.0, stop: threading.Event | None = None) -> int:
        """Watch until the job ends: 0 when it ended with its final events, 3 when lost."""
        stop = stop or threading.Event()
        while True:
            v = self.step()
            if v.state == "finished":
                return 0
            if v.state == "lost":
                return EXIT_LOST
            if stop.wait(poll_s):
                return 0


def heartbeat_plugin(ctx: AgentContext, cfg: AlertsConfig) -> HeartbeatPlugin | None:
    """The agent's heartbeat writer; never stops a launch."""
    if cfg.heartbeat_s <= 0:
        return None
    try:
        return HeartbeatPlugin(ctx, cfg.heartbeat_s)
    except Exception:
        logger.exception("heartbeat disabled: it failed to start")
        return None


__all__ += ["heartbeat_plugin"]
