"""Configuration of trainguard.fleet (section [fleet] of trainguard.toml, env TRAINGUARD_FLEET_*).

Example::

    [fleet]
    url = "postgresql://trainguard@db.cluster:5432/fleet"   # default: SQLite under the runs root
    lemon_failures = 3          # a node with 3 ...
    lemon_window_days = 14      # ... hardware-class failures in 14 days is a lemon
    lemon_causes = ["hardware", "sdc"]

The database password is best left out of the URL: libpq's ``PGPASSWORD`` / ``~/.pgpass`` are
read as usual (the URL is redacted in the run's config.json either way); a password in the URL
must be percent-encoded (``%40`` for ``@``, ``%25`` for ``%``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _lemon_causes() -> list[str]:
    return ["hardware", "sdc"]


@dataclass(kw_only=True, slots=True)
class FleetConfig:
    """The ``[fleet]`` section: the node history shared by every job, and lemon nodes."""

    enabled: bool = True
    """Record every node's health verdicts, evictions and attributed failures, and refuse
    lemon nodes at the preflight gate."""
    url: str = ""
    """``postgresql://...`` (psycopg 3: ``pip install trainguard[fleet]``) for a cluster, or
    ``sqlite:///path/fleet.db``; empty: ``<runs_root>/fleet.db`` (SQLite, WAL)."""
    lemon_failures: int = 3
    """A node with this many failures of ``lemon_causes`` within ``lemon_window_days`` (since
    an operator last released it) is refused by every later job. 0: never."""
    lemon_window_days: float = 14.0
    lemon_causes: list[str] = field(default_factory=_lemon_causes)
    """Failure causes that count towards a lemon (``hardware``, ``sdc``: a rank the replicas'
    check named; ``network``, ``transient`` ...)."""
    queue_max: int = 10000
    """Records waiting for an unreachable database; past it the oldest are dropped (counted,
    with a warning). Writes never block training."""
    retry_s: float = 2.0
    """Wait between attempts to reach the database while records wait."""
    flush_timeout_s: float = 5.0
    """At the end of a job, how long the agent waits for waiting records to be written."""
    connect_timeout_s: float = 3.0
    node_role: str = ""
    """Per-node writer identity (PostgreSQL): a role name holding ``{node}``, e.g.
    ``tg_node_{node}``. Set, each agent logs in as its node's role (its password from the
    node's ``~/.pgpass``/``PGPASSFILE`` or a client certificate), the database stamps every
    row with the role that wrote it, and a record counts (lemon verdicts, ``trainguard fleet``,
    the sniff baseline) only when its node's role wrote it. Empty: every writer of the
    database is trusted with every node's history."""
    operator_role: str = "trainguard_operator"
    """With ``node_role``: the role whose releases count (``trainguard fleet release``
    connects as it; grant it INSERT on ``trainguard_releases``, and the node roles none)."""

    # -- sniff tests -------------------------------------------------------------------------
    sniff_interval_s: float = 0.0
    """Sniff tests inside the job, at most this often: in ``tg.step()``, each rank times a
    fixed GEMM on its device and, with ``torch.distributed`` initialised, a small all-reduce
    over the default group; a rank that has become slow is flagged (event
    ``sniff_degraded``), recorded and handled by ``[health] straggler_policy``. 0: off (the
    all-reduce is a collective in the user's group: every rank must call ``tg.step()`` the
    same number of times)."""
    sniff_budget: float = 0.005
    """Share of the training time the sniff tests may take (the interval grows to keep it;
    regular sniffs keep to three quarters of it, confirming sniffs use the rest)."""
    sniff_gemm_size: int = 0
    """Side of the square GEMM (0: 2048 in bf16 on a GPU, 512 in fp32 on a CPU)."""
    sniff_allreduce_kib: int = 64
    """Size of the sniff all-reduce (0: none)."""
    sniff_slow_factor: float = 1.5
    """A rank is slow when its GEMM takes this many times the reference: the median of the
    node's other ranks at the same sniff, or (alone on its node) the fleet's history for the
    same device model and GEMM size."""
    sniff_window: int = 5
    """A rank is flagged when the median of its last this many sniffs is slow (most of them
    were: one outlier is not a flag). When a rank looks slow at a sniff, every rank runs this
    many less one confirming sniffs, ``sniff_interval_s / 3`` apart (within the budget)."""
    sniff_record_s: float = 300.0
    """A rank's sniff results go to the fleet database at most this often (their median; a
    flagged rank at once, and each rank at the end of the attempt)."""

    def __post_init__(self) -> None:
        if self.lemon_failures < 0 or self.lemon_window_days <= 0:
            raise ValueError("lemon_failures must be >= 0 and lemon_window_days > 0")
        if self.queue_max < 1 or self.retry_s <= 0 or self.flush_timeout_s < 0:
            raise ValueError("queue_max must be >= 1, retry_s > 0 and flush_timeout_s >= 0")
        if self.node_role and "{node}" not in self.node_role:
            raise ValueError(
                f"node_role {self.node_role!r} names no node: write {{node}} where the node's "
                "name goes, e.g. 'tg_node_{node}'"
            )
        if self.node_role and not self.url.startswith(("postgresql://", "postgres://")):
            raise ValueError(
                "node_role needs a postgresql:// url (SQLite has no roles: whoever can write "
                "its file is trusted with all of it)"
            )
        if self.sniff_interval_s < 0 or not 0.0 < self.sniff_budget <= 1.0:
            raise ValueError("sniff_interval_s must be >= 0 and sniff_budget in (0, 1]")
        if self.sniff_gemm_size < 0 or self.sniff_allreduce_kib < 0 or self.sniff_record_s < 0:
            raise ValueError("sniff_gemm_size, sniff_allreduce_kib and sniff_record_s must be >= 0")
        if self.sniff_slow_factor <= 1.0 or self.sniff_window < 1:
            raise ValueError("sniff_slow_factor must be > 1 and sniff_window >= 1")
        if self.url and not self.url.startswith(("postgresql://", "postgres://", "sqlite:///")):
            raise ValueError(
                "url must be postgresql://user@host:port/db or sqlite:///path "
                "(empty: SQLite under the runs root)"
            )

    def role_of(self, node: str) -> str:
        """The role of ``node`` (``node_role`` with its name), or '' without ``node_role``."""
        return self.node_role.replace("{node}", node) if self.node_role else ""
