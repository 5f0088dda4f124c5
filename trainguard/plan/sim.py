"""Monte Carlo of the job the model describes: the ground truth the model is checked against.

Many independent copies of one job run side by side, vectorised over copies; each loop
iteration advances every copy by one event (a failure, the end of a recovery, the end of the
job). Node failures are generated up front per copy as absolute wall times:

- exponential: a Poisson process at the job's rate;
- Weibull (``weibull_shape != 1``): every node slot is a renewal process with Weibull gaps of
  mean ``node_mtbf_s``, started in equilibrium (the first failure of each slot follows the
  stationary residual life: ``(x / eta)^k ~ Gamma(1 / k)``); a failed node is replaced by a fresh
  one (age 0).

Training time is followed in "running coordinates": from a restored save (index ``j0`` of
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
    mean = spec.mtti_s * spec.nodes if spec.mtti_s is not None else spec.node_mtbf_s
    assert mean is not None
    times, owners = _weibull_stream(rng, jobs, spec.nodes, mean, spec.weibull_shape, horizon)
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


def _run(spec: JobSpec, rng: np.random.Generator, jobs: int, horizon: float) -> SimResult | None:
    cyc = _Cycles(spec)
    stream = failure_stream(spec, rng, jobs, horizon)
    width = stream.shape[1]
    idx = np.arange(jobs)
    work_total = spec.work_s
    f, nspare = spec.node_loss_fraction, spec.spares
    has_mem = spec.memory is not None
    peer = has_mem and spec.peer_replication
    r_mem = spec.memory.restore_s if spec.memory else spec.disk.restore_s
    r_disk = spec.disk.restore_s

    t = np.full(jobs, spec.startup_s)
    ptr = (stream < t[:, None]).sum(axis=1)  # no failures in start-up
    phase = np.full(jobs, RUN)
    j0 = np.zeros(jobs, dtype=np.int64)  # save index the running segment started from
    t_seg = t.copy()
    mem_ok = np.zeros(jobs, dtype=np.int64)
    disk_ok = np.zeros(jobs, dtype=np.int64)
    target = np.zeros(jobs, dtype=np.int64)
    target_mem = np.zeros(jobs, dtype=bool)
    rec_start = np.zeros(jobs)
    rec_end = np.zeros(jobs)
    rec_det = np.zeros(jobs)
    spares = np.full(jobs, nspare)
    acc = {c: np.zeros(jobs) for c in ("running", "lost", "detection", "restart", "requeue")}
    nfail = np.zeros(jobs)
    t_fin = t_seg + cyc.wall_to(j0, work_total)  # when each copy finishes if nothing fails

    while True:
        live = phase != DONE
        if not live.any():
            break
        nf = stream[idx, np.minimum(ptr, width - 1)]
        # -- recovering copies: done, or fail at nf --------------------------------------------
        rec = phase == REC
        done = rec & (nf >= rec_end)
        acc["detection"][done] += rec_det[done]
        acc["restart"][done] += (rec_end - rec_start - rec_det)[done]
        t[done] = rec_end[done]
        phase[done] = RUN
        j0[done] = target[done]
        mem_ok[done] = target[done]
        t_seg[done] = t[done]
        if done.any():
            t_fin[done] = t_seg[done] + cyc.wall_to(j0[done], work_total)
        cf = rec & ~done
        # -- running copies: finish, or fail at nf ---------------------------------------------
        run = phase == RUN
        fin = run & (nf >= t_fin)
        acc["running"][fin] += (t_fin - t)[fin]
        t[fin] = t_fin[fin]
        phase[fin] = DONE
        rf = run & ~fin
        fail = rf | cf
        if not fail.any():
            continue
        fi = np.nonzero(fail)[0]  # the rest works on the failing copies only
        tf = nf[fi]
        nfail[fi] += 1
        ptr[fi] += 1
        is_run = rf[fi]
        # failures while running: how far did the work get, which saves are usable
        work_f = np.zeros(fi.size)
        if is_run.any():
            r = fi[is_run]
            jr = j0[r]
            y = tf[is_run] - t_seg[r]
            _, work_f[is_run] = cyc.advance(jr, y)
            i_m, _ = cyc.advance(jr, np.maximum(y - cyc.cm, 0.0))
            m_new = np.where(y >= cyc.cm, jr + i_m, jr)
            i_d, _ = cyc.advance(jr, np.maximum(y - cyc.cd, 0.0))
            d_last = ((jr + i_d) // cyc.k) * cyc.k
            d_new = np.where((y >= cyc.cd) & (d_last > jr), d_last, disk_ok[r])
            mem_ok[r] = np.maximum(mem_ok[r], m_new)
            disk_ok[r] = np.maximum(disk_ok[r], d_new)
            acc["running"][r] += tf[is_run] - t[r]
        # interrupted recoveries: account the part done
        is_rec = ~is_run
        if is_rec.any():
            c = fi[is_rec]
            e = tf[is_rec] - rec_start[c]
            det = np.minimum(e, rec_det[c])
            acc["detection"][c] += det
            acc["restart"][c] += e - det
        # kind of failure
        node = rng.random(fi.size) < f
        sp = spares[fi]
        swap = node & (sp > 0)
        requeue = node & ~swap
        spares[fi] = np.where(swap, sp - 1, np.where(requeue, nspare, sp))
        mem_possible = np.where(node, peer & ~requeue, has_mem)
        # restore point
        mo, do, tg = mem_ok[fi], disk_ok[fi], target[fi]
        new_target = np.where(mem_possible, np.maximum(mo, do), do)
        downgrade = is_rec & ~mem_possible & (tg > do)
        acc["lost"][fi] += np.where(is_run, work_f - new_target * cyc.tau, 0.0) + np.where(
            downgrade, (tg - do) * cyc.tau, 0.0
        )
        target[fi] = np.where(is_run, new_target, np.where(downgrade, do, tg))
        tm = np.where(is_run, mem_possible, target_mem[fi] & mem_possible)
        target_mem[fi] = tm
        mem_ok[fi] = np.where(mem_possible, mo, do)
        # the recovery
        restore = np.where(tm & has_mem, r_mem, r_disk)
        t_start = tf.copy()
        if requeue.any():
            q = fi[requeue]
            t_start[requeue] = tf[requeue] + spec.detect_s + spec.requeue_s
            acc["detection"][q] += spec.detect_s
            acc["requeue"][q] += spec.requeue_s
            # the job holds no nodes while it waits: failures in that window do not hit it
            tq = t_start[requeue]
            late = stream[q, np.minimum(ptr[q], width - 1)] < tq
            while late.any():
                ptr[q] += late
                late &= stream[q, np.minimum(ptr[q], width - 1)] < tq
        det_len = np.where(requeue, 0.0, spec.detect_s)
        x = det_len + np.where(swap, spec.swap_s, 0.0) + spec.restart_s + restore
        rec_start[fi] = t_start
        rec_det[fi] = det_len
        rec_end[fi] = t_start + x
        t[fi] = tf
        phase[fi] = REC

    if (t > horizon).any():
        return None
    wall = t
    work_done = work_total + acc["lost"]
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
    ettr = work_total * jobs / total_wall
    # ratio estimator's standard error (delta method over copies)
    per = work_total / wall
    stderr = float(np.std(per, ddof=1) / math.sqrt(jobs)) if jobs > 1 else float("nan")
    return SimResult(
        ettr=ettr,
        ettr_stderr=stderr,
        jobs=jobs,
        job_days=total_wall / 86400.0,
        failures_per_job=float(nfail.mean()),
        badput_fraction={c: float(by_cause[c].sum()) / total_wall for c in CAUSES},
    )
