"""The metric contract: every metric trainguard emits, with unit, kind and description.

Telemetry, the Prometheus endpoint, dashboards, alert rules and the HTML report all read these
names from here. Names follow OpenTelemetry conventions (dotted, units as metadata); the
Prometheus name is derived by :func:`prometheus_name` (dots → underscores, unit suffix,
``_total`` for counters), as the OpenTelemetry→Prometheus compatibility spec does.

This module imports nothing heavy and is safe to import anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from trainguard.core.contracts.actions import Cause
from trainguard.core.contracts.engine import REPLICA_STATES

__all__ = [
    "METRICS",
    "MetricSpec",
    "by_name",
    "prometheus_name",
]

Kind = Literal["counter", "gauge", "histogram"]

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-/]{0,254}$")  # the OTel instrument-name rule


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric of the contract."""

    name: str
    """OpenTelemetry instrument name, e.g. ``trainguard.train.throughput``."""
    unit: str
    """UCUM unit as OpenTelemetry writes it: ``s``, ``By``, ``1``, ``{token}/s``..."""
    kind: Kind
    description: str
    attributes: tuple[str, ...] = ()
    """Attribute (label) keys every point carries."""
    log_keys: tuple[str, ...] = ()
    """Keys of ``tg.log(...)`` records that feed this metric (first match wins)."""

    @property
    def prometheus(self) -> str:
        return prometheus_name(self)


_UNIT_WORDS = {
    "s": "seconds",
    "ms": "milliseconds",
    "By": "bytes",
    "1": "ratio",
    "%": "percent",
}


def _unit_suffix(unit: str) -> str:
    unit = re.sub(r"\{[^}]*\}", "", unit)  # annotations like {token} are dropped
    if not unit:
        return ""
    per = ""
    if "/" in unit:
        unit, _, denom = unit.partition("/")
        per = "per_" + _UNIT_WORDS.get(denom, denom).rstrip("s") if denom else ""
        if denom == "s":
            per = "per_second"
    word = _UNIT_WORDS.get(unit, unit) if unit else ""
    return "_".join(p for p in (word, per) if p)


def prometheus_name(spec: MetricSpec) -> str:
    """``trainguard.train.step.duration`` (s, histogram) → ``trainguard_train_step_duration_seconds``."""
    base = re.sub(r"[^A-Za-z0-9_]", "_", spec.name)
    suffix = _unit_suffix(spec.unit)
    if suffix and spec.kind == "gauge" and suffix == "ratio" and base.endswith("_ratio"):
        suffix = ""
    if suffix and not base.endswith("_" + suffix):
        base = f"{base}_{suffix}"
    if spec.kind == "counter":
        base += "_total"
    return base


HUNG_MIN_HOLD_S = 30.0
"""``trainguard.job.hung`` stays 1 at least this long after a hang verdict, even when a step
completes sooner: a warm restart can recover in under a second, between two scrapes, and a
Prometheus scraping every 15 s must still see the hang (the alert then resolves)."""

_R = ("rank", "node")
_RL = "reinforcement learning: "

METRICS: tuple[MetricSpec, ...] = (
    # -- training progress and speed -------------------------------------------------------------
    MetricSpec(
        name="trainguard.train.step.duration",
        unit="s",
        kind="histogram",
        description="Wall time of one training step on one rank.",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.train.step",
        unit="{step}",
        kind="gauge",
        description="Number of the last completed step.",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.train.throughput",
        unit="{token}/s",
        kind="gauge",
        description="Tokens processed per second by one device (rank).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.train.sample_throughput",
        unit="{sample}/s",
        kind="gauge",
        description="Samples processed per second by one device (rank).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.job.throughput",
        unit="{token}/s",
        kind="gauge",
        description="Tokens per second of the whole job (rank 0's rate times the world size).",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.job.sample_throughput",
        unit="{sample}/s",
        kind="gauge",
        description="Samples per second of the whole job (rank 0's rate times the world size).",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.train.flops",
        unit="{flop}/s",
        kind="gauge",
        description="Achieved FLOP/s of one device (FLOPs per step / step time).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.train.mfu",
        unit="1",
        kind="gauge",
        description="Model FLOPs utilisation of one device: achieved FLOP/s / peak FLOP/s "
        "(omitted when the device's peak is unknown).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.train.loss",
        unit="{loss}",
        kind="gauge",
        description="Training loss.",
        attributes=_R,
        log_keys=("loss",),
    ),
    MetricSpec(
        name="trainguard.train.grad_norm",
        unit="{norm}",
        kind="gauge",
        description="Gradient norm before clipping.",
        attributes=_R,
        log_keys=("grad_norm",),
    ),
    MetricSpec(
        name="trainguard.train.lr",
        unit="{lr}",
        kind="gauge",
        description="Learning rate.",
        attributes=_R,
        log_keys=("lr", "learning_rate"),
    ),
    MetricSpec(
        name="trainguard.gpu.memory.used",
        unit="By",
        kind="gauge",
        description="Device memory allocated by the training process.",
        attributes=_R,
        log_keys=("gpu_memory_bytes",),
    ),
    MetricSpec(
        name="trainguard.gpu.memory.peak",
        unit="By",
        kind="gauge",
        description="Peak device memory allocated by the training process.",
        attributes=_R,
        log_keys=("gpu_memory_peak_bytes",),
    ),
    # -- reinforcement learning --------------------------------------------------------------
    MetricSpec(
        name="trainguard.rl.reward.mean",
        unit="{reward}",
        kind="gauge",
        description=_RL + "mean reward of the step's rollouts.",
        attributes=_R,
        log_keys=("reward", "reward_mean"),
    ),
    MetricSpec(
        name="trainguard.rl.reward.std",
        unit="{reward}",
        kind="gauge",
        description=_RL + "standard deviation of the rewards.",
        attributes=_R,
        log_keys=("reward_std",),
    ),
    MetricSpec(
        name="trainguard.rl.reward.min",
        unit="{reward}",
        kind="gauge",
        description=_RL + "smallest reward.",
        attributes=_R,
        log_keys=("reward_min",),
    ),
    MetricSpec(
        name="trainguard.rl.reward.max",
        unit="{reward}",
        kind="gauge",
        description=_RL + "largest reward.",
        attributes=_R,
        log_keys=("reward_max",),
    ),
    MetricSpec(
        name="trainguard.rl.kl",
        unit="{nat}",
        kind="gauge",
        description=_RL + "KL divergence of the policy to the frozen reference.",
        attributes=_R,
        log_keys=("kl",),
    ),
    MetricSpec(
        name="trainguard.rl.entropy",
        unit="{nat}",
        kind="gauge",
        description=_RL + "mean token entropy of the policy.",
        attributes=_R,
        log_keys=("entropy",),
    ),
    MetricSpec(
        name="trainguard.rl.clip_fraction",
        unit="1",
        kind="gauge",
        description=_RL + "fraction of tokens whose probability ratio was clipped.",
        attributes=_R,
        log_keys=("clip_fraction", "clip_ratio", "clipfrac"),
    ),
    MetricSpec(
        name="trainguard.rl.response_length.mean",
        unit="{token}",
        kind="gauge",
        description=_RL + "mean response length.",
        attributes=_R,
        log_keys=("response_length", "response_length_mean"),
    ),
    MetricSpec(
        name="trainguard.rl.response_length.max",
        unit="{token}",
        kind="gauge",
        description=_RL + "longest response.",
        attributes=_R,
        log_keys=("response_length_max",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.duration",
        unit="s",
        kind="gauge",
        description=_RL + "time spent generating rollouts in the step (span 'rollout').",
        attributes=_R,
        log_keys=("rollout_time_s",),
    ),
    MetricSpec(
        name="trainguard.rl.optimize.duration",
        unit="s",
        kind="gauge",
        description=_RL + "time spent optimising in the step (span 'optimize').",
        attributes=_R,
        log_keys=("optimize_time_s",),
    ),
    # -- reinforcement learning: the rollout fleet as the trainer sees it (trainguard.rl) -----
    MetricSpec(
        name="trainguard.rl.rollout.failed",
        unit="{request}",
        kind="counter",
        description=_RL + "rollout requests that failed, by reason (ROLLOUT_FAILURE_REASONS; "
        "each was retried on another engine or failed its batch, never replaced by a made-up "
        "sample).",
        attributes=("node", "reason"),
    ),
    MetricSpec(
        name="trainguard.rl.refit.verified",
        unit="{refit}",
        kind="counter",
        description=_RL + "refits checked by a client before it routed to the engine (the "
        "engine's log-probs of the trainer's fingerprint texts matched), per engine (exported "
        "from 0 for each replica of the job's rollout role).",
        attributes=("node", "engine"),
    ),
    MetricSpec(
        name="trainguard.rl.refit.quarantined",
        unit="{refit}",
        kind="counter",
        description=_RL + "failed refits (an update error, or log-probs that did not match "
        "the trainer's fingerprint): the engine quarantined, out of routing, refit again; per "
        "engine (exported from 0 for each replica of the job's rollout role).",
        attributes=("node", "engine"),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.retried",
        unit="{request}",
        kind="counter",
        description=_RL + "failed rollout requests sent again to another engine, by the reason "
        "of the failure (ROLLOUT_FAILURE_REASONS, exported from 0); failed minus retried ended "
        "their batch.",
        attributes=("node", "reason"),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.retries",
        unit="{request}",
        kind="gauge",
        description=_RL + "rollout requests retried on another engine in the step.",
        attributes=_R,
        log_keys=("rollout_retries",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.latency.p50",
        unit="s",
        kind="gauge",
        description=_RL + "median latency of the step's rollout requests.",
        attributes=_R,
        log_keys=("rollout_latency_p50_s",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.latency.p99",
        unit="s",
        kind="gauge",
        description=_RL + "99th-percentile latency of the step's rollout requests.",
        attributes=_R,
        log_keys=("rollout_latency_p99_s",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.throughput",
        unit="{token}/s",
        kind="gauge",
        description=_RL + "generated tokens per second of the step's rollout batches.",
        attributes=_R,
        log_keys=("rollout_tokens_per_s",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.engines_routable",
        unit="{engine}",
        kind="gauge",
        description=_RL + "engines the rank's rollout client routes to (serving, healthy, "
        "weight version within the staleness bound).",
        attributes=_R,
        log_keys=("engines_serving",),
    ),
    MetricSpec(
        name="trainguard.rl.rollout.engines_declared",
        unit="{engine}",
        kind="gauge",
        description=_RL + "engines the rank's rollout client knows (serving or not): the "
        "denominator of engines_routable.",
        attributes=_R,
        log_keys=("engines_total",),
    ),
    MetricSpec(
        name="trainguard.rl.weight_sync.duration",
        unit="s",
        kind="gauge",
        description=_RL + "time to push the step's weight version to the engines.",
        attributes=_R,
        log_keys=("weight_sync_s",),
    ),
    MetricSpec(
        name="trainguard.rl.weight_sync.timeout",
        unit="s",
        kind="gauge",
        description=_RL + "the weight-sync timeout in force (derived from measured syncs).",
        attributes=_R,
        log_keys=("weight_sync_timeout_s",),
    ),
    MetricSpec(
        name="trainguard.rl.staleness.max",
        unit="{version}",
        kind="gauge",
        description=_RL + "largest staleness (trainer version - generating version) of the "
        "step's samples.",
        attributes=_R,
        log_keys=("staleness_max",),
    ),
    MetricSpec(
        name="trainguard.rl.staleness.mean",
        unit="{version}",
        kind="gauge",
        description=_RL + "mean staleness (trainer version - generating version) of the "
        "step's samples.",
        attributes=_R,
        log_keys=("staleness_mean",),
    ),
    # -- checkpoints, failures, restarts ------------------------------------------------------
    MetricSpec(
        name="trainguard.checkpoint.stall.duration",
        unit="s",
        kind="histogram",
        description="Time training was blocked by a checkpoint save (staging).",
        attributes=("node",),
        log_keys=("checkpoint_stall_s",),
    ),
    MetricSpec(
        name="trainguard.checkpoint.persist.duration",
        unit="s",
        kind="histogram",
        description="Time a checkpoint took to persist in the background.",
        attributes=("node",),
        log_keys=("checkpoint_persist_s",),
    ),
    MetricSpec(
        name="trainguard.checkpoint.size",
        unit="By",
        kind="gauge",
        description="Bytes of the last checkpoint written by this rank.",
        attributes=_R,
        log_keys=("checkpoint_bytes",),
    ),
    MetricSpec(
        name="trainguard.checkpoint.interval",
        unit="s",
        kind="gauge",
        description="Current checkpoint interval (e.g. Young's interval from stall and MTBF).",
        attributes=_R,
        log_keys=("checkpoint_interval_s",),
    ),
    MetricSpec(
        name="trainguard.checkpoint.failures",
        unit="{failure}",
        kind="gauge",
        description="Checkpoint saves of this rank that failed so far.",
        attributes=_R,
        log_keys=("checkpoint_failures",),
    ),
    MetricSpec(
        name="trainguard.health.incidents",
        unit="{incident}",
        kind="counter",
        description="Health incidents seen by this node's agent, by kind (hang_detected, "
        "straggler_detected, health_unhealthy, node_excluded, preflight_failed...); the kinds in "
        "INCIDENT_KINDS start at 0 so that rate() and increase() see the first one.",
        attributes=("node", "kind"),
    ),
    MetricSpec(
        name="trainguard.health.straggler_score",
        unit="1",
        kind="gauge",
        description="Straggler score of a rank: 0 at or below the other ranks' median step "
        "time, towards 1 for a rank that barely moves.",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.job.failures",
        unit="{failure}",
        kind="counter",
        description="Worker failures seen by this node's agent, by cause (every failure kind "
        "is exported from 0).",
        attributes=("node", "cause"),
    ),
    # -- fleet health: attributed failures, node states, lemons, sniff tests -----------------
    MetricSpec(
        name="trainguard.fleet.failures",
        unit="{failure}",
        kind="counter",
        description="Failures this node's agent attributed to a cause (user_code, "
        "out_of_memory, hardware, network, data, control_plane, transient; every cause is "
        "exported from 0).",
        attributes=("node", "cause"),
    ),
    MetricSpec(
        name="trainguard.fleet.node.state",
        unit="{node}",
        kind="gauge",
        description="1 for a node's current fleet state (ok, degraded, excluded, evicted, "
        "lemon), 0 for the others; a lemon node refused at a job's start is exported by the "
        "agents of the nodes that run the job.",
        attributes=("node", "state"),
    ),
    MetricSpec(
        name="trainguard.fleet.lemon.refused_time",
        unit="s",
        kind="gauge",
        description="Unix time a lemon node was last refused at a job's start (exported by "
        "the agents that run the job, labelled with the refused node).",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.sniff.gemm_time",
        unit="s",
        kind="gauge",
        description="A rank's latest sniff GEMM time (the fixed GEMM of [fleet] "
        "sniff_gemm_size on its device).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.sniff.allreduce_time",
        unit="s",
        kind="gauge",
        description="A rank's latest sniff all-reduce time ([fleet] sniff_allreduce_kib over "
        "the default group).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.sniff.slowdown",
        unit="1",
        kind="gauge",
        description="A rank's latest sniff GEMM time over its reference (the node's other "
        "ranks, or the fleet's history for its device model): 1 as fast, 2 twice as slow.",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.sniff.overhead",
        unit="1",
        kind="gauge",
        description="Share of a rank's training time spent in sniff tests (bounded by [fleet] "
        "sniff_budget).",
        attributes=_R,
    ),
    MetricSpec(
        name="trainguard.job.restarts",
        unit="{restart}",
        kind="counter",
        description="Worker-group restarts, by cause (failure, membership_change, hang...).",
        attributes=("node", "cause"),
    ),
    MetricSpec(
        name="trainguard.job.rollbacks",
        unit="{rollback}",
        kind="counter",
        description="Loss rollbacks (NaN/Inf or spike in the logged loss → every rank restored "
        "the last good checkpoint and skipped the offending data window), by reason.",
        attributes=("node", "reason"),
    ),
    MetricSpec(
        name="trainguard.job.hung",
        unit="{state}",
        kind="gauge",
        description="1 from the agent's hang verdict on this node until the workers complete a "
        f"step again (or the job ends), and for at least {HUNG_MIN_HOLD_S:.0f} s, else 0: the "
        "alert rules' 'job hung' signal. ``diagnosis`` is where the hang is: ``pending`` from the "
        "verdict until every rank's collectives are analysed, then ``missing`` (ranks never "
        "entered the collective the others wait in), ``divergent`` (ranks in different "
        "collectives), ``transport`` (all entered, none completed) or ``unknown``.",
        attributes=("node", "diagnosis"),
    ),
    MetricSpec(
        name="trainguard.checkpoint.last_commit.time",
        unit="s",
        kind="gauge",
        description="Unix time of the last committed checkpoint seen by this node's agent.",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.job.attempt",
        unit="{attempt}",
        kind="gauge",
        description="Current job-wide worker-group attempt (0-based).",
        attributes=("node",),
    ),
    # -- roles: the engine fleets beside the trainer (trainguard.roles) --------------------------
    MetricSpec(
        name="trainguard.role.replicas.serving",
        unit="{replica}",
        kind="gauge",
        description="Replicas of a role (rollout, reward) on this node that are serving.",
        attributes=("node", "role"),
    ),
    MetricSpec(
        name="trainguard.role.replicas.total",
        unit="{replica}",
        kind="gauge",
        description="Replicas of a role on this node (whatever their state).",
        attributes=("node", "role"),
    ),
    MetricSpec(
        name="trainguard.role.replica.state",
        unit="{state}",
        kind="gauge",
        description="1 for a replica's current lifecycle state (see ROLE_STATES), 0 for the "
        "others.",
        attributes=("node", "role", "replica", "state"),
    ),
    MetricSpec(
        name="trainguard.role.replica.weight_version",
        unit="{version}",
        kind="gauge",
        description="Weight version a replica reports on its health endpoint.",
        attributes=("node", "role", "replica"),
    ),
    MetricSpec(
        name="trainguard.role.restarts",
        unit="{restart}",
        kind="counter",
        description="Replica restarts of a role (each role has its own budget; never the "
        "trainer's restarts).",
        attributes=("node", "role"),
    ),
    # -- goodput ------------------------------------------------------------------------------
    MetricSpec(
        name="trainguard.goodput.productive_time",
        unit="s",
        kind="gauge",
        description="Wall time spent in steps that were not recomputed later.",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.goodput.lost_time",
        unit="s",
        kind="gauge",
        description="Wall time lost, by cause: startup, rendezvous, checkpoint_stall, "
        "recomputed_steps, hang, restart, rollback, queue_wait, prolog, requeue_wait (the "
        "scheduler's share, under trainguard sbatch), other.",
        attributes=("node", "cause"),
    ),
    MetricSpec(
        name="trainguard.goodput.ettr",
        unit="1",
        kind="gauge",
        description="Effective training time ratio: productive time / elapsed wall time.",
        attributes=("node",),
    ),
    MetricSpec(
        name="trainguard.slurm.schedule_time",
        unit="s",
        kind="gauge",
        description="The scheduler's share of each allocation of a trainguard sbatch chain "
        "(sacct, else scontrol show job): phase queue_wait (submit to start), prolog (start "
        "to the batch host's agent), requeue_gap (the previous allocation's end to this "
        "start); allocation: job id.restart count.",
        attributes=("node", "phase", "allocation"),
    ),
    # -- telemetry itself ---------------------------------------------------------------------
    MetricSpec(
        name="trainguard.run.info",
        unit="{info}",
        kind="gauge",
        description="Always 1; labels identify the run (run_id, job_id, slurm_job_id) for joins.",
        attributes=("node", "run_id", "job_id", "slurm_job_id"),
    ),
    MetricSpec(
        name="trainguard.telemetry.export.failures",
        unit="{failure}",
        kind="counter",
        description="Failed telemetry exports, by exporter (never raised into training).",
        attributes=("node", "exporter"),
    ),
)

_BY_NAME = {m.name: m for m in METRICS}
assert len(_BY_NAME) == len(METRICS), "duplicate metric names in the contract"
assert all(_NAME_RE.match(m.name) for m in METRICS)
assert len({m.prometheus for m in METRICS}) == len(METRICS), "Prometheus name clash"

LOSS_CAUSES = (
    "startup",
    "rendezvous",
    "checkpoint_stall",
    "recomputed_steps",
    "hang",
    "restart",
    "rollback",
    "queue_wait",
    "prolog",
    "requeue_wait",
    "other",
)
"""Values of the ``cause`` attribute of ``trainguard.goodput.lost_time`` (``queue_wait``,
``prolog``, ``requeue_wait``: the scheduler's share of a ``trainguard sbatch`` chain)."""

INCIDENT_KINDS = (
    "hang_detected",
    "straggler_detected",
    "health_unhealthy",
    "node_excluded",
    "preflight_failed",
)
"""Values of the ``kind`` attribute of ``trainguard.health.incidents`` (exported from 0)."""

RESTART_CAUSES = (
    "killed",
    "crashed",
    "exception",
    "exited",
    "hang",
    "membership_change",
    "failure",
)
"""Common values of the ``cause`` attribute of ``trainguard.job.restarts`` (exported from 0;
failure causes of the worker classification appear as they happen)."""

ROLLBACK_REASONS = ("nan", "inf", "spike", "other")
"""Values of the ``reason`` attribute of ``trainguard.job.rollbacks`` (exported from 0;
``other``: the rank that saw the anomaly is not the one that counts it)."""

ROLLOUT_FAILURE_REASONS = (
    "refused",
    "connection",
    "timeout",
    "engine_dead",
    "http_5xx",
    "http_4xx",
    "unauthorized",
    "not_serving",
    "malformed",
    "stale",
)
"""Values of the ``reason`` attribute of ``trainguard.rl.rollout.failed`` (exported from 0):
connection refused; reset or closed; no answer in time; the engine declared dead with the
request in flight; HTTP 5xx; HTTP 4xx; HTTP 401 (the request's signature refused); 503
(loading); not JSON, an incomplete answer, or one not signed with the job's token; generated
by a weight version outside the staleness bound."""

ATTRIBUTION_CAUSES = tuple(c.value for c in Cause)
"""Values of the ``cause`` attribute of ``trainguard.fleet.failures`` (exported from 0): the
members of :class:`trainguard.core.contracts.actions.Cause`."""

NODE_STATES = ("ok", "degraded", "excluded", "evicted", "lemon")
"""Values of the ``state`` attribute of ``trainguard.fleet.node.state``."""

__all__ += [
    "ATTRIBUTION_CAUSES",
    "NODE_STATES",
    "HUNG_MIN_HOLD_S",
    "ROLLOUT_FAILURE_REASONS",
    "INCIDENT_KINDS",
    "LOSS_CAUSES",
    "RESTART_CAUSES",
    "ROLLBACK_REASONS",
]


def by_name(name: str) -> MetricSpec:
    """The contract entry for an OpenTelemetry name; KeyError if it is not in the contract."""
    return _BY_NAME[name]


ROLES = ("rollout", "reward")
"""The roles a job may declare besides ``trainer`` (whose workers are the SPMD group)."""

ROLE_STATES = tuple(s.value for s in REPLICA_STATES)
"""Lifecycle states of a role replica (:data:`trainguard.core.contracts.engine.REPLICA_STATES`):
starting → loading (weights) → serving → suspect → dead → restarting (→ starting); ``failed``:
not restarted (the role's restart budget is spent, or its policy is ``never``); ``stopped``:
ended with the job."""

__all__ += ["ROLES", "ROLE_STATES"]
