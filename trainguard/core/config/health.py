"""Configuration of trainguard.health (section [health] of trainguard.toml, env TRAINGUARD_HEALTH_*).

Example::

    [health]
    dcgm_url = "http://127.0.0.1:9400/metrics"
    expect_gpus = 8
    probe_interval_s = 10.0
    hang_timeout_s = 300.0

    [health.xid_policy]       # XID -> ignore | warn | restart | drain
    "13" = "ignore"

    [health.counter_policy]   # counter/check name -> action (see trainguard.health.policy)
    ecc_dbe_aggregate = "drain"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from trainguard.core.contracts.actions import HealthAction

COUNTER_CHECKS = (
    "gpu_missing",
    "gpu_lost",
    "ecc_dbe_volatile",
    "ecc_dbe_aggregate",
    "row_remap_failure",
    "row_remap_pending",
    "row_remap_uncorrectable",
    "retired_pages_pending",
    "nvlink_errors",
    "pcie_replay",
    "pcie_link_degraded",
    "thermal_throttle",
    "thermal_sustained",
    "dcgm_health",
    "host_disk_low",
    "host_memory_low",
    "rdzv_unreachable",
    "clock_skew",
    "compute_slow",
    "allreduce_slow",
)
"""The checks ``[health.counter_policy]`` may override (trainguard.health.policy maps each to
its default action)."""


def validate_policy_overrides(xid: Mapping[str, str], counters: Mapping[str, str]) -> None:
    """Raise ValueError naming the bad key or value."""
    for key, value in xid.items():
        try:
            int(str(key))
        except ValueError:
            raise ValueError(f"xid_policy: key {key!r} is not an XID number") from None
        HealthAction.parse(value, f"xid_policy[{key}]")
    for key, value in counters.items():
        if key not in COUNTER_CHECKS:
            raise ValueError(
                f"counter_policy: unknown check {key!r}; known: {', '.join(COUNTER_CHECKS)}"
            )
        HealthAction.parse(value, f"counter_policy[{key}]")


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    enabled: bool = True
    """Switch the health component on or off (probes, preflight, hang and straggler detection)."""

    # -- sources -----------------------------------------------------------------------------
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    """dcgm-exporter endpoint. Connection refused at the default URL means "not present"."""
    dcgm_timeout_s: float = 2.0
    """HTTP timeout of one dcgm-exporter scrape."""
    sources: list[str] = field(default_factory=lambda: ["dcgm_exporter", "dcgm", "nvml", "host"])
    """Sources to try, in order; each one that is present on the node contributes."""
    expect_gpus: int | None = None
    """GPUs this node must show; fewer is a fail (a GPU fell off the bus). None: not checked."""

    # -- policy ------------------------------------------------------------------------------
    xid_policy: dict[str, str] = field(default_factory=dict)
    """Overrides of the XID table (``"79" = "drain"``); defaults in trainguard.health.policy."""
    counter_policy: dict[str, str] = field(default_factory=dict)
    """Overrides of the counter/check table (``ecc_dbe_volatile = "drain"``)."""
    unknown_xid_action: str = "warn"
    """Action for an XID the table does not list."""
    xid_escalate_after: int = 3
    """An XID whose action is warn or restart that occurred this many times (counts from
    ``DCGM_EXP_XID_ERRORS_COUNT`` or NVML events) escalates to drain ("watch, then drain";
    "do not drain on the first"). 0 disables."""
    nvlink_error_threshold: int = 100
    """NVLink CRC/replay/recovery errors above which a link is reported."""
    pcie_replay_threshold: int = 100
    """PCIe replays above which a GPU is reported."""
    thermal_temp_c: float = 87.0
    """A thermal clock slowdown at or above this temperature counts as sustained at once."""
    thermal_sustain_samples: int = 3
    """Consecutive samples with a thermal slowdown that count as sustained throttling."""
    min_free_disk_gib: float = 10.0
    """Free space the checkpoint directory needs (check ``host_disk_low``)."""
    min_free_memory_gib: float = 2.0
    """Available host memory the node needs (check ``host_memory_low``)."""
    max_clock_skew_s: float = 2.0
    """Clock difference to the other nodes above which ``clock_skew`` is reported."""
    checkpoint_dir: str | None = None
    """Directory whose free space is checked; default: the run directory."""

    # -- preflight and in-job probing --------------------------------------------------------
    preflight: bool = True
    """Probe the node (and run the compute probe) before every rendezvous."""
    preflight_policy: Literal["report", "exclude"] = "report"
    """``exclude``: a node whose preflight fails (or is too slow) keeps out of the job."""
    preflight_compute_s: float = 1.0
    """Duration of the GEMM compute probe; 0 disables it."""
    preflight_compute_cpu: bool = False
    """Also run the compute probe on nodes without a GPU (it then times a CPU GEMM). Off by
    default: a CPU-only node has no accelerator to vet, and the probe would delay every launch."""
    min_compute_fraction: float = 0.5
    """A node below this fraction of the device peak (GPU) or of the nodes' median is slow."""
    allreduce_probe: bool = False
    """After a multi-node rendezvous, measure all-reduce bandwidth across the nodes (a child
    process per node; NCCL on GPU, gloo on CPU). Off by default: it adds seconds per attempt."""
    allreduce_probe_mb: float = 64.0
    """Buffer size of the all-reduce probe."""
    min_allreduce_busbw_gbps: float | None = None
    """Bus bandwidth below which ``allreduce_slow`` is reported. None: only measured."""
    probe_interval_s: float = 10.0
    """Seconds between in-job probes, run by the agent in a background thread; 0 disables."""

    # -- hang detection ----------------------------------------------------------------------
    hang_detection: bool = True
    """Watch worker progress and end a hung worker group."""
    hang_timeout_s: float | None = None
    """No step progress for this long is a hang. None: max(hang_min_timeout_s,
    hang_step_factor x median step time after warm-up)."""
    hang_min_timeout_s: float = 60.0
    """Lower bound of the automatic hang timeout."""
    hang_step_factor: float = 5.0
    """The automatic hang timeout is this many median step times (when above the minimum)."""
    hang_warmup_steps: int = 3
    """Steps ignored when computing the median step time (compilation, caches)."""
    hang_idle_timeout_s: float = 1800.0
    """Timeout for a rank that is alive (fresh heartbeat) but between steps or before its first
    step: loading, evaluation, checkpointing, teardown."""
    heartbeat_stale_s: float | None = None
    """Heartbeat age that means a frozen process. None: max(3 x heartbeat interval, 2 s)."""
    collective_timeout_s: float | None = None
    """The process-group timeout the script passes to ``init_process_group`` (None: torch's
    default, 30 min), declared so that ``trainguard run`` can check the timeout chain
    (trainguard.core.timeouts); trainguard does not change the script's groups."""
    collective_poll_interval_s: float = 0.25
    """How often a worker's collective watcher reads its flight recorder (progress of ranks
    that never call ``tg.step()``, and dump requests on a hang)."""
    hang_diagnosis: bool = True
    """On a hang, collect every rank's flight-recorder trace and stacks (all nodes) before
    anything is killed, and name the collective the job is stuck in."""
    hang_diagnosis_timeout_s: float = 5.0
    """Time budget of that collection (every node's ranks) before the hung group is killed."""
    stack_dump: bool = True
    """Dump every local rank's Python stack (py-spy, else faulthandler) on a hang."""
    stack_dump_timeout_s: float = 10.0
    """Time budget of the stack dump before the hung group is killed."""

    # -- straggler detection -----------------------------------------------------------------
    straggler_detection: bool = True
    """Score each rank's step times against the median and report persistent stragglers."""
    straggler_threshold: float = 0.2
    """Score at or above which a rank is slow (0.2 = 25 % slower than the median)."""
    straggler_window: int = 10
    """Steps per rank in the rolling window a score is computed from."""
    straggler_warmup_steps: int = 3
    """Steps ignored at the start of each attempt."""
    straggler_patience: int = 5
    """Consecutive evaluations above the threshold before a straggler is reported."""
    straggler_min_delta_s: float = 0.05
    """A rank is slow only if it is also this many seconds above the others' median (timing
    noise of millisecond steps is not a straggler)."""
    straggler_policy: Literal["report", "exclude"] = "report"
    """``exclude``: a node with a persistent straggler among its ranks leaves the job (event
    ``node_excluded``): a single-node job fails, an elastic one carries on without it."""

    def __post_init__(self) -> None:
        for name in ("dcgm_timeout_s", "preflight_compute_s", "probe_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.xid_escalate_after < 0:
            raise ValueError("xid_escalate_after must be >= 0 (0 disables)")
        if self.expect_gpus is not None and self.expect_gpus < 0:
            raise ValueError("expect_gpus must be >= 0")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise ValueError("hang_timeout_s must be > 0 (or unset for automatic)")
        if self.hang_min_timeout_s <= 0 or self.hang_step_factor <= 0:
            raise ValueError("hang_min_timeout_s and hang_step_factor must be > 0")
        if not 0.0 < self.straggler_threshold < 1.0:
            raise ValueError("straggler_threshold must be in (0, 1)")
        if self.straggler_window < 2 or self.straggler_patience < 1:
            raise ValueError("straggler_window must be >= 2 and straggler_patience >= 1")
        if self.straggler_policy not in ("report", "exclude"):
            raise ValueError("straggler_policy must be 'report' or 'exclude'")
        if not 0.0 <= self.min_compute_fraction <= 1.0:
            raise ValueError("min_compute_fraction must be in [0, 1]")
        HealthAction.parse(self.unknown_xid_action, "unknown_xid_action")
        if self.preflight_policy not in ("report", "exclude"):
            raise ValueError("preflight_policy must be 'report' or 'exclude'")
        unknown = set(self.sources) - {"dcgm_exporter", "dcgm", "nvml", "host"}
        if unknown:
            raise ValueError(f"unknown health sources {sorted(unknown)}")
        validate_policy_overrides(self.xid_policy, self.counter_policy)
