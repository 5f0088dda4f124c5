"""Configuration of trainguard.slurm (section [slurm] of trainguard.toml, env TRAINGUARD_SLURM_*).

Example::

    [slurm]
    grace_s = 180              # SIGUSR1 this long before the time limit
    max_resubmits = 2          # when spares run out: resubmit, excluding bad nodes, twice
    blocklist = ["gpu-17"]     # never run on these nodes
    drain = "record"           # no operator rights: record the nodes to drain, change nothing
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

# \A...\Z, not ^...$: "$" also matches before a trailing newline, which would end the batch
# script's #SBATCH header early
_NODE = re.compile(r"\A[A-Za-z0-9._\-\[\],]+\Z")
_ENDPOINTS = re.compile(r"\A[A-Za-z0-9._\-\[\]:/,]+\Z")  # host:port[,host:port], http(s)://
_SIGNAL = re.compile(r"\A(SIG)?[A-Z0-9]+\Z")


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    signal: str = "USR1"
    """Preemption signal Slurm sends to every process of the job's steps ``grace_s`` before the
    time limit (``--signal=USR1@grace_s``, without ``B:``); it must be one of the workers'
    ``[checkpoint] preemption_signals``."""
    grace_s: int = 120
    """Seconds between the preemption signal and the time limit: room for one checkpoint save."""
    max_resubmits: int = 2
    """When a job fails for lack of nodes (spares used up), resubmit it this many times, each
    time excluding the drained and blocklisted nodes (0: never)."""
    blocklist: list[str] = field(default_factory=list)
    """Nodes never to run on (``--exclude``), besides those trainguard drained."""
    drain: Literal["drain", "record"] = "drain"
    """``drain``: a failed node is drained (``scontrol update state=drain``); ``record``: it is
    only recorded (users without operator rights)."""
    rdzv_backend: Literal["auto", "c10d", "etcd-v3", "etcd"] = "auto"
    """``etcd-v3`` (``etcd`` is the same): ``--rdzv-backend etcd-v3 --rdzv-endpoint
    <etcd_endpoint>``, trainguard's etcd v3 rendezvous on the cluster's etcd, so the job keeps
    no rendezvous state on one of its own nodes (the production setting); ``c10d``: the
    rendezvous store runs in the agent on the allocation's first node, which no spare can
    replace (zero setup); ``auto``: ``etcd-v3`` when ``etcd_endpoint`` is set, else ``c10d``."""
    etcd_endpoint: str | None = None
    """``host:port`` (comma-separated members) of the cluster's etcd for the rendezvous."""
    rdzv_port: int = 29400
    """Port of the c10d rendezvous store on the first node."""
    max_restarts: int = 3
    """Worker-group restarts per agent (``trainguard run --max-restarts``) when the user gives
    none: a spare can only take over in a restart (torchrun's default, 0, ends the job)."""
    join_timeout_s: int = 600
    """How long agents wait for enough nodes in a rendezvous round before the job fails (and
    is resubmitted when ``max_resubmits`` allows)."""
    batch_dead_after_s: float = 5.0
    """The batch script advances a counter in the run directory every second; when it stood
    still this long (the batch host crashed or lost the shared file system), an agent on
    another node resubmits the job without the batch host and cancels the orphaned one (Slurm
    itself would keep it running without its batch script)."""
    runs_root: str = "trainguard-runs"
    """Parent of the job's run directory ``<runs_root>/slurm-<first job id>`` and its logs
    ``<runs_root>/slurm-<job id>.out`` (relative to the submit directory)."""
    python: str | None = None
    """Python interpreter the nodes run trainguard with (default: the submitting one)."""
    watch: bool = True
    """The batch script runs ``trainguard watch`` on the batch host beside the job step (where
    a pager is configured, ``[alerts]``): it pages when the job goes silent, and when the step
    ends without the agents' final events (every agent killed, the step cancelled)."""

    def __post_init__(self) -> None:
        if not _SIGNAL.match(self.signal):
            raise ValueError(f"signal {self.signal!r}: use a signal name such as USR1")
        if self.grace_s < 0 or self.grace_s > 65535:
            raise ValueError("grace_s must be between 0 and 65535 seconds (Slurm's limit)")
        if self.max_resubmits < 0:
            raise ValueError("max_resubmits must be >= 0")
        for node in self.blocklist:
            if not _NODE.match(node):
                raise ValueError(f"blocklist: {node!r} is not a node name")
        if self.rdzv_backend in ("etcd", "etcd-v3") and not self.etcd_endpoint:
            raise ValueError(
                f'rdzv_backend = "{self.rdzv_backend}" needs etcd_endpoint = "host:port" '
                "(the cluster's etcd)"
            )
        if self.etcd_endpoint is not None and not _ENDPOINTS.match(self.etcd_endpoint):
            raise ValueError(f"etcd_endpoint {self.etcd_endpoint!r}: use host:port[,host:port...]")
        if self.batch_dead_after_s < 3:
            raise ValueError("batch_dead_after_s must be >= 3 (the batch beacon beats every 1 s)")
        if not 0 < self.rdzv_port < 65536:
            raise ValueError("rdzv_port must be a TCP port (1..65535)")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.join_timeout_s <= 0:
            raise ValueError("join_timeout_s must be > 0")

    @property
    def rendezvous(self) -> Literal["c10d", "etcd-v3"]:
        """The backend the batch script uses: ``etcd-v3`` or ``c10d``."""
        if self.rdzv_backend in ("etcd", "etcd-v3"):
            return "etcd-v3"
        if self.rdzv_backend == "auto" and self.etcd_endpoint:
            return "etcd-v3"
        return "c10d"

    @property
    def signal_name(self) -> str:
        """``USR1`` for ``USR1`` or ``SIGUSR1``."""
        return self.signal.removeprefix("SIG")
