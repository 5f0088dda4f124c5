"""Configuration of trainguard.recovery (section [recovery] of trainguard.toml, env TRAINGUARD_RECOVERY_*).

Example::

    [recovery]
    job_restart_budget = 10      # job-wide restarts (all nodes together); unset: no limit
    backoff_base_s = 1.0         # 2nd restart waits 1 s, 3rd 2 s, 4th 4 s ... (1st: none)
    backoff_cap_s = 60.0
    backoff_reset_s = 300.0      # a failed attempt that ran 5 min restarts at once
    crash_loop_restarts = 3      # stop after 3 restarts without checkpoint progress
    node_failure_limit = 3       # evict a node that failed 3 times ...
    node_failure_window_s = 3600 # ... within an hour
    eviction_cooldown_s = 3600   # an evicted node stays blocklisted this long

``--max-restarts`` keeps torchrun's meaning (per agent) and still applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _stop_errors() -> list[str]:
    return ["ConfigError", "ModuleNotFoundError", "SyntaxError"]


def _stop_codes() -> list[int]:
    return [2]


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """The ``[recovery]`` section: failure → action policy, job-wide restart budget, eviction."""

    job_restart_budget: int | None = None
    """Restarts the job as a whole may make, counted once per failed round however many nodes
    saw it (kept in the rendezvous store); when spent the job stops with exit code 93.
    None: no job-wide limit (torch's per-agent ``--max-restarts`` still applies).
    Flag: ``--tg-restart-budget``."""
    backoff_base_s: float = 1.0
    """Wait before the 2nd job-wide restart; doubled for each one after (the 1st restart is
    immediate)."""
    backoff_cap_s: float = 60.0
    """Upper bound of the wait between restarts."""
    backoff_reset_s: float = 300.0
    """The backoff grows with the restarts made since the job's last checkpoint progress; a
    failed attempt whose workers ran at least this long restarts at once too (a job whose
    checkpoints trainguard does not see, e.g. a plain script, is not a crash loop when it
    fails every few hours). 0: only checkpoint progress resets it."""
    crash_loop_restarts: int = 3
    """Stop (exit 93) after this many job-wide restarts in a row that brought no checkpoint
    progress (the newest committed checkpoint step did not advance). Armed once the job has
    committed a checkpoint. 0: off."""
    node_failure_limit: int = 3
    """Evict a node whose own workers failed (a signal, or an exception that is not a peer's
    loss) this many times within ``node_failure_window_s``. 0: never evict for failures."""
    node_failure_window_s: float = 3600.0
    evict_on_health: bool = True
    """A health ``drain``/``fail`` verdict during the job evicts the node (exit 94, blocklisted);
    off: the node only leaves (exit 1), as before recovery."""
    eviction_cooldown_s: float = 3600.0
    """How long an evicted node stays on the job's blocklist: an agent started on it before
    then refuses to join (exit 94)."""
    stop_on_errors: list[str] = field(default_factory=_stop_errors)
    """Worker exceptions (type name at the start of the error file's message) that are
    configuration errors: restarting cannot help, the job stops with exit code 93."""
    stop_on_exit_codes: list[int] = field(default_factory=_stop_codes)
    """Worker exit codes that mean the same (2: a command-line usage error)."""
    attribution: bool = True
    """Classify each failure (user code, out of memory, hardware, network, data, control
    plane, transient) from the exit, torch's error file (the workers' start-up hook writes one
    for an uncaught exception), the output and the health findings; a deterministic user-code
    error (the same exception at the same place on every rank, or in two failed attempts in a
    row) or an out-of-memory error stops the job (exit 93) without spending restarts."""
    failure_grace_s: float = 2.0
    """After a worker raised, how long its agent lets the other local workers end of their own
    before ending them (they usually raise the same error, or fail their collective, at once):
    their exceptions are evidence too; in a multi-node job, how long an agent whose ranks all
    raised the same user-code error waits for the other nodes' ranks to count theirs in the job
    ledger. 0: end them at once."""
    decision_timeout_s: float = 30.0
    """How long an agent waits for the job-wide decision on a failed round taken by another
    node's agent before taking it itself."""

    def __post_init__(self) -> None:
        if self.job_restart_budget is not None and self.job_restart_budget < 0:
            raise ValueError("job_restart_budget must be >= 0 (or unset for no limit)")
        if self.backoff_base_s < 0 or self.backoff_cap_s < 0 or self.backoff_reset_s < 0:
            raise ValueError("backoff_base_s, backoff_cap_s and backoff_reset_s must be >= 0")
        if self.crash_loop_restarts < 0 or self.node_failure_limit < 0:
            raise ValueError("crash_loop_restarts and node_failure_limit must be >= 0")
        if self.node_failure_window_s <= 0 or self.decision_timeout_s <= 0:
            raise ValueError("node_failure_window_s and decision_timeout_s must be > 0")
        if self.failure_grace_s < 0:
            raise ValueError("failure_grace_s must be >= 0")
        if self.eviction_cooldown_s < 0:
            raise ValueError("eviction_cooldown_s must be >= 0")
