"""What the batch script does once the agents' ``srun`` step has ended.

:func:`decide` is pure: from the step's exit code, the agents' ``job_finished`` events of this
run of the job and the allocation, it picks one :class:`FinishAction`:

==========  ===================================================================================
DONE        an agent finished the training (nodes whose agent was lost are drained; the job
            ends with 0)
STOP        the "do not requeue" exit code: the job ends with it, nothing is retried
REQUEUE     the agents saved a preemption checkpoint and exited 75: ``scontrol requeue``
RESUBMIT    the step failed and nodes were lost (spares used up): drain them and submit the
            job again with ``--exclude`` of the lost, drained and blocklisted nodes, while
            ``[slurm] max_resubmits`` allows
FAIL        anything else: the job ends with the step's exit code
==========  ===================================================================================

:func:`finish` carries the action out through a :class:`SlurmCli` and a node fencer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from trainguard.chaos.faults import CHAOS_ENV
from trainguard.core.config.slurm import SlurmConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.event_kinds import JOB_FINISHED, NODE_DRAINED
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog, read_events
from trainguard.core.failures import (
    DO_NOT_REQUEUE_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    ROLE_BELOW_FLOOR_EXIT_CODE,
)
from trainguard.core.fencing import NodeFencer
from trainguard.slurm.batch import CHAIN_ENV, RESUBMITS_ENV
from trainguard.slurm.cli import SlurmCli, SlurmError
from trainguard.slurm.fencer import SlurmFencer

__all__ = ["FinishAction", "FinishDecision", "decide", "finish", "node_states", "take_over"]


class FinishAction(str, Enum):
    """What the batch script does once ``trainguard run`` returned (:func:`decide`)."""

    DONE = "done"
    """Every node succeeded: exit 0."""
    STOP = "stop"
    """A node asked not to be requeued: exit 93."""
    REQUEUE = "requeue"
    """The workers saved on preemption: exit 75 for the scheduler's requeue."""
    RESUBMIT = "resubmit"
    """Nodes were lost: a new job without them continues from the last checkpoint."""
    FAIL = "fail"
    """The job failed: its exit code."""


@dataclass(frozen=True, slots=True)
class FinishDecision:
    action: FinishAction
    exit_code: int
    lost: list[str] = field(default_factory=list)
    """Nodes of the allocation whose agent never reported the end of its run (killed, crashed,
    node lost): they are drained."""
    exclude: list[str] = field(default_factory=list)
    """``--exclude`` of a resubmission."""
    message: str = ""


def node_states(events: Iterable[dict[str, Any]], since: float) -> dict[str, str]:
    """Each node's last ``job_finished`` state at or after ``since`` (unix seconds)."""
    out: dict[str, str] = {}
    for ev in events:
        if ev.get("kind") == JOB_FINISHED and float(ev.get("time", 0)) >= since:
            out[str(ev.get("node"))] = str(ev.get("state"))
    return out


def drained_by_trainguard(events: Iterable[dict[str, Any]]) -> list[str]:
    """Nodes trainguard drained in this run (``node_drained`` events; ``node`` is the writer)."""
    return sorted(
        {str(e["node_name"]) for e in events if e.get("kind") == NODE_DRAINED and e.get("fenced")}
    )


def decide(
    *,
    rc: int,
    states: dict[str, str],
    allocation: Sequence[str],
    cfg: SlurmConfig,
    resubmits: int,
    unusable: Sequence[str] = (),
    drained_before: Sequence[str] = (),
) -> FinishDecision:
    """The action after the step (see the module doc); ``unusable``: allocated nodes Slurm
    reports down/drained now; ``drained_before``: nodes trainguard drained earlier in the run."""
    lost = sorted({n for n in allocation if n not in states} | set(unusable))
    if any(s == JobState.SUCCEEDED for s in states.values()):
        return FinishDecision(FinishAction.DONE, 0, lost, message="training finished")
    if rc == DO_NOT_REQUEUE_EXIT_CODE or any(s == JobState.DO_NOT_REQUEUE for s in states.values()):
        return FinishDecision(
            FinishAction.STOP,
            DO_NOT_REQUEUE_EXIT_CODE,
            lost,
            message=f"exit code {DO_NOT_REQUEUE_EXIT_CODE}: not requeued",
        )
    if rc == ROLE_BELOW_FLOOR_EXIT_CODE:
        return FinishDecision(
            FinishAction.STOP,
            ROLE_BELOW_FLOOR_EXIT_CODE,
            lost,
            message=f"exit code {ROLE_BELOW_FLOOR_EXIT_CODE}: a role fell below its serving "
            "floor; not requeued",
        )
    if rc == REQUEUE_EXIT_CODE or any(s == JobState.REQUEUE for s in states.values()):
        return FinishDecision(
            FinishAction.REQUEUE,
            REQUEUE_EXIT_CODE,
            lost,
            # the job keeps its id, priority and place; Slurm's wait is the price
            message="preemption checkpoint committed: requeueing the job (Slurm starts it "
            "again only after AuthInfo cred_expire + 1 s, 121 s by default)",
        )
    code = rc if rc != 0 else 1
    if not lost:
        return FinishDecision(
            FinishAction.FAIL, code, message=f"the training failed (exit code {rc})"
        )
    if resubmits >= cfg.max_resubmits:
        return FinishDecision(
            FinishAction.FAIL,
            code,
            lost,
            message=f"lost node(s) {','.join(lost)} and no resubmission left "
            f"({resubmits} of [slurm] max_resubmits = {cfg.max_resubmits} used)",
        )
    exclude = sorted(set(lost) | set(drained_before) | set(cfg.blocklist))
    return FinishDecision(
        FinishAction.RESUBMIT,
        code,
        lost,
        exclude,
        message=f"lost node(s) {','.join(lost)} with no spare left: resubmitting without "
        f"{','.join(exclude)} ({resubmits + 1} of {cfg.max_resubmits})",
    )


def finish(
    *,
    rc: int,
    since: float,
    run_dir: str,
    script: str,
    cfg: SlurmConfig,
    slurm: SlurmCli,
    fencer: NodeFencer,
    env: dict[str, str] | None = None,
    say: Any = print,
) -> int:
    """Decide and act; returns the batch script's exit code."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME") or None
    log = EventLog(run_dir, node=node)
    events = list(read_events(run_dir))
    allocation = slurm.hostnames(env.get("SLURM_JOB_NODELIST", ""))
    # the roles' own nodes run no trainer agent (no job_finished of theirs): not lost for that
    role_nodes = {n for n, _ in envvars.parse_role_nodes(env.get(envvars.SBATCH_ROLE_NODES, ""))}
    allocation = [n for n in allocation if n not in role_nodes]
    try:
        unusable = [n.name for n in slurm.nodes(allocation) if n.unusable] if allocation else []
    except SlurmError:
        unusable = []
    resubmits = int(env.get(RESUBMITS_ENV, "0") or 0)
    d = decide(
        rc=rc,
        states=node_states(events, since),
        allocation=allocation,
        cfg=cfg,
        resubmits=resubmits,
        unusable=unusable,
        drained_before=drained_by_trainguard(events),
    )
    say(f"trainguard: job {job_id}: {d.action.value}: {d.message}")
    if rc == ROLE_BELOW_FLOOR_EXIT_CODE:
        try:
            say(f"trainguard: {RunDir(run_dir).role_below_floor.read_text().strip()}")
        except OSError:  # the line came from the agent's step log
            pass
    already = set(drained_by_trainguard(events))
    for n in (n for n in d.lost if n not in already):  # the agents drain lost nodes at once
        res = fencer.fence(n, f"agent lost in job {job_id} (node failed or unreachable)")
        log.emit("node_drained", node_name=n, fenced=res.fenced, detail=res.detail, job_id=job_id)
        say(f"trainguard: {res.detail}")
    log.emit("slurm_finish", action=d.action.value, rc=rc, job_id=job_id, message=d.message)
    if d.action is FinishAction.REQUEUE:
        try:
            slurm.requeue(job_id)
        except SlurmError as e:
            say(f"trainguard: scontrol requeue {job_id} failed: {e}")
    elif d.action is FinishAction.RESUBMIT:
        _resubmit(slurm, log, env, script, d.exclude, resubmits, job_id, say)
    return d.exit_code


def _resubmit(
    slurm: SlurmCli,
    log: EventLog,
    env: dict[str, str],
    script: str,
    exclude: list[str],
    resubmits: int,
    job_id: str,
    say: Any,
) -> str | None:
    """Submit the chain's batch script again without ``exclude``; the new job id or None."""
    chain = env.get(CHAIN_ENV) or job_id
    extra = [
        f"--exclude={','.join(exclude)}",
        f"--export=ALL,{CHAIN_ENV}={chain},{RESUBMITS_ENV}={resubmits + 1}",
    ]
    try:
        with open(script, encoding="utf-8") as f:
            text = f.read()
        # the new job starts from attempt 0 again: injected faults would fire once more; the
        # job's own variables (and the batch host's) are not the new job's
        clean = {
            k: v
            for k, v in env.items()
            if (not k.startswith(("SLURM_", "SLURMD_", envvars.SBATCH_PREFIX)) or k == "SLURM_CONF")
            and k not in (CHAOS_ENV, envvars.RUN_DIR)
        }
        new_id = slurm.submit(text, extra, env=clean)
    except (OSError, SlurmError) as e:
        say(f"trainguard: resubmission of job {job_id} failed: {e}")
        log.emit("resubmit_failed", job_id=job_id, error=str(e))
        return None
    say(f"trainguard: resubmitted as job {new_id} (--exclude={','.join(exclude)})")
    log.emit("resubmit", job_id=job_id, new_job_id=new_id, exclude=exclude)
    return new_id


def take_over(
    *,
    batch_host: str,
    run_dir: str,
    script: str,
    cfg: SlurmConfig,
    slurm: SlurmCli,
    fencer: NodeFencer,
    env: dict[str, str] | None = None,
    say: Any = print,
) -> bool:
    """The batch host of this job is lost (its batch beacon stood still): do what the batch
    script can no longer do. Exactly one agent of the job acts (the first to create the job's
    takeover file in the shared run directory); it drains the batch host, resubmits the job
    without it (while ``[slurm] max_resubmits`` allows) and cancels this job, which Slurm would
    keep RUNNING without a batch script until its time limit. Returns whether this agent
    acted."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID", "")
    node = env.get("SLURMD_NODENAME") or None
    try:
        fd = os.open(
            os.path.join(run_dir, f"takeover-{job_id}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644
        )
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{node}\n")
    log = EventLog(run_dir, node=node)
    events = list(read_events(run_dir))
    resubmits = int(env.get(RESUBMITS_ENV, "0") or 0)
    exclude = sorted({batch_host} | set(drained_by_trainguard(events)) | set(cfg.blocklist))
    if resubmits < cfg.max_resubmits:
        action = FinishAction.RESUBMIT
        message = (
            f"batch host {batch_host} lost: resubmitting without {','.join(exclude)} "
            f"({resubmits + 1} of {cfg.max_resubmits})"
        )
    else:
        action = FinishAction.FAIL
        message = (
            f"batch host {batch_host} lost and no resubmission left ({resubmits} of "
            f"[slurm] max_resubmits = {cfg.max_resubmits} used)"
        )
    say(f"trainguard: job {job_id}: {action.value}: {message}")
    # Down, not only drained: the job's resources are freed only when all its nodes are done
    # with it, and Slurm finds a dead node itself only after SlurmdTimeout (300 s by default):
    # until then the resubmitted job could not have the job's other nodes.
    reason = SlurmFencer.reason(f"batch host of job {job_id} lost (node failed or unreachable)")
    if cfg.drain == "record":
        fenced, detail = False, f"node {batch_host} not set down (record only): {reason}"
    else:
        try:
            slurm.down(batch_host, reason)
            fenced, detail = True, f"set node {batch_host} down: {reason}"
        except SlurmError as e:
            res = fencer.fence(batch_host, reason)
            fenced, detail = res.fenced, f"could not set node {batch_host} down ({e}); {res.detail}"
    log.emit("node_drained", node_name=batch_host, fenced=fenced, detail=detail, job_id=job_id)
    say(f"trainguard: {detail}")
    log.emit("slurm_finish", action=action.value, rc=None, job_id=job_id, message=message)
    if action is FinishAction.RESUBMIT:
        _resubmit(slurm, log, env, script, exclude, resubmits, job_id, say)
    try:  # this agent ends with it
        slurm.cancel(job_id)
    except SlurmError as e:
        say(f"trainguard: scancel {job_id} failed: {e}")
    return True
