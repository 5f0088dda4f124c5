"""The analytic ETTR model of one training job: two checkpoint tiers, spares, badput by cause.

The job (``JobSpec``) needs ``work_s`` seconds of training. Interruptions arrive at rate
``lam`` (``1 / mtti_s``, or ``nodes / node_mtbf_s``) during all the time the job holds its
nodes. Checkpoints: the memory tier every ``tau_m`` seconds of work, the disk tier every
``K`` memory saves (``tau_d = K tau_m``); a save blocks training for its ``stall_s`` and is
usable ``commit_s`` after its stall ends. An interruption is

- transient (probability ``1 - f``): restart in place; restore from memory (if the tier is on);
- a node loss with a spare left (``f S / (S + 1)``): swap in the spare (``swap_s``); restore
  from memory when it is replicated to a peer node, else from disk;
- a node loss with no spare (``f / (S + 1)``): the job requeues (``detect_s + requeue_s``, no
  nodes held, so no failures), gets a fresh allocation with ``S`` spares and restores from disk.

Each costs ``detect_s + [swap_s] + restart_s + restore_s`` of recovery, during which a new
failure restarts the recovery, plus the work done since the last usable checkpoint. With

- ``U`` the running time (work, stalls and work later lost), ``s`` the stall fraction;
- ``ell`` the expected running time lost per failure: for a tier with cycle ``T`` (wall), lag
  ``c`` and reset rate ``r`` the time ``u`` since the cycle start is exponential truncated to
  ``T`` (training restarts at cycle starts), ``ell = E[u] + T (floor(c / T) + P(u < c mod T))``;
- ``a = E[(1 - exp(-lam X)) / lam]`` the expected exposed recovery time per failure,

``U = W (1 + s) / (1 - lam ell)``, failures ``F = lam U / (1 - lam a)``, and the wall time is
``startup + U + F a + F pi_requeue (detect + requeue)``. ETTR = ``W / wall``. For one tier
without lag this is exactly Daly's complete model ``M e^(R/M) (e^((tau+delta)/M) - 1) W / tau``.
The simulator (``trainguard.plan.sim``) is the ground truth this is checked against.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "CAUSES",
    "Estimate",
    "JobSpec",
    "Tier",
    "best_disk_interval",
    "evaluate",
    "evaluate_counted",
    "fit_rate",
    "optimize",
    "recommend_spares",
    "sensitivity",
]

CAUSES = ("checkpoint_stall", "lost_work", "restart", "detection", "requeue", "startup", "other")
"""Badput causes, in the order reports show them."""


@dataclass(frozen=True, kw_only=True)
class Tier:
    """One checkpoint tier (seconds)."""

    interval_s: float
    """Training (work) seconds between two saves of this tier."""
    stall_s: float
    """Time training is blocked per save."""
    commit_s: float = 0.0
    """From the end of the stall until the save is usable (replication, background persist)."""
    restore_s: float = 0.0
    """Time to load it at a restart."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What the planner is asked about. Either ``mtti_s`` or ``node_mtbf_s`` sets the rate."""

    gpus: int
    gpus_per_node: int = 8
    node_mtbf_s: float | None = None
    """Mean time between failures of one node (failures of the job: nodes / node_mtbf)."""
    mtti_s: float | None = None
    """Mean time to interruption of the whole job (overrides ``node_mtbf_s``)."""
    work_s: float = 10 * 86400.0
    """Training time the job needs (seconds of steps, failure-free)."""
    step_s: float = 0.0
    """Step time; when > 0 the memory interval is a whole number of steps."""
    memory: Tier | None = None
    """Memory tier (None: disk only)."""
    disk: Tier = field(default_factory=lambda: Tier(interval_s=1800.0, stall_s=2.0))
    peer_replication: bool = True
    """The memory tier survives a node loss (replicated to a peer node)."""
    restart_s: float = 3.4
    """Process start, rendezvous and first step after a failure (restore excluded)."""
    detect_s: float = 5.0
    """Failure → noticed (hang detection, crash report)."""
    startup_s: float = 0.0
    """One-time launch → first step (and the end of the job)."""
    spares: int = 0
    swap_s: float = 30.0
    """Extra time to swap a spare node in for a lost one."""
    requeue_s: float = 600.0
    """Time in the scheduler's queue after the spares ran out (no nodes held)."""
    node_loss_fraction: float = 1.0
    """Share of interruptions that take a node out (the rest restart in place)."""
    overhead_fraction: float = 0.0
    """Other time per second of training (data loading, logging, evaluation)."""
    weibull_shape: float = 1.0
    """Node failure distribution for the simulator: 1 is exponential, < 1 infant mortality."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("gpus and gpus_per_node must be >= 1")
        if self.mtti_s is None and self.node_mtbf_s is None:
            raise ValueError("give a failure rate: mtti_s (job) or node_mtbf_s (per node)")
        for name in ("mtti_s", "node_mtbf_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 (a failure rate cannot be negative), got {v}")
        for name in ("work_s", "weibull_shape"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("step_s", "restart_s", "detect_s", "startup_s", "swap_s", "requeue_s",
                     "overhead_fraction"):  # fmt: skip
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if not 0.0 <= self.node_loss_fraction <= 1.0:
            raise ValueError(f"node_loss_fraction must be in [0, 1], got {self.node_loss_fraction}")
        for tname, tier in (("memory", self.memory), ("disk", self.disk)):
            if tier is None:
                continue
            for k, v in asdict(tier).items():
                if not (v >= 0 and math.isfinite(v)):
                    raise ValueError(f"{tname} {k} must be a finite number >= 0, got {v}")
            check_interval(tname, tier.interval_s, tier.stall_s)

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def rate(self) -> float:
        """Interruptions per second of the job."""
        if self.mtti_s is not None:
            return 1.0 / self.mtti_s
        assert self.node_mtbf_s is not None
        return self.nodes / self.node_mtbf_s

    @property
    def mtti(self) -> float:
        return 1.0 / self.rate

    def disk_every(self) -> int:
        """Memory saves per disk save (K)."""
        if self.memory is None:
            return 1
        return max(1, round(self.disk.interval_s / self.memory.interval_s))

    def with_intervals(self, memory_s: float | None, disk_s: float) -> JobSpec:
        mem = replace(self.memory, interval_s=memory_s) if self.memory and memory_s else None
        return replace(self, memory=mem or self.memory, disk=replace(self.disk, interval_s=disk_s))


def check_interval(tier: str, interval_s: float, stall_s: float) -> None:
    """An interval shorter than the tier's stall would spend more time saving than training."""
    if interval_s <= 0:
        raise ValueError(f"{tier} interval must be > 0 s, got {interval_s}")
    if interval_s < stall_s:
        raise ValueError(
            f"{tier} interval {interval_s:g} s is shorter than its checkpoint stall "
            f"{stall_s:g} s: raise the interval or lower the stall"
        )


@dataclass(slots=True)
class Estimate:
    """The model's answer for one spec and pair of intervals."""

    ettr: float
    wall_s: float
    failures: float
    badput_s: dict[str, float]
    memory_interval_s: float | None
    disk_interval_s: float

    @property
    def badput_fraction(self) -> dict[str, float]:
        return {k: v / self.wall_s for k, v in self.badput_s.items()} if self.wall_s else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ettr": self.ettr,
            "wall_s": self.wall_s,
            "expected_failures": self.failures,
            "memory_interval_s": self.memory_interval_s,
            "disk_interval_s": self.disk_interval_s,
            "badput_s": self.badput_s,
            "badput_fraction": self.badput_fraction,
        }


def failure_types(spec: JobSpec) -> list[dict[str, Any]]:
    """The three kinds of interruption: probability, exposed recovery, unexposed wait, whether
    the memory tier restores it, and how much of the exposed recovery is detection."""
    f, s = spec.node_loss_fraction, spec.spares
    mem = spec.memory is not None
    r_mem = spec.memory.restore_s if spec.memory else spec.disk.restore_s
    r_disk = spec.disk.restore_s
    d, r = spec.detect_s, spec.restart_s
    peer = mem and spec.peer_replication
    return [
        {"p": 1 - f, "x": d + r + (r_mem if mem else r_disk), "wait": 0.0, "mem": mem, "det": d},
        {
            "p": f * s / (s + 1),
            "x": d + spec.swap_s + r + (r_mem if peer else r_disk),
            "wait": 0.0,
            "mem": peer,
            "det": d,
        },
        {"p": f / (s + 1), "x": r + r_disk, "wait": d + spec.requeue_s, "mem": False, "det": 0.0},
    ]


def _expm1_over(rate: float, t: Any) -> Any:
    """(1 - exp(-rate t)) / rate, t when rate is 0."""
    if rate <= 0:
        return t
    return -np.expm1(-rate * np.asarray(t, dtype=float)) / rate


def _lost(cycle: Any, lag: float, rate: float) -> Any:
    """Expected running time lost per failure for a tier with wall cycle ``cycle``, usable
    ``lag`` after each save, training restarting at cycle starts at rate ``rate``."""
    cycle = np.asarray(cycle, dtype=float)
    q = np.floor(lag / cycle)
    rem = lag - q * cycle
    x = rate * cycle
    small = x < 1e-6
    xs = np.where(small, 1.0, x)
    eu = np.where(small, cycle / 2, cycle * (1.0 / xs - 1.0 / np.expm1(xs)))
    p_rem = np.where(small, rem / cycle, np.expm1(-rate * rem) / np.expm1(-xs))
    return eu + cycle * (q + p_rem)


def _lost_erlang(cycle: Any, lag: float, n: int, rate: float) -> Any:
    """As :func:`_lost` when the resets to the cycle start come every ``n``-th event of a
    Poisson process of rate ``rate`` (requeues every ``spares + 1`` node losses): the work lost
    is ``E[X mod T]`` with ``X ~ Gamma(n, rate)``, plus the lag."""
    if n <= 1 or rate <= 0:
        return _lost(cycle, lag, rate)
    cycle = np.asarray(cycle, dtype=float)
    if n > 8:  # requeues are rare with this many spares: the Poisson form is close enough
        return _lost(cycle, lag, rate / n)
    need = (n + 10 * math.sqrt(n) + 10) / (rate * np.min(cycle))
    if need > 200:  # many cycles per reset: X mod T is close to uniform
        return cycle / 2 + lag
    j = np.arange(1, int(math.ceil(need)) + 1)
    x = rate * cycle[..., None] * j
    tail = np.zeros_like(x)
    term = np.exp(-x)
    for i in range(n):
        tail += term
        term = term * x / (i + 1)
    return n / rate - cycle * tail.sum(axis=-1) + lag


def evaluate(
    spec: JobSpec, *, memory_s: Any = None, disk_s: Any = None, spares: int | None = None
) -> Any:
    """ETTR of ``spec`` (its own intervals, or ``memory_s`` / ``disk_s``, arrays broadcast).
    Returns an :class:`Estimate` for scalars, else an array of ETTRs (0 where the job would
    never finish)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return _evaluate(spec, memory_s, disk_s, spares)


def _evaluate(spec: JobSpec, memory_s: Any, disk_s: Any, spares: int | None) -> Any:
    if spares is not None:
        spec = replace(spec, spares=spares)
    scalar = memory_s is None and disk_s is None
    tau_d = np.asarray(spec.disk.interval_s if disk_s is None else disk_s, dtype=float)
    lam = spec.rate
    o = spec.overhead_fraction
    sd, cd = spec.disk.stall_s, spec.disk.commit_s
    if spec.memory is not None:
        tau_m = np.asarray(spec.memory.interval_s if memory_s is None else memory_s, dtype=float)
        k = np.maximum(1.0, np.round(tau_d / tau_m))
        sm, cm = spec.memory.stall_s, spec.memory.commit_s
    else:
        tau_m, k, sm, cm = tau_d, np.ones_like(tau_d), sd, cd
    cyc_m = tau_m * (1 + o) + sm
    cyc_d = k * tau_m * (1 + o) + (k - 1) * sm + sd
    s_ckpt = ((k - 1) * sm + sd) / (k * tau_m)
    s = s_ckpt + o
    types = failure_types(spec)
    p_mem = sum(t["p"] for t in types if t["mem"])
    ell_m = _lost(cyc_m, cm, lam)
    a = sum(t["p"] * _expm1_over(lam, t["x"]) for t in types)
    wait = sum(t["p"] * t["wait"] for t in types)
    in_rec = lam * a / (1 - lam * a)  # failures during recoveries per failure while running
    if spec.memory is not None and spec.peer_replication:
        # the disk tier serves requeues only: every (spares + 1)-th node loss, counted also
        # during recoveries; each loses the work since the last disk save
        n = spec.spares + 1
        ell_d = _lost_erlang(
            cyc_d, cd, n, lam * spec.node_loss_fraction * (1 + in_rec if n > 1 else 1)
        )
    else:
        ell_d = _lost(cyc_d, cd, lam * (1 - p_mem))
    # a failure during a recovery from memory that needs the disk moves the restore back
    back = p_mem * (1 - p_mem) * np.maximum(ell_d - ell_m, 0.0) * in_rec
    ell = p_mem * ell_m + (1 - p_mem) * ell_d
    w = spec.work_s
    denom = 1 - lam * (ell + back)
    feasible = denom > 0
    running = np.where(feasible, w * (1 + s) / np.where(feasible, denom, 1.0), np.inf)
    fails = lam * running / (1 - lam * a)
    wall = spec.startup_s + running + fails * (a + wait)
    ettr = np.where(feasible & np.isfinite(wall), w / wall, 0.0)
    if not scalar:
        return ettr
    det_exposed = sum(t["p"] * _expm1_over(lam, t["det"]) for t in types)
    req = types[2]["p"]
    badput = {
        "checkpoint_stall": float(running * s_ckpt / (1 + s)),
        "lost_work": float(running / (1 + s) - w),
        "restart": float(fails * (a - det_exposed)),
        "detection": float(fails * (det_exposed + req * spec.detect_s)),
        "requeue": float(fails * req * spec.requeue_s),
        "startup": spec.startup_s,
        "other": float(running * o / (1 + s)),
    }
    return Estimate(
        ettr=float(ettr),
        wall_s=float(wall),
        failures=float(fails),
        badput_s=badput,
        memory_interval_s=float(tau_m) if spec.memory is not None else None,
        disk_interval_s=float(k * tau_m) if spec.memory is not None else float(tau_d),
    )


def optimize(spec: JobSpec, *, max_disk_s: float | None = None) -> JobSpec:
    """``spec`` with the ETTR-optimal memory interval (whole steps when ``step_s`` is set) and
    disk interval (a whole number of memory intervals, at least the disk commit time: one
    persist in flight at a time), found on two nested log grids."""
    top = min(max_disk_s or math.inf, spec.work_s, 50 * spec.mtti)
    step = spec.step_s
    if spec.memory is None:
        lo = max(spec.disk.stall_s, step, 1e-3)
        grid = np.geomspace(lo, max(top, lo * 1.01), 400)
        if step:
            grid = np.unique(np.maximum(1, np.round(grid / step)) * step)
        best = float(grid[int(np.argmax(evaluate(spec, disk_s=grid)))])
        fine = np.geomspace(best / 1.05, best * 1.05, 101)
        if step:
            fine = np.unique(np.maximum(1, np.round(fine / step)) * step)
        fine = fine[fine >= spec.disk.stall_s]
        return spec.with_intervals(None, float(fine[int(np.argmax(evaluate(spec, disk_s=fine)))]))
    lo_m = max(spec.memory.stall_s, step, 1e-3)
    mem = np.geomspace(lo_m, max(top, lo_m * 1.01), 160)
    if step:
        mem = np.unique(np.maximum(1, np.round(mem / step)) * step)
    disk = np.geomspace(max(lo_m, spec.disk.stall_s), max(top, lo_m * 1.01), 160)
    m2, d2 = np.meshgrid(mem, disk, indexing="ij")
    d2 = np.maximum(1, np.round(d2 / m2)) * m2
    floor_d = max(spec.disk.stall_s, spec.disk.commit_s)  # one persist in flight at a time
    ok = d2 >= floor_d
    e = np.where(ok, evaluate(spec, memory_s=m2, disk_s=d2), -1.0)
    i, j = np.unravel_index(int(np.argmax(e)), e.shape)
    best_m, best_d = float(m2[i, j]), float(d2[i, j])
    # refine the disk multiple around the best memory interval
    mem_f = np.geomspace(best_m / 1.1, best_m * 1.1, 21)
    if step:
        mem_f = np.unique(np.maximum(1, np.round(mem_f / step)) * step)
    mem_f = mem_f[mem_f >= spec.memory.stall_s]
    k0 = best_d / best_m
    ks = np.unique(np.maximum(1, np.round(np.geomspace(max(1, k0 / 1.2), k0 * 1.2 + 1, 41))))
    m3, k3 = np.meshgrid(mem_f, ks, indexing="ij")
    d3 = m3 * k3
    e3 = np.where(d3 >= floor_d, evaluate(spec, memory_s=m3, disk_s=d3), -1.0)
    i, j = np.unravel_index(int(np.argmax(e3)), e3.shape)
    if e3[i, j] >= e.max():
        best_m, best_d = float(m3[i, j]), float(d3[i, j])
    return spec.with_intervals(best_m, best_d)


def best_disk_interval(spec: JobSpec, *, hi: float | None = None) -> float:
    """The ETTR-optimal disk interval with the memory interval held (a whole number of memory
    intervals, at least the disk commit time)."""
    floor_d = max(spec.disk.stall_s, spec.disk.commit_s, 1e-3)
    top = max(min(hi or math.inf, spec.work_s, 50 * spec.mtti), floor_d * 1.01)
    grid = np.geomspace(floor_d, top, 400)
    if spec.memory is not None:
        m = spec.memory.interval_s
        grid = np.unique(np.maximum(1, np.ceil(grid / m)) * m)
    best = float(grid[int(np.argmax(evaluate(spec, disk_s=grid)))])
    fine = np.geomspace(max(floor_d, best / 1.03), best * 1.03, 61)
    if spec.memory is not None:
        fine = np.unique(
            np.maximum(1, np.ceil(fine / spec.memory.interval_s)) * spec.memory.interval_s
        )
    return float(fine[int(np.argmax(evaluate(spec, disk_s=fine)))])


def recommend_spares(spec: JobSpec, *, max_spares: int | None = None) -> dict[str, Any]:
    """The spare count that maximises goodput per allocated node, ETTR x nodes / (nodes + S)
    (spares idle while they wait), with the intervals of ``spec``."""
    hi = max_spares if max_spares is not None else max(8, min(256, spec.nodes // 4))
    rows = []
    for s in range(hi + 1):
        e = evaluate(spec, spares=s)
        rows.append((s, e.ettr, e.ettr * spec.nodes / (spec.nodes + s)))
    best = max(rows, key=lambda r: r[2])
    return {
        "spares": best[0],
        "ettr": best[1],
        "goodput_per_allocated_node": best[2],
        "table": [{"spares": s, "ettr": e, "per_allocated_node": g} for s, e, g in rows],
    }


SENSITIVE = (
    ("mtti", "MTTI"),
    ("restart_s", "restart"),
    ("detect_s", "detection"),
    ("memory.stall_s", "memory stall"),
    ("memory.restore_s", "memory restore"),
    ("disk.stall_s", "disk stall"),
    ("disk.commit_s", "disk commit"),
    ("disk.restore_s", "disk restore"),
    ("swap_s", "spare swap"),
    ("requeue_s", "requeue"),
    ("node_loss_fraction", "node-loss share"),
)


def _scaled(spec: JobSpec, key: str, factor: float) -> JobSpec | None:
    if key == "mtti":
        return replace(spec, mtti_s=spec.mtti * factor, node_mtbf_s=None)
    if "." in key:
        tier_name, attr = key.split(".")
        tier = getattr(spec, tier_name)
        if tier is None:
            return None
        new = replace(tier, **{attr: getattr(tier, attr) * factor})
        if new.stall_s > new.interval_s:
            return None
        return replace(spec, **{tier_name: new})
    value = getattr(spec, key) * factor
    if key == "node_loss_fraction":
        value = min(1.0, value)
    return replace(spec, **{key: value})


def sensitivity(spec: JobSpec) -> list[dict[str, Any]]:
    """ETTR when one input is halved or doubled, the intervals held at ``spec``'s."""
    base = evaluate(spec).ettr
    rows = []
    for key, label in SENSITIVE:
        lo, hi = _scaled(spec, key, 0.5), _scaled(spec, key, 2.0)
        if lo is None or hi is None:
            continue
        rows.append(
            {
                "input": label,
                "key": key,
                "ettr_half": evaluate(lo).ettr,
                "ettr": base,
                "ettr_double": evaluate(hi).ettr,
            }
        )
    return rows


def evaluate_counted(spec: JobSpec, failures: float) -> Estimate:
    """The model's accounting for a job that had exactly ``failures`` interruptions, none of
    them during a recovery: how a finished run is explained (its rate is not needed; the work
    lost per failure is the expectation for failures spread evenly over the cycles)."""
    o = spec.overhead_fraction
    if spec.memory is not None:
        tau_m, sm, cm = spec.memory.interval_s, spec.memory.stall_s, spec.memory.commit_s
        k = spec.disk_every()
    else:
        tau_m, sm, cm, k = spec.disk.interval_s, spec.disk.stall_s, spec.disk.commit_s, 1
    sd, cd = spec.disk.stall_s, spec.disk.commit_s
    s_ckpt = ((k - 1) * sm + sd) / (k * tau_m)
    s = s_ckpt + o
    types = failure_types(spec)
    p_mem = sum(t["p"] for t in types if t["mem"])
    ell = p_mem * float(_lost(tau_m * (1 + o) + sm, cm, 0.0)) + (1 - p_mem) * float(
        _lost(k * tau_m * (1 + o) + (k - 1) * sm + sd, cd, 0.0)
    )
    w = spec.work_s
    running = w * (1 + s) + failures * ell
    req = types[2]["p"]
    badput = {
        "checkpoint_stall": running * s_ckpt / (1 + s),
        "lost_work": running / (1 + s) - w,
        "restart": failures * sum(t["p"] * (t["x"] - t["det"]) for t in types),
        "detection": failures * (sum(t["p"] * t["det"] for t in types) + req * spec.detect_s),
        "requeue": failures * req * spec.requeue_s,
        "startup": spec.startup_s,
        "other": running * o / (1 + s),
    }
    wall = w + sum(badput.values())
    return Estimate(
        ettr=w / wall,
        wall_s=wall,
        failures=failures,
        badput_s=badput,
        memory_interval_s=tau_m if spec.memory is not None else None,
        disk_interval_s=k * tau_m,
    )


def fit_rate(spec: JobSpec, failures: float) -> JobSpec:
    """``spec`` with the interruption rate at which the model expects ``failures``
    interruptions over the job (method of moments; bisection on the log of the rate)."""
    if failures <= 0:
        return replace(spec, mtti_s=1e15, node_mtbf_s=None)
    lo, hi = -40.0, 10.0  # log rate per second
    for _ in range(100):
        mid = (lo + hi) / 2
        e = evaluate(replace(spec, mtti_s=math.exp(-mid), node_mtbf_s=None))
        if e.ettr > 0 and e.failures < failures:
            lo = mid
        else:
            hi = mid
    return replace(spec, mtti_s=math.exp(-lo), node_mtbf_s=None)
