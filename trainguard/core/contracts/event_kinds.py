"""The event contract: every kind of event trainguard writes to ``events.jsonl`` (and the
in-process bus messages), with who emits it, its fields and what it means.

Emitters write the kind as a literal (``ctx.events.emit("restart", ...)``) or one of the
constants below; consumers in another package than the emitter match the constants. A test
(tests/test_event_kinds.py) scans the source: an emitted kind missing here, or a kind here
that nothing emits, fails it. Every event also carries ``time``, ``kind``, ``node``,
``attempt`` (see :mod:`trainguard.core.events`); ``fields`` lists the ones the emitter names
(some add a report's summary besides).

This module imports nothing heavy and is safe to import anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "EVENTS",
    "KINDS",
    "EventSpec",
    "by_name",
    "CHECKPOINT_COMMITTED",
    "CHECKPOINT_RESTORED",
    "FAILURE_ATTRIBUTED",
    "HANG_DETECTED",
    "HANG_DIAGNOSIS",
    "HANG_KILLED",
    "HEALTH_PROBE",
    "HEALTH_UNHEALTHY",
    "JOB_FINISHED",
    "LAUNCH",
    "LOSS_ROLLBACK",
    "NODE_DRAINED",
    "NODE_EVICTED",
    "NODE_EXCLUDED",
    "NODE_REFUSED",
    "PREFLIGHT",
    "RECOVERY_DECISION",
    "RENDEZVOUS",
    "RESTART",
    "ROLE_NODE_LOST",
    "ROLE_NODE_REPLACED",
    "ROLE_PORT_TAKEN",
    "ROLE_REPLICA_FAILED",
    "ROLE_REPLICA_RETIRED",
    "ROLE_REPLICA_STARTED",
    "ROLE_REPLICA_STATE",
    "ROLE_RESTART_BUDGET_EXHAUSTED",
    "ROLE_STANDBY_STATE",
    "ROLLBACK_EXHAUSTED",
    "ROLLOUT_FAILED",
    "ROLLOUT_SAMPLES_TRAINED",
    "REWARD_FAILED",
    "SPARE_WAITING",
    "SLURM_SCHEDULE",
    "SNIFF_RESULTS",
    "STRAGGLER_SCORES",
    "WARM_READY",
    "WORKERS_STARTED",
    "WORKER_FAILED",
    "WORKER_GROUP_UNHEALTHY",
]


@dataclass(frozen=True, slots=True)
class EventSpec:
    """One event kind of the contract."""

    name: str
    """The ``kind`` value, e.g. ``worker_failed``."""
    emitters: tuple[str, ...]
    """Modules that emit it, relative to ``trainguard`` (``runtime.agent``)."""
    fields: tuple[str, ...]
    """Fields the emitter names (besides ``time``, ``kind``, ``node``, ``attempt``)."""
    description: str
    logged: bool = True
    """False: an in-process bus message (``EventLog.publish``), never written to the log."""


EVENTS: tuple[EventSpec, ...] = (
    # -- the launcher and the agent (runtime) --------------------------------------------------
    EventSpec("launch", ("runtime.launcher",), ("args", "entrypoint", "max_nodes", "max_restarts", "min_nodes", "nproc_per_node", "pid", "process_start", "rdzv_backend", "run_id"), "The launcher started (its process start: the job's wall time includes imports)."),
    EventSpec("job_finished", ("runtime.launcher",), ("restarts", "state"), "This node's launcher ends; ``state`` is a JobState value, ``restarts`` the job-wide worker-group restarts before it ended."),
    EventSpec("rendezvous", ("runtime.agent",), ("duration_s", "group_rank", "group_world_size", "master_addr", "master_port", "members"), "A rendezvous round completed: its members and this node's rank."),
    EventSpec("workers_started", ("runtime.agent",), ("workers", "world_size"), "The local workers started (rank, local rank, pid, warm each)."),
    EventSpec("worker_failed", ("runtime.agent",), ("cause", "exitcode", "local_rank", "message", "pid", "place", "rank", "root_cause", "signal", "state"), "A worker died; ``root_cause`` marks the earliest failure (torch's rule), not counting a survivor's error because a peer rank died."),
    EventSpec("peer_failed", ("runtime.agent",), ("failed_node", "how", "pids", "ranks"), "Another node's workers of this attempt failed (``how``: ``failed``, its agent said so; ``lost``, its liveness beacon went silent): this node's workers were ended at once instead of waiting in their collectives for the process-group timeout."),
    EventSpec("worker_group_unhealthy", ("runtime.agent",), ("state",), "torch found the group unhealthy without a failed worker."),
    EventSpec("restart", ("runtime.agent",), ("max_restarts", "reason", "remaining_restarts"), "The agent restarts its worker group (a failure or a membership change)."),
    EventSpec("requeue", ("runtime.agent",), ("exitcode", "message"), "The workers saved on preemption and asked to be requeued: no restart here."),
    EventSpec("do_not_requeue", ("runtime.agent",), ("exitcode", "ranks"), "A worker exited with the do-not-requeue code: no restart, no requeue."),
    EventSpec("inprocess_restart", ("runtime.inprocess",), ("duration_s", "generation", "remaining_restarts", "replaced", "survivors"), "Dead local workers replaced in place; the survivors keep running."),
    EventSpec("warm_ready", ("runtime.warm.plugin",), ("local_rank", "pid"), "A pre-started process for a local rank's next start is ready (a restart, or a spare's first start)."),
    EventSpec("node_dead", ("runtime.spares",), ("dead_node", "reason", "removed_by", "round", "silent_s"), "A node's liveness beacon went silent: it was removed from the rendezvous."),
    EventSpec("spare_waiting", ("runtime.spares",), ("reason", "round"), "This node waits as a spare (no slot in the round)."),
    EventSpec("spare_joined", ("runtime.spares",), ("round", "waited_s"), "A node that waited as a spare got a slot."),
    # -- roles (engine fleets beside the trainer) -----------------------------------------------
    EventSpec("role_replica_started", ("roles.supervisor",), ("command", "incarnation", "pid", "port", "replica", "restarts", "role", "role_restarts", "standby", "total", "url"), "A role replica (rollout engine, reward server) was started (``restarts``: this replica's so far; ``role_restarts``: the role's, against its budget; ``standby``: the slot of the warm standby promoted in its place, null for a fresh start; ``incarnation``: the nonce its health answers must name)."),
    EventSpec("role_standby_state", ("roles.supervisor",), ("incarnation", "pid", "port", "previous", "reason", "role", "slot", "starts", "state"), "A role's warm standby (``standby = N``, a pool for the role) changed state: starting (started at low priority), standby (loaded: its own health answer said so; kept out of routing), suspect (no answer: not promoted until it answers again; a slow standby is not dead), promoted (it replaces a dead replica), dead (restarted), failed (the role goes on without it), stopped."),
    EventSpec("role_port_taken", ("roles.supervisor",), ("holder", "holder_pid", "port", "replica", "role", "waited_s"), "Another process holds a replica's port (``holder``: its command line or what its health answer said): it is never taken for the replica; the start waits for the port (``[roles] port_wait_s``), then the replica is retired."),
    EventSpec("role_replica_retired", ("roles.supervisor",), ("floor", "left", "reason", "replica", "restarts", "role"), "A role replica is not restarted again (it died ``retire_after`` times, or its port stayed taken): the role goes on with the ``left`` others while they are at least its ``floor``."),
    EventSpec("role_node_lost", ("roles.nodeloss",), ("cause", "drain", "drained", "floor", "left", "node_name", "replicas", "role", "spare"), "Under ``trainguard sbatch``: a role node's beacon stood still for ``[roles] node_dead_after_s`` (its agent killed, the node crashed or cut off): it is drained in Slurm with ``cause`` (``drained``/``drain``: the outcome), its ``replicas`` are re-placed on the role's ``spare`` node (null: none left, they are lost); ``left``: the role's replicas neither lost nor retired, against its ``floor`` (below it the job ends, exit code 96). The trainer is not restarted."),
    EventSpec("role_node_replaced", ("roles.node",), ("addr", "replaces", "replicas", "role"), "A spare role node (``spares``) starts the replicas of the lost node it ``replaces``, on their ports at its own address ``addr`` (their state files publish the new URLs; the clients and the fleet endpoint follow)."),
    EventSpec("role_replica_state", ("roles.supervisor",), ("pid", "previous", "reason", "replica", "role", "serving", "state", "total", "weight_version"), "A role replica changed state (starting, loading, serving, suspect, dead, restarting, retired, failed, stopped) or reports another weight version; ``serving``/``total``: the role's fleet on this node."),
    EventSpec("role_replica_failed", ("roles.supervisor",), ("exitcode", "pid", "reason", "replica", "restart_budget", "restarts", "role", "was_ready"), "A role replica died (exited, refused connections, froze, or was not ready in time after a restart); the trainer is not touched."),
    EventSpec("role_restart_budget_exhausted", ("roles.supervisor",), ("message", "replica", "restart_budget", "restarts", "role"), "A role replica died with its role's restart budget spent (or its policy ``never``): the role failed and the job ends."),
    EventSpec("ft_lighthouse", ("runtime.registry",), ("pid", "replica_group", "started", "url"), "torchft's lighthouse this job uses (started here or found)."),
    # -- checkpoints ---------------------------------------------------------------------------
    EventSpec("checkpoint_committed", ("checkpoint.pipeline",), ("bytes", "commit_s", "path", "persist_mode", "persist_s", "sdc", "sdc_reason", "stall_s", "step"), "A checkpoint is durably on disk (every rank's files checked, manifest renamed in); sdc: verified (its state passed the replicas' check at its step) or unverified (and why)."),
    EventSpec("checkpoint_failed", ("checkpoint.pipeline",), ("error", "rank", "reason", "step"), "A save ended without a commit (``reason``: error, timeout, busy); training goes on."),
    EventSpec("checkpoint_skipped", ("checkpoint.manager",), ("reason", "step"), "A save was not started (e.g. the previous one still persisting)."),
    EventSpec("checkpoint_restored", ("checkpoint.restore",), ("disk_steps", "duration_s", "memory_steps", "rank", "source", "step"), "The state was restored (source: memory, peer or disk)."),
    EventSpec("checkpoint_corrupt", ("checkpoint.restore",), ("error", "path", "step"), "A checkpoint failed its checks; the previous one is tried."),
    EventSpec("checkpoint_interval", ("checkpoint.manager",), ("interval_s", "mtbf_s", "stall_s"), "The automatic checkpoint interval changed (goodput planner's optimum)."),
    EventSpec("checkpoint_memory_cadence", ("checkpoint.manager",), ("every_steps", "fixed_s", "max_stall_fraction", "stall_s", "step_s"), "How often the memory tier is written, from the measured stall (and the fixed per-step cost a framework integration reports)."),
    EventSpec("checkpoint_memory_tier_disabled", ("checkpoint.pipeline",), ("error", "rank"), "The memory tier could not be used on this rank."),
    EventSpec("checkpoint_memory_tier_serving", ("checkpoint.memtier.plugin",), ("host", "port"), "The node's memory-tier replication server listens."),
    EventSpec("checkpoint_memory_filled", ("checkpoint.memtier.plugin",), ("bytes", "duration_s", "rank", "snapshot_source", "source", "step", "steps"), "After a rendezvous, a rank's memory tier was filled from a peer."),
    EventSpec("checkpoint_memory_fill_timeout", ("checkpoint.memtier.plugin",), ("rank", "timeout_s"), "Filling the memory tier from peers ran out of time."),
    EventSpec("checkpoint_peer_push_failed", ("checkpoint.memtier.replication",), ("consecutive", "error", "failures", "peer", "rank", "retry_in_s"), "Replicating a snapshot to the peer node failed (backs off)."),
    EventSpec("checkpoint_peer_skipped", ("checkpoint.memtier.plugin",), ("during", "group_ranks", "reasons", "wait_s"), "A peer did not answer the fill in time: skipped."),
    EventSpec("checkpoint_persister_started", ("checkpoint.supervisor",), ("gen", "pid"), "The persister processes started (``persist_mode`` ``process``, or ``auto`` for a large state)."),
    EventSpec("checkpoint_persister_replaced", ("checkpoint.supervisor",), ("reason",), "A persister process died or hung and was replaced."),
    EventSpec("checkpoint_preempted", ("checkpoint.manager",), ("signal", "step"), "A preemption signal arrived: save at the next step boundary."),
    EventSpec("checkpoint_preempt_saved", ("checkpoint.manager",), ("committed", "error", "step"), "The preemption save finished (committed or not)."),
    # -- health --------------------------------------------------------------------------------
    EventSpec("preflight", ("health.monitor",), ("action", "compute", "duration_s", "note", "reasons", "sources", "status"), "The node's checks before the first rendezvous (status, action, reasons, sources: the report's summary)."),
    EventSpec("preflight_compare", ("health.monitor",), ("nodes",), "The nodes' compute and clock checks compared after a rendezvous."),
    EventSpec("health_probe", ("health.monitor",), ("action", "previous", "reasons", "sources", "status"), "The in-job health verdict changed (status, action, reasons, sources: the report's summary)."),
    EventSpec("health_unhealthy", ("health.monitor",), ("action", "ranks", "reasons"), "An in-job finding with action restart or drain: the local group is killed."),
    EventSpec("allreduce_probe", ("health.monitor",), ("action", "nodes", "status"), "The allreduce probe's verdict on slow or failing nodes."),
    EventSpec("node_excluded", ("health.monitor", "health.straggler", "fleet.plugin"), ("action", "ranks", "reason", "reasons", "scores"), "This node leaves the job (unhealthy, or under the exclude policy a straggler or, reason ``sniff``, a rank its sniff tests flagged)."),
    EventSpec("straggler_detected", ("health.straggler",), ("message",), "A rank is persistently slower than the others' median (plus its scores)."),
    EventSpec("straggler_scores", ("health.straggler",), ("scores", "stragglers"), "Bus message health → telemetry: rank → score, and the stragglers.", logged=False),
    EventSpec("hang_detected", ("health.hang",), ("hang_kind", "median_step_s", "message", "per_rank", "ranks", "timeout_s", "waiting_ranks"), "Workers made no progress within the hang timeout."),
    EventSpec("hang_stacks", ("health.hang",), ("ranks", "stacks"), "The hung workers' Python stacks (py-spy)."),
    EventSpec("hang_killed", ("health.hang",), ("pids", "ranks"), "The hung local group was killed (the group restarts)."),
    # -- recovery, Slurm, torchft, the worker ----------------------------------------------------
    EventSpec("failure_attributed", ("recovery.plugin",), ("cause", "deterministic", "evidence", "failed_attempt", "ranks", "summary", "verdict"), "This node's attribution of a failed round: ``cause`` (user_code, out_of_memory, hardware, network, data, control_plane, transient), ``verdict`` (stop, evict, restart, rollback, retry) and the evidence (exception, place, ranks, exits, output tail, health findings)."),
    EventSpec("recovery_decision", ("recovery.plugin",), ("action", "backoff_s", "budget", "decided_by", "failed_attempt", "job_restarts", "reason"), "The restart policy's decision after a failure (plus ``verdict`` and ``failure_cause`` of the node's attribution)."),
    EventSpec("node_evicted", ("recovery.plugin",), ("cooldown_s", "detail", "fenced", "fencer", "reason", "until"), "This node was taken out of the job for a cooldown."),
    EventSpec("node_refused", ("recovery.plugin", "fleet.plugin", "slurm.plugin"), ("evicted_at", "history", "incidents", "lemon", "reason", "slurm_state", "threshold", "until"), "A node kept out before a rendezvous: evicted and still in its cooldown; a lemon (``lemon``: its fleet history crossed the threshold, ``history`` the incidents); or DRAIN / DOWN / FAIL in Slurm (``slurm_state``)."),
    EventSpec("sniff_degraded", ("fleet.plugin",), ("device_model", "gemm_s", "gemm_size", "message", "policy", "rank", "ratio", "calibration", "reference", "reference_s", "sniffs", "step", "window"), "A rank became slow: the median of its last sniffs' GEMM times over their reference (the node's other ranks at the same sniff, or the fleet's history for the device model) reached ``[fleet] sniff_slow_factor`` (``ratio``; ``window``: those slowdowns, ``sniffs`` of them slow); handled by ``[health] straggler_policy``."),
    EventSpec("sniff_results", ("fleet.plugin",), ("flagged", "results"), "Bus message fleet → telemetry: each local rank's latest sniff results (gemm_s, allreduce_s, overhead, ratio) and the flagged ranks.", logged=False),
    EventSpec("fleet_records", ("fleet.plugin",), ("dropped", "error", "waiting", "warnings", "written"), "At the end of the agent: its records in the fleet database (written, still waiting, dropped past the queue bound)."),
    EventSpec("node_readmitted", ("recovery.plugin",), ("evicted_at", "reason", "until"), "An evicted node rejoined after its cooldown."),
    EventSpec("node_drained", ("slurm.finish", "slurm.plugin"), ("detail", "fenced", "job_id", "node_name"), "A node was drained in Slurm, or set down (a lost batch host) (``fenced``: by trainguard)."),
    EventSpec("slurm_finish", ("slurm.finish",), ("action", "job_id", "message", "rc"), "The batch script's decision after the step (done, stop, requeue, resubmit, fail), or an agent's after the batch host was lost (resubmit, fail; rc null)."),
    EventSpec("slurm_schedule", ("slurm.plugin",), ("eligible", "job_id", "launch", "previous_end", "prolog_s", "queue_wait_s", "requeue_gap_s", "restart", "source", "start", "submit", "warnings"), "The scheduler's share of one allocation of a ``trainguard sbatch`` chain, from its batch host's agent: queue wait (submit → start), prolog (start → the agent), the gap since the previous allocation ended (a requeue, a resubmission); ``source``: sacct, else scontrol (``warnings``: what failed)."),
    EventSpec("resubmit", ("slurm.finish",), ("exclude", "job_id", "new_job_id"), "The job was resubmitted without its lost nodes."),
    EventSpec("resubmit_failed", ("slurm.finish",), ("error", "job_id"), "Resubmitting the job failed."),
    EventSpec("ft_healed", ("ft.worker",), ("replica_group", "step"), "A torchft replica group healed from the others."),
    EventSpec("ft_recovered", ("ft.worker",), (), "A torchft recovery ended (plus its record: pause, steps)."),
    EventSpec("inprocess_rejoin", ("worker.inprocess",), ("failed_step", "from_generation", "generation", "reason", "wait_s"), "A surviving worker rejoined a new in-process generation."),
    EventSpec("loss_anomaly", ("worker.rollback",), ("median", "metric", "reason", "step", "value"), "The loss guard found a NaN/Inf or spike."),
    EventSpec("loss_rollback", ("worker.rollback",), ("bad_step", "duration_s", "from_step", "reason", "restored_step", "resume_step", "rollbacks", "rollbacks_here", "skip"), "The workers rolled back to a checkpoint before a loss anomaly."),
    EventSpec("rollback_exhausted", ("worker.rollback",), ("bad_step", "exitcode", "max_rollbacks", "reason", "rollbacks_here"), "Too many rollbacks at one step: the job stops."),
    EventSpec("sdc_suspect", ("worker.sdc", "checkpoint.restore"), ("digests", "last_agreed_step", "localise", "ranks", "source", "step"), "The ranks' replicated state (DDP parameters, optimizer state) disagreed at this step: silent data corruption on some rank (ranks: the odd ones out by majority, or every rank while a replay localises it); or (localise memory_copy) a memory-tier copy held by another node differs from its owner's digest (source: where it came from) and is not restored from."),
    EventSpec("sdc_rollback", ("worker.sdc",), ("bad_step", "duration_s", "restored_step", "resume_step"), "After a replica disagreement the workers rolled back to the last agreed state and redo the steps since."),
    EventSpec("sdc_verdict", ("worker.sdc",), ("action", "localise", "ranks", "reason", "step", "verdicts"), "The rank(s) that computed a wrong result (localise: majority, replay or gemm; none: not found), and what the job does (rollback, stop)."),
    EventSpec("sdc_rank_named", ("worker.sdc",), ("device", "localise", "step"), "This rank was named by a corruption verdict (its node and device; a fleet-database record with cause sdc)."),
    EventSpec("sdc_checks_off", ("worker.sdc",), ("reason",), "The replica checks are off for this job: its checkpointed state is not replicated bitwise on every rank."),
    # -- security, hang diagnosis and framework integrations ---------------------------------
    EventSpec("rdzv_round_ended", ("runtime.etcd_v3.handler",), ("left", "round"), "This node left the complete etcd-v3 round first and ended it for every node (left: the other participants taken out with it, a lost node's among them): all join the next round at once."),
    EventSpec("rdzv_state_refused", ("runtime.etcd_v3.handler",), ("key", "reason", "revision"), "The etcd-v3 rendezvous state at this revision was refused (not trainguard's JSON form, corrupt or oversized): treated as empty and written over."),
    EventSpec("chaos_armed", ("runtime.launcher", "worker.api"), ("faults", "spec"), "Faults from TRAINGUARD_CHAOS are armed in this agent (spec and faults) or worker (faults)."),
    EventSpec("collective_progress", ("runtime.agent",), ("rank",), "This rank writes no tg.step() progress: its collectives (torch's flight recorder) are its progress for hang detection."),
    EventSpec("hang_diagnosis", ("health.hang",), ("diagnosis", "frames", "groups", "message", "missing_dumps", "op", "pg", "seq", "stack_groups", "suspect_hosts", "suspect_ranks"), "Where a hung job is stuck: the collective (process group, op, sequence id), the ranks missing from it or in another one, their hosts, and the ranks' stacks grouped."),
    EventSpec("integration_attached", ("integrations.adapter",), ("framework", "resume", "resumed_step"), "trainguard's callback is attached to a framework's trainer (and, with resume, restored its newest snapshot)."),
    EventSpec("integration_degraded", ("integrations._frameworks",), ("error", "framework", "version", "what"), "A framework internal the integration uses failed (a renamed attribute, a changed signature): one warning, and training goes on with resume off."),
    EventSpec("integration_auto_attached", ("integrations.auto",), ("framework", "resume"), "The start-up hook attached trainguard to a framework's trainer without a code change."),
    EventSpec("integration_preempted", ("integrations.adapter",), ("framework", "step"), "A preemption notice reached the framework's loop: it saves at this step and the worker exits for a requeue."),
    # -- reinforcement learning (trainguard.rl) --------------------------------------------------
    EventSpec("rollout_failed", ("rl.dispatch",), ("detail", "engine", "reason", "retried"), "A rollout request to an engine failed (``reason``: one of ROLLOUT_FAILURE_REASONS in the metric contract); ``retried``: it is sent again to another engine, else its batch fails (the cap of attempts, or an invalid request). Never replaced by a made-up sample."),
    EventSpec("reward_failed", ("rl.reward",), ("detail", "reason", "retried", "server"), "A reward request to a reward server failed (``reason``: one of ROLLOUT_FAILURE_REASONS; ``malformed``: an answer that is not one finite reward per completion); ``retried``: sent again to the next server, else the batch raises RewardError. A reward is never made up."),
    EventSpec("rollout_refit_verified", ("rl.weightsync",), ("engine", "max_logprob_diff", "verified", "version"), "A client checked that an engine holds this weight version (its log-probs of the trainer's fingerprint texts within the tolerance) before routing to it; ``verified``: the engine's count of verified refits in this client."),
    EventSpec("rollout_samples_trained", ("rl.groups",), ("bound", "dropped", "group_sizes", "rank", "shrunk", "staleness", "step", "version"), "What one trainer rank trained at a step: each sample's staleness (the version trained into minus the version that generated it; at most the ``bound`` k), each kept group's size (complete, or shrunk to its survivors by setting), the groups dropped whole by reason (failed, not_generated, duplicate, stale, too_few). A group is never padded."),
    EventSpec("rollout_engine_quarantined", ("rl.weightsync",), ("engine", "quarantined", "reason", "version"), "An engine's refit to this version failed (the update answered an error, or its log-probs did not match the trainer's fingerprint: ``reason`` says what differed): out of routing, told to answer no completion, refit again; ``quarantined``: the engine's count in this client."),
)  # fmt: skip

_BY_NAME = {s.name: s for s in EVENTS}
KINDS: frozenset[str] = frozenset(_BY_NAME)
"""Every registered kind."""


def by_name(kind: str) -> EventSpec:
    """The spec of ``kind``; ``KeyError`` naming it when it is not registered."""
    try:
        return _BY_NAME[kind]
    except KeyError:
        raise KeyError(
            f"event kind {kind!r} is not in trainguard.core.contracts.event_kinds.EVENTS"
        ) from None


def _kind(name: str) -> str:
    return by_name(name).name


# Kinds one package emits and another matches (consumers use these, not literals).
LAUNCH = _kind("launch")
JOB_FINISHED = _kind("job_finished")
RENDEZVOUS = _kind("rendezvous")
WORKERS_STARTED = _kind("workers_started")
WORKER_FAILED = _kind("worker_failed")
RESTART = _kind("restart")
WORKER_GROUP_UNHEALTHY = _kind("worker_group_unhealthy")
CHECKPOINT_RESTORED = _kind("checkpoint_restored")
CHECKPOINT_COMMITTED = _kind("checkpoint_committed")
HEALTH_UNHEALTHY = _kind("health_unhealthy")
NODE_EXCLUDED = _kind("node_excluded")
NODE_DRAINED = _kind("node_drained")
HANG_DETECTED = _kind("hang_detected")
HANG_KILLED = _kind("hang_killed")
LOSS_ROLLBACK = _kind("loss_rollback")
ROLLBACK_EXHAUSTED = _kind("rollback_exhausted")
STRAGGLER_SCORES = _kind("straggler_scores")
SNIFF_RESULTS = _kind("sniff_results")
SNIFF_DEGRADED = _kind("sniff_degraded")
FLEET_RECORDS = _kind("fleet_records")
SLURM_SCHEDULE = _kind("slurm_schedule")
SPARE_WAITING = _kind("spare_waiting")
WARM_READY = _kind("warm_ready")
ROLE_REPLICA_STARTED = _kind("role_replica_started")
ROLE_REPLICA_STATE = _kind("role_replica_state")
ROLE_REPLICA_FAILED = _kind("role_replica_failed")
ROLE_RESTART_BUDGET_EXHAUSTED = _kind("role_restart_budget_exhausted")
ROLE_STANDBY_STATE = _kind("role_standby_state")
ROLE_PORT_TAKEN = _kind("role_port_taken")
ROLE_REPLICA_RETIRED = _kind("role_replica_retired")
ROLE_NODE_LOST = _kind("role_node_lost")
ROLE_NODE_REPLACED = _kind("role_node_replaced")
PREFLIGHT = _kind("preflight")
HEALTH_PROBE = _kind("health_probe")
FAILURE_ATTRIBUTED = _kind("failure_attributed")
NODE_EVICTED = _kind("node_evicted")
NODE_REFUSED = _kind("node_refused")
NODE_READMITTED = _kind("node_readmitted")
ROLLOUT_FAILED = _kind("rollout_failed")
REWARD_FAILED = _kind("reward_failed")
ROLLOUT_REFIT_VERIFIED = _kind("rollout_refit_verified")
ROLLOUT_ENGINE_QUARANTINED = _kind("rollout_engine_quarantined")
ROLLOUT_SAMPLES_TRAINED = _kind("rollout_samples_trained")
HANG_DIAGNOSIS = _kind("hang_diagnosis")
RECOVERY_DECISION = _kind("recovery_decision")
