"""Monte Carlo of the job the model describes: the ground truth the model is checked against.

Many independent copies of one job run side by side, vectorised over copies; each loop
iteration advances every copy by one event (a failure, the end of a recovery, the end of the
job). Node failures are generated up front per copy as absolute wall times:

- exponential: a Poisson process at the job's rate;
- Weibull (``weibull_shape != 1``): every node slot is a renewal process with Weibull gaps of
  mean ``node_mtbf_s``, started in equilibrium (the first failure of each slot follows the
  stationary residual life: ``(x / eta)^k ~ Gamma(1 / k)``); a failed node is replaced by a fresh
  one (age 0).

Training time is followed in "running coordinates": from a restored save (index ``seg_save`` of
memory saves; every ``K``-th is also a disk save) memory cycles of ``tau_m (1 + overhead)``
work plus the stall repeat. A save is usable ``commit_s`` after its stall ends; an in-flight
save dies with a failure. Failures follow the model's rules (transient / swap a spare /
requeue with fresh spares), failures during a recovery restart it (not during a requeue's wait,
when the job holds no nodes), and a later failure that needs the disk tier moves the restore
point back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainguard.plan.model import CAUSES, JobSpec, evaluate

__all__ = ["SimResult", "failure_stream", "simulate"]


@dataclass(slots=True)
class SimResult:
    ettr: float
    ettr_stderr: float
    jobs: int
    job_days: float
    failures_per_job: float
    badput_fraction: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {
            "ettr": self.ettr,
            "ettr_stderr": self.ettr_stderr,
            "jobs": self.jobs,
            "job_days": self.job_days,
            "failures_per_job": self.failures_per_job,
            "badput_fraction": self.badput_fraction,
        }


def _gammainc_lower(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) (series; x is small here)."""
    if x <= 0:
        return 0.0
    if x > a + 30:
        return 1.0
    term = 1.0 / a
    total = term
    n = 1
    while n < 10_000:
        term *= x / (a + n)
        total += term
        if term < total * 1e-15:
            break
        n += 1
    return min(1.0, math.exp(-x + a * math.log(x) - math.lgamma(a)) * total)


def _weibull_stream(
    rng: np.random.Generator, jobs: int, nodes: int, mean: float, shape: float, horizon: float
) -> tuple[np.ndarray, np.ndarray]:
    eta = mean / math.gamma(1 + 1 / shape)
    a = 1 / shape
    b = (horizon / eta) ** shape
    p_first = _gammainc_lower(a, b)  # P(first failure of a slot < horizon), equilibrium start
    counts = rng.binomial(nodes, p_first, size=jobs)
    total = int(counts.sum())
    job_of = np.repeat(np.arange(jobs), counts)
    # Gamma(a) truncated to [0, b]: power-law proposal y = b U^(1/a), accept with exp(-y)
    ys = np.empty(0)
    while ys.size < total:
        n = int((total - ys.size) * 1.2 * math.exp(min(b, 30))) + 16
        y = b * rng.random(n) ** (1 / a)
        ys = np.concatenate([ys, y[rng.random(n) < np.exp(-y)]])
    t = eta * ys[:total] ** (1 / shape)
    times, owners = [t], [job_of]
    while t.size:  # renewals: a fresh node in the slot
        t = t + eta * rng.weibull(shape, t.size)
        keep = t < horizon
        t, job_of = t[keep], job_of[keep]
        times.append(t)
        owners.append(job_of)
    return np.concatenate(times), np.concatenate(owners)


def failure_stream(
    spec: JobSpec, rng: np.random.Generator, jobs: int, horizon: float
) -> np.ndarray:
    """Sorted failure times per job, shape (jobs, n + 1), padded with +inf."""
    if spec.weibull_shape == 1.0:
        # a Poisson process per job: running sums of exponential gaps, cut at the horizon
        mean = spec.rate * horizon
        width = int(mean + 8 * math.sqrt(mean) + 16)
        out = np.cumsum(rng.exponential(1.0 / spec.rate, size=(jobs, width)), axis=1)
        while (out[:, -1] < horizon).any():  # a row ran out of gaps: extend every row
            more = np.cumsum(rng.exponential(1.0 / spec.rate, size=(jobs, width)), axis=1)
            out = np.concatenate([out, out[:, -1:] + more], axis=1)
        out[out >= horizon] = np.inf
        last = int(np.isfinite(out).sum(axis=1).max(initial=0))
        return np.concatenate([out[:, :last], np.full((jobs, 1), np.inf)], axis=1)
    node_mean = spec.mtti_s * spec.nodes if spec.mtti_s is not None else spec.node_mtbf_s
    assert node_mean is not None
    times, owners = _weibull_stream(rng, jobs, spec.nodes, node_mean, spec.weibull_shape, horizon)
    order = np.argsort(owners * (2.0 * horizon) + times, kind="stable")
    times, owners = times[order], owners[order]
    counts = np.bincount(owners, minlength=jobs)
    width = int(counts.max(initial=0)) + 1
    out = np.full((jobs, width), np.inf)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    col = np.arange(times.size) - np.repeat(starts, counts)
    out[owners, col] = times
    return out


class _Cycles:
    """Running coordinates: wall time from a restored save to work positions and saves."""

    def __init__(self, spec: JobSpec) -> None:
        o = spec.overhead_fraction
        if spec.memory is not None:
            self.tau = spec.memory.interval_s
            self.k = spec.disk_every()
            self.sm, self.cm = spec.memory.stall_s, spec.memory.commit_s
        else:
            self.tau, self.k = spec.disk.interval_s, 1
            self.sm, self.cm = spec.disk.stall_s, spec.disk.commit_s
        self.sd, self.cd = spec.disk.stall_s, spec.disk.commit_s
        self.o = o
        self.tw = self.tau * (1 + o)
        self.dwall = self.k * self.tw + (self.k - 1) * self.sm + self.sd

    def advance(self, j0: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Saves completed and work done ``y`` (wall, >= 0) after resuming at save ``j0``."""
        k, tw, sm = self.k, self.tw, self.sm
        ph = j0 % k
        head = (k - ph) * tw + (k - ph - 1) * sm + self.sd
        in_head = y < head
        i_h = np.minimum(np.floor(y / (tw + sm)), k - ph - 1)
        r_h = y - i_h * (tw + sm)
        y2 = np.maximum(y - head, 0.0)
        nd = np.floor(y2 / self.dwall)
        r = y2 - nd * self.dwall
        i_m = np.minimum(np.floor(r / (tw + sm)), k - 1)
        r_t = r - i_m * (tw + sm)
        i = np.where(in_head, i_h, (k - ph) + nd * k + i_m).astype(np.int64)
        r2 = np.where(in_head, r_h, r_t)
        work = (j0 + i) * self.tau + np.minimum(r2 / (1 + self.o), self.tau)
        return i, work

    def wall_to(self, j0: np.ndarray, target: float) -> np.ndarray:
        """Wall time from resuming at save ``j0`` until the work reaches ``target``."""
        n = np.maximum(np.ceil((target - j0 * self.tau) / self.tau) - 1, 0).astype(np.int64)
        rem = target - (j0 + n) * self.tau
        disk = (j0 + n) // self.k - j0 // self.k
        return n * self.tw + (n - disk) * self.sm + disk * self.sd + rem * (1 + self.o)


def simulate(
    spec: JobSpec,
    *,
    job_days: float = 10_000.0,
    jobs: int | None = None,
    seed: int = 0,
) -> SimResult:
    """Run copies of ``spec``'s job until their wall time adds up to ``job_days`` (or ``jobs``
    copies); ETTR is total work / total wall time."""
    est = evaluate(spec)
    if est.ettr <= 0:
        raise ValueError("the model says this job never finishes (failures outpace progress)")
    if jobs is None:
        jobs = max(4, math.ceil(job_days * 86400.0 / est.wall_s))
    horizon = est.wall_s * 2.5 + 20 * (spec.requeue_s + spec.restart_s + spec.detect_s) + 60
    rng = np.random.default_rng(seed)
    for _ in range(6):
        res = _run(spec, rng, jobs, horizon)
        if res is not None:
            return res
        horizon *= 2
    raise RuntimeError("simulated jobs kept outrunning the failure horizon")


RUN, REC, DONE = 0, 1, 2


class _Copies:
    """``jobs`` simulated copies of one job, side by side: one array entry per copy.

    A copy is running (``RUN``: from save ``seg_save``, resumed at wall time ``seg_t0``, done
    at ``t_done`` unless a failure comes first), recovering (``REC``: detection, then restart
    and restore, from ``rec_start`` to ``rec_end``, resuming from save ``target``) or done.
    ``mem_ok`` / ``disk_ok`` are the newest usable saves on each tier; ``next_fail`` points
    into the copy's row of the failure stream.
    """

    def __init__(self, spec: JobSpec, rng: np.random.Generator, jobs: int, horizon: float) -> None:
        self.spec, self.rng, self.jobs = spec, rng, jobs
        self.cyc = _Cycles(spec)
        self.stream = failure_stream(spec, rng, jobs, horizon)
        self.width = self.stream.shape[1]
        self.idx = np.arange(jobs)
        self.has_mem = spec.memory is not None
        self.peer = self.has_mem and spec.peer_replication
        self.restore_mem_s = spec.memory.restore_s if spec.memory else spec.disk.restore_s
        self.restore_disk_s = spec.disk.restore_s

        self.t = np.full(jobs, spec.startup_s)  # each copy's clock
        self.next_fail = (self.stream < self.t[:, None]).sum(axis=1)  # none in start-up
        self.phase = np.full(jobs, RUN)
        self.seg_save = np.zeros(jobs, dtype=np.int64)  # save the running segment started from
        self.seg_t0 = self.t.copy()
        self.mem_ok = np.zeros(jobs, dtype=np.int64)
        self.disk_ok = np.zeros(jobs, dtype=np.int64)
        self.target = np.zeros(jobs, dtype=np.int64)  # the save a recovery restores
        self.target_mem = np.zeros(jobs, dtype=bool)  # ... from the memory tier
        self.rec_start = np.zeros(jobs)
        self.rec_end = np.zeros(jobs)
        self.rec_detect = np.zeros(jobs)
        self.spares = np.full(jobs, spec.spares)
        self.acc = {
            c: np.zeros(jobs) for c in ("running", "lost", "detection", "restart", "requeue")
        }
        self.failures = np.zeros(jobs)
        # when each copy finishes if nothing fails
        self.t_done = self.seg_t0 + self.cyc.wall_to(self.seg_save, spec.work_s)

    def _failure_at(self, copies: np.ndarray | slice) -> np.ndarray:
        """The next failure time of ``copies`` (+inf past the last)."""
        idx = self.idx[copies]
        return self.stream[idx, np.minimum(self.next_fail[copies], self.width - 1)]

    def advance(self) -> bool:
        """Every live copy to its next event; False once all are done."""
        if not (self.phase != DONE).any():
            return False
        t_next = self._failure_at(slice(None))
        rec_failed = self._end_recoveries(t_next)
        run_failed = self._end_runs(t_next)
        failing = np.nonzero(run_failed | rec_failed)[0]
        if failing.size:
            self._fail(failing, t_next[failing], run_failed[failing])
        return True

    def _end_recoveries(self, t_next: np.ndarray) -> np.ndarray:
        """Recoveries that end before the next failure resume running; the mask of the ones
        a failure interrupts."""
        rec = self.phase == REC
        done = rec & (t_next >= self.rec_end)
        self.acc["detection"][done] += self.rec_detect[done]
        self.acc["restart"][done] += (self.rec_end - self.rec_start - self.rec_detect)[done]
        self.t[done] = self.rec_end[done]
        self.phase[done] = RUN
        self.seg_save[done] = self.target[done]
        self.mem_ok[done] = self.target[done]
        self.seg_t0[done] = self.t[done]
        if done.any():
            self.t_done[done] = self.seg_t0[done] + self.cyc.wall_to(
                self.seg_save[done], self.spec.work_s
            )
        return rec & ~done

    def _end_runs(self, t_next: np.ndarray) -> np.ndarray:
        """Runs that reach the end of the work before the next failure are done; the mask of
        the ones a failure interrupts."""
        run = self.phase == RUN
        fin = run & (t_next >= self.t_done)
        self.acc["running"][fin] += (self.t_done - self.t)[fin]
        self.t[fin] = self.t_done[fin]
        self.phase[fin] = DONE
        return run & ~fin

    def _fail(self, failing: np.ndarray, t_fail: np.ndarray, was_running: np.ndarray) -> None:
        """A failure at ``t_fail`` hits the copies ``failing`` (running or recovering)."""
        spec = self.spec
        self.failures[failing] += 1
        self.next_fail[failing] += 1
        work_at_fail = self._stop_runs(failing[was_running], t_fail[was_running])
        work = np.zeros(failing.size)
        work[was_running] = work_at_fail
        self._stop_recoveries(failing[~was_running], t_fail[~was_running])
        # kind of failure: transient, a node lost and a spare swapped in, or a requeue
        node = self.rng.random(failing.size) < spec.node_loss_fraction
        spares = self.spares[failing]
        swap = node & (spares > 0)
        requeue = node & ~swap
        self.spares[failing] = np.where(swap, spares - 1, np.where(requeue, spec.spares, spares))
        mem_possible = np.where(node, self.peer & ~requeue, self.has_mem)
        from_mem = self._restore_point(failing, was_running, work, mem_possible)
        self._start_recoveries(failing, t_fail, from_mem, swap, requeue)

    def _stop_runs(self, copies: np.ndarray, t_fail: np.ndarray) -> np.ndarray:
        """Running copies failing at ``t_fail``: how far the work got (returned), and which
        saves had committed on each tier by then."""
        cyc = self.cyc
        if not copies.size:
            return np.zeros(0)
        start = self.seg_save[copies]
        y = t_fail - self.seg_t0[copies]  # wall time run since the restore
        _, work = cyc.advance(start, y)
        saves_m, _ = cyc.advance(start, np.maximum(y - cyc.cm, 0.0))
        mem_new = np.where(y >= cyc.cm, start + saves_m, start)
        saves_d, _ = cyc.advance(start, np.maximum(y - cyc.cd, 0.0))
        disk_last = ((start + saves_d) // cyc.k) * cyc.k
        disk_new = np.where((y >= cyc.cd) & (disk_last > start), disk_last, self.disk_ok[copies])
        self.mem_ok[copies] = np.maximum(self.mem_ok[copies], mem_new)
        self.disk_ok[copies] = np.maximum(self.disk_ok[copies], disk_new)
        self.acc["running"][copies] += t_fail - self.t[copies]
        return work

    def _stop_recoveries(self, copies: np.ndarray, t_fail: np.ndarray) -> None:
        """Recoveries a failure interrupts at ``t_fail``: account the part done."""
        if not copies.size:
            return
        elapsed = t_fail - self.rec_start[copies]
        detect = np.minimum(elapsed, self.rec_detect[copies])
        self.acc["detection"][copies] += detect
        self.acc["restart"][copies] += elapsed - detect

    def _restore_point(
        self,
        failing: np.ndarray,
        was_running: np.ndarray,
        work: np.ndarray,
        mem_possible: np.ndarray,
    ) -> np.ndarray:
        """The save each failing copy will restore, the work lost to it; whether it comes
        from the memory tier (returned)."""
        tau = self.cyc.tau
        mem, disk, target = self.mem_ok[failing], self.disk_ok[failing], self.target[failing]
        new_target = np.where(mem_possible, np.maximum(mem, disk), disk)
        # a recovery that needed the memory tier, now gone: back to the disk save
        downgrade = ~was_running & ~mem_possible & (target > disk)
        self.acc["lost"][failing] += np.where(was_running, work - new_target * tau, 0.0) + np.where(
            downgrade, (target - disk) * tau, 0.0
        )
        self.target[failing] = np.where(was_running, new_target, np.where(downgrade, disk, target))
        from_mem = np.where(was_running, mem_possible, self.target_mem[failing] & mem_possible)
        self.target_mem[failing] = from_mem
        self.mem_ok[failing] = np.where(mem_possible, mem, disk)
        return from_mem

    def _start_recoveries(
        self,
        failing: np.ndarray,
        t_fail: np.ndarray,
        from_mem: np.ndarray,
        swap: np.ndarray,
        requeue: np.ndarray,
    ) -> None:
        """Each failing copy starts recovering: detection (none for a requeue, which waits
        for its allocation first), a spare swapped in, restart, restore."""
        spec = self.spec
        restore = np.where(from_mem & self.has_mem, self.restore_mem_s, self.restore_disk_s)
        t_start = t_fail.copy()
        if requeue.any():
            queued = failing[requeue]
            t_start[requeue] = t_fail[requeue] + spec.detect_s + spec.requeue_s
            self.acc["detection"][queued] += spec.detect_s
            self.acc["requeue"][queued] += spec.requeue_s
            # the job holds no nodes while it waits: failures in that window do not hit it
            t_back = t_start[requeue]
            late = self._failure_at(queued) < t_back
            while late.any():
                self.next_fail[queued] += late
                late &= self._failure_at(queued) < t_back
        detect = np.where(requeue, 0.0, spec.detect_s)
        length = detect + np.where(swap, spec.swap_s, 0.0) + spec.restart_s + restore
        self.rec_start[failing] = t_start
        self.rec_detect[failing] = detect
        self.rec_end[failing] = t_start + length
        self.t[failing] = t_fail
        self.phase[failing] = REC

    def result(self, horizon: float) -> SimResult | None:
        """ETTR and badput by cause over the copies; None if a copy ran past ``horizon``
        (the failure stream would have ended early)."""
        spec, jobs, acc = self.spec, self.jobs, self.acc
        if (self.t > horizon).any():
            return None
        wall = self.t
        work_done = spec.work_s + acc["lost"]
        stall_other = acc["running"] - work_done
        other = work_done * spec.overhead_fraction
        by_cause = {
            "checkpoint_stall": stall_other - other,
            "lost_work": acc["lost"],
            "restart": acc["restart"],
            "detection": acc["detection"],
            "requeue": acc["requeue"],
            "startup": np.full(jobs, spec.startup_s),
            "other": other,
        }
        total_wall = float(wall.sum())
        ettr = spec.work_s * jobs / total_wall
        # ratio estimator's standard error (delta method over copies)
        per = spec.work_s / wall
        stderr = float(np.std(per, ddof=1) / math.sqrt(jobs)) if jobs > 1 else float("nan")
        return SimResult(
            ettr=ettr,
            ettr_stderr=stderr,
            jobs=jobs,
            job_days=total_wall / 86400.0,
            failures_per_job=float(self.failures.mean()),
            badput_fraction={c: float(by_cause[c].sum()) / total_wall for c in CAUSES},
        )


def _run(spec: JobSpec, rng: np.random.Generator, jobs: int, horizon: float) -> SimResult | None:
    """One simulation of ``jobs`` copies up to ``horizon``; None if that was too short."""
    copies = _Copies(spec, rng, jobs, horizon)
    while copies.advance():
        pass
    return copies.result(horizon)
