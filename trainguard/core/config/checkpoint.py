"""Configuration of trainguard.checkpoint (section [checkpoint] of trainguard.toml, env TRAINGUARD_CHECKPOINT_*).

Example::

    [checkpoint]
    dir = "/scratch/ckpt/job42"
    every_steps = 500          # persist to disk every 500 steps ...
    every_s = 0.0              # ... or every T seconds (0: off)
    auto_interval = false      # ... or the goodput planner's optimum for the measured costs
    memory_every_steps = 1     # newest state in the node's memory every step
    keep_last = 3
    keep_every_steps = 5000
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    enabled: bool = True
    """Switch the checkpoint component on or off."""
    dir: str | None = None
    """Checkpoint root (a path, or an fsspec URL such as ``s3://bucket/job``); default
    ``<run_dir>/checkpoints``."""

    # -- when ------------------------------------------------------------------------------------
    every_steps: int = 0
    """``maybe_save`` persists to disk every N steps (0: off)."""
    every_s: float = 0.0
    """``maybe_save`` persists to disk when this many seconds passed since the last one (0: off)."""
    auto_interval: bool = False
    """Persist at the goodput planner's optimum disk interval (``trainguard.plan``) for the
    measured stall and commit, the MTBF and the memory tier's share of recoveries, re-evaluated
    as they are measured (Young's sqrt(2 * stall * MTBF) to first order)."""
    mtbf_s: float = 3 * 3600.0
    """Mean time between failures for ``auto_interval`` until failures of this run are observed."""
    auto_min_interval_s: float = 10.0
    """Lower bound of the automatic interval."""
    auto_max_interval_s: float = 3600.0
    """Upper bound of the automatic interval."""
    memory_every_steps: int = 1
    """``maybe_save`` stages into the node's memory tier every N steps when it is present (0: off)."""
    memory_max_stall_fraction: float | None = None
    """Stretch the memory tier's interval beyond ``memory_every_steps`` while its measured stall
    (median of recent snapshots) exceeds this fraction of the measured step time (0: never).
    None: 0.1 for training in ``trainguard.run`` (in-process restarts: every step, so at most
    one step is redone, whenever that costs <= 10 %), 0.01 otherwise (a process restart costs
    far more than a step: every step while that stalls training by <= 1 %)."""

    # -- how -------------------------------------------------------------------------------------
    overlap_staging: bool = True
    """Copy parameters and optimizer state in the background while the next step's forward and
    backward run (they change only in ``optimizer.step()``, which waits for the copy)."""
    in_flight_policy: Literal["wait", "skip"] = "wait"
    """A disk save requested while one is still persisting: wait for it, or skip this one."""
    memory_tier: bool = True
    """Keep the newest staged state in the node agent's shared memory (needs ``trainguard run``)."""
    memory_slots: int = 3
    """Host buffer sets per rank (each the size of the rank's state). One may be persisting to
    disk while another is staged into; the rest keep older snapshots, so that after a node loss
    the survivors and the (slightly lagging) peer replica still share a step. Minimum 2."""
    memory_root: str = "/dev/shm"
    """Where the agent creates the node's memory tier."""
    peer_replication: bool = True
    """Replicate each node's memory tier to the next node's agent."""
    peer_host: str | None = None
    """Address the memory tier's replication server binds to and other agents reach it at;
    default: this host's address on the route to the rendezvous endpoint (127.0.0.1 for a
    local one). Never every interface unless set to ``0.0.0.0`` here."""
    peer_port: int = 0
    """TCP port of the replication server (0: any free port, published in the rendezvous store)."""
    peer_max_header_bytes: int = 4 << 20
    """Largest request/answer header (the snapshot's JSON metadata) accepted from a peer."""
    peer_max_snapshot_bytes: int | None = None
    """Largest snapshot accepted from a peer (> 0); None: only the free space of the tier's
    file system bounds it (always checked, space booked per transfer)."""
    memory_secret_file: str | None = None
    """File holding the memory tier's secret (at least 16 bytes, mode 600; the same file on
    every node, e.g. a mounted secret or one in the job's private directory). Set: the secret
    is never published. None: the first agent creates one and shares it through the
    rendezvous store, where anyone who can read the store can read it."""
    peer_backoff_s: float = 0.5
    """First wait after a failed push to the peer; doubles per consecutive failure."""
    peer_backoff_max_s: float = 60.0
    """Longest wait between pushes to a peer that keeps failing."""
    peer_fetch_timeout_s: float = 30.0
    """Deadline of the fill from peers after a rendezvous (all ranks of the node together);
    a peer that does not answer in time is skipped."""
    verify_checksums: bool = True
    """Verify file checksums against the manifest before loading from disk."""
    sync_files: bool = True
    """fsync every checkpoint file before the commit."""
    persist_mode: Literal["auto", "thread", "process"] = "auto"
    """Where persisting runs: a persister process per rank that maps the staged buffers
    (shared memory, zero copy) and writes them, so that serialisation never holds the
    training process's GIL (``process``), or a background thread of the worker (``thread``).
    ``auto``: the process for a state of 64 MiB or more per rank where every rank can run one
    (started at its first save to disk; the thread persists until it is ready), else the
    thread. The choice and why are logged once per process."""
    persist_timeout_s: float = 1800.0
    """Longest a save may take to persist (the persister's answer, the wait for the save in
    flight): after it the save fails (``checkpoint_failed``, counted), a persister process
    that did not answer is killed and replaced, and training goes on."""
    io_threads: int | None = None
    """Writer threads per rank (DCP FileSystemWriter ``thread_count``; also the checksum
    verification threads of a restore). None: one per 8 cores, 1 to 4. More threads commit
    sooner (1.1 GiB: 2.6 s with 2 vs 4.6 s with 1, idle 2-core box) but take cores from the
    training loop while they run (stall 0.63 s with 2 vs 0.12 s with 1 on that box)."""
    capture_rng: bool = True
    """Save and restore python, numpy and torch (CPU/CUDA) RNG states per rank."""
    collective_timeout_s: float = 600.0
    """Timeout of the checkpoint process group's collectives."""

    # -- retention -------------------------------------------------------------------------------
    keep_last: int = 3
    """Committed checkpoints to keep (the newest committed is never deleted)."""
    keep_every_steps: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""

    # -- preemption ------------------------------------------------------------------------------
    preemption_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that make the worker save at the next step boundary and exit with the requeue code."""

    def __post_init__(self) -> None:
        if self.memory_max_stall_fraction is not None and self.memory_max_stall_fraction < 0:
            raise ValueError("memory_max_stall_fraction must be >= 0")
        for name in ("every_steps", "memory_every_steps", "keep_last", "keep_every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in (
            "every_s",
            "mtbf_s",
            "auto_min_interval_s",
            "auto_max_interval_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.auto_min_interval_s > self.auto_max_interval_s:
            raise ValueError("auto_min_interval_s must be <= auto_max_interval_s")
        if self.keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the newest committed is always kept)")
        if self.in_flight_policy not in ("wait", "skip"):
            raise ValueError("in_flight_policy must be 'wait' or 'skip'")
        if self.memory_slots < 2:
            raise ValueError("memory_slots must be >= 2")
        if self.persist_mode not in ("auto", "thread", "process"):
            raise ValueError("persist_mode must be 'auto', 'thread' or 'process'")
        if self.io_threads is not None and self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")
        if not 0 <= self.peer_port <= 65535:
            raise ValueError("peer_port must be in [0, 65535]")
        if self.peer_max_header_bytes < 1024:
            raise ValueError("peer_max_header_bytes must be >= 1024")
        if self.peer_max_snapshot_bytes is not None and self.peer_max_snapshot_bytes <= 0:
            raise ValueError(
                "peer_max_snapshot_bytes must be > 0 (leave it unset to bound snapshots from "
                "peers by the tier's free space only)"
            )
        for name in (
            "persist_timeout_s",
            "peer_backoff_s",
            "peer_backoff_max_s",
            "peer_fetch_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be > 0")
        import signal

        for name in self.preemption_signals:
            if not hasattr(signal, name):
                raise ValueError(f"preemption_signals: unknown signal {name!r}")


def writer_threads(config: CheckpointConfig) -> int:
    """``config.io_threads``, or its automatic value on this host."""
    if config.io_threads is not None:
        return config.io_threads
    return min(4, max(1, (os.cpu_count() or 1) // 8))
