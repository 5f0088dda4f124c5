"""``trainguard slurm status JOB``: one job's nodes, spares, drains, restarts and checkpoint,
from its run directory's events and from Slurm."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.contracts.event_kinds import CHECKPOINT_COMMITTED, LAUNCH, RENDEZVOUS, RESTART
from trainguard.core.events import read_events
from trainguard.slurm.cli import SlurmCli, SlurmError
from trainguard.slurm.fencer import REASON_PREFIX

__all__ = ["JobStatus", "collect", "find_run_dir"]


@dataclass(slots=True)
class JobStatus:
    job_id: str
    state: str = "UNKNOWN"
    run_dir: str | None = None
    allocation: list[str] = field(default_factory=list)
    active: list[str] = field(default_factory=list)
    """Nodes of the newest rendezvous round (training)."""
    spares: list[str] = field(default_factory=list)
    """Allocated nodes whose agent waits outside the round."""
    drained: dict[str, str] = field(default_factory=dict)
    """Node → reason, for nodes trainguard drained (Slurm's reason when it still has one)."""
    requeues: int = 0
    """Slurm's restart count of the job (requeues after preemption)."""
    restarts: int = 0
    """Worker-group restarts inside the job (all nodes' agents, counted once per attempt)."""
    resubmits: list[str] = field(default_factory=list)
    """Job ids this job was resubmitted as."""
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        ck = (
            f"step {self.last_checkpoint_step}" if self.last_checkpoint_step is not None else "none"
        )
        out = [
            f"job {self.job_id}: {self.state}  (run dir {self.run_dir or 'unknown'})",
            f"  active nodes : {','.join(self.active) or '-'}",
            f"  spares       : {','.join(self.spares) or '-'}",
            f"  drained      : {len(self.drained) or '-'}",
        ]
        out += [f"    {n}: {r}" for n, r in sorted(self.drained.items())]
        out += [
            f"  restarts     : {self.restarts} in the job, {self.requeues} Slurm requeue(s)"
            + (f", resubmitted as {','.join(self.resubmits)}" if self.resubmits else ""),
            f"  last checkpoint: {ck}",
        ]
        return out


def find_run_dir(job: dict[str, str], runs_root: str | None = None) -> Path | None:
    """``<runs_root>/job-<id>`` (a link the batch script makes) next to the job's log."""
    job_id = job.get("JobId", "")
    roots = [Path(runs_root)] if runs_root else []
    out = job.get("StdOut")
    if out:
        roots.append(Path(out).parent)
    for root in roots:
        link = root / f"job-{job_id}"
        if link.exists():
            return link.resolve()
    return None


def _from_events(st: JobStatus, events: Iterable[dict[str, Any]]) -> None:
    members: list[str] = []
    attempts: set[int] = set()
    for ev in events:
        kind = ev.get("kind")
        if kind == LAUNCH:
            members = []
        elif kind == RENDEZVOUS and ev.get("members"):
            members = [str(m.get("node")) for m in ev["members"]]
        elif kind == RESTART:
            attempts.add(int(ev.get("attempt", 0)))
        elif kind == CHECKPOINT_COMMITTED:
            st.last_checkpoint_step = int(ev.get("step", 0))
            st.last_checkpoint_time = float(ev.get("time", 0))
        elif kind == "node_drained":
            st.drained[str(ev.get("node_name"))] = str(ev.get("detail", ""))
        elif kind == "resubmit":
            st.resubmits.append(str(ev.get("new_job_id")))
    st.active = members
    st.restarts = len(attempts)


def collect(
    job_id: str, slurm: SlurmCli, *, run_dir: str | None = None, runs_root: str | None = None
) -> JobStatus:
    st = JobStatus(job_id=str(job_id))
    job = slurm.job(job_id)
    if job:
        st.state = job.get("JobState", "UNKNOWN")
        st.requeues = int(job.get("Restarts", "0") or 0)
        try:
            st.allocation = slurm.hostnames(job.get("NodeList", ""))
        except SlurmError:
            st.allocation = []
    rd = Path(run_dir) if run_dir else find_run_dir(job or {"JobId": str(job_id)}, runs_root)
    if rd is not None and rd.is_dir():
        st.run_dir = os.fspath(rd)
        _from_events(st, read_events(rd))
    if st.state not in ("RUNNING", "COMPLETING"):
        st.active = [] if st.state != "COMPLETED" else st.active
    st.spares = [n for n in st.allocation if n not in st.active and n not in st.drained]
    try:
        for n in slurm.nodes(list(st.drained)) if st.drained else []:
            if n.reason.startswith(REASON_PREFIX):
                st.drained[n.name] = f"{n.state}: {n.reason}"
    except SlurmError:
        pass
    return st
