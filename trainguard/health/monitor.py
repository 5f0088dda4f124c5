"""The health agent plugin: preflight gate before rendezvous, cross-node comparison after it,
and in-job probing every ``probe_interval_s`` on a background thread of the agent (never in
the training processes).

Events: ``preflight`` (node verdict + compute probe), ``node_excluded`` (preflight policy
``exclude`` kept the node out), ``preflight_compare`` (compute and clock across nodes),
``health_probe`` (in-job verdict, emitted when it changes), ``health_unhealthy`` (an in-job
finding whose action is restart or drain: the node's workers are SIGKILLed, so the group fails
and restarts, or the job fails when no restarts are left).

With ``allreduce_probe`` on, a multi-node rendezvous is followed by an all-reduce bandwidth
probe across the nodes (event ``allreduce_probe``); it measures the group, it does not say
which node's link is slow.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

from trainguard.core.config.health import HealthConfig
from trainguard.core.plugin import AgentContext, AgentPlugin, NodeUnhealthyError
from trainguard.core.storeutil import gather
from trainguard.health.compute import ComputeResult
from trainguard.health.node import NodeProbe, NodeReport, build_sources
from trainguard.health.policy import Policy
from trainguard.health.result import HealthAction, ProbeResult, Status

if TYPE_CHECKING:
    from torch.distributed import Store

    from trainguard.health.compute import ComputeResult

__all__ = ["HealthMonitor", "exchange_node_values"]

logger = logging.getLogger(__name__)


def exchange_node_values(
    store: Store,
    *,
    prefix: str,
    group_rank: int,
    world_size: int,
    value: dict[str, Any],
    timeout_s: float = 30.0,
    skip: set[int] | frozenset[int] = frozenset(),
) -> dict[int, dict[str, Any]]:
    """Publish this node's ``value`` (plus its wall clock) in ``store`` and read every node's.

    All nodes call it right after the same rendezvous, so the clocks they publish were read
    within the rendezvous' exit spread of each other: good enough to flag skew of seconds.
    Nodes that publish nothing by the deadline (dead, or not trainguard agents) are left out.
    """
    value = dict(value, wall_time=time.time())
    store.set(f"{prefix}/{group_rank}", json.dumps(value))
    keys = [f"{prefix}/{r}" for r in range(world_size) if r not in skip]
    got = gather(store, keys, timeout_s=timeout_s)
    if len(got) < 2 <= world_size:
        raise TimeoutError(f"no other node published {prefix}/* within {timeout_s:g} s")
    return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in got.items()}


def compare_nodes(
    values: dict[int, dict[str, Any]], *, min_fraction: float, max_skew_s: float
) -> dict[str, Any]:
    """Slow nodes (below ``min_fraction`` of the median compute) and clock skew per node."""
    flops = {r: v["flops_per_s"] for r, v in values.items() if v.get("flops_per_s")}
    median = statistics.median(flops.values()) if flops else None
    slow = sorted(r for r, f in flops.items() if median and f < min_fraction * median)
    clocks = {r: v["wall_time"] for r, v in values.items()}
    mid = statistics.median(clocks.values())
    skew = {r: round(t - mid, 3) for r, t in clocks.items()}
    return {
        "median_flops_per_s": median,
        "flops_per_s": flops,
        "slow_nodes": slow,
        "clock_skew_s": skew,
        "skewed_nodes": sorted(r for r, s in skew.items() if abs(s) > max_skew_s),
    }


class HealthMonitor(AgentPlugin):
    name = "health"

    def __init__(
        self,
        cfg: HealthConfig,
        *,
        run_dir: Path,
        rdzv_endpoint: str | None = None,
        checkpoint_dir: str | None = None,
        probe: NodeProbe | None = None,
    ) -> None:
        self.cfg = cfg
        self.policy = Policy.from_overrides(
            cfg.xid_policy, cfg.counter_policy, cfg.unknown_xid_action
        )
        self.probe = probe or NodeProbe(
            build_sources(
                cfg,
                policy=self.policy,
                checkpoint_dir=checkpoint_dir or cfg.checkpoint_dir or run_dir,
                rdzv_endpoint=rdzv_endpoint,
            )
        )
        self._lock = threading.Lock()  # one probe at a time (NVML handles are shared)
        self.compute: ComputeResult | None = None
        self.latest: NodeReport | None = None
        self.num_probes = 0
        self._acted: set[tuple[str, str | None]] = set()
        self._pending: tuple[HealthAction, list[str]] | None = None
        self._last_status: Status | None = None
        self._events: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- preflight ---------------------------------------------------------------------------
    def run_probe(self) -> NodeReport:
        with self._lock:
            report = self.probe.probe()
        self.num_probes += 1
        self.latest = report
        return report

    def _compute_probe(self) -> ProbeResult:
        res = ProbeResult(source="compute")
        try:
            c = run_gemm_probe_in_child(self.cfg.preflight_compute_s)
        except Exception as e:
            logger.warning("compute probe failed: %s", e)
            return ProbeResult.unknown("compute", f"compute probe failed: {e}")
        self.compute = c
        res.details.update(c.to_dict())
        frac = c.fraction_of_peak
        if frac is not None and frac < self.cfg.min_compute_fraction:
            res.add(
                self.policy.finding(
                    "compute_slow",
                    f"GEMM {c.flops_per_s / 1e12:.1f} TFLOP/s is {frac:.0%} of the device's "
                    f"{c.peak_flops_per_s / 1e12:.0f} TFLOP/s bf16 peak",  # type: ignore[operator]
                )
            )
        return res

    def before_rendezvous(self, ctx: AgentContext) -> None:
        self._events = ctx.events
        if not self.cfg.preflight:
            return
        t0 = time.monotonic()
        report = self.run_probe()
        if (
            self.cfg.preflight_compute_s > 0
            and self.compute is None
            and (self.cfg.preflight_compute_cpu or _gpu_visible())
        ):
            report.extra.append(self._compute_probe())
        ctx.events.emit(
            "preflight",
            **report.summary(),
            note=report.note(),
            compute=self.compute.to_dict() if self.compute else None,
            duration_s=round(time.monotonic() - t0, 3),
        )
        self._last_status = report.status
        if report.status is Status.FAIL and self.cfg.preflight_policy == "exclude":
            ctx.events.emit("node_excluded", reasons=report.reasons, action=report.action.value)
            raise NodeUnhealthyError(
                f"node {ctx.events.node} failed its preflight: " + "; ".join(report.reasons)
            )

    def after_rendezvous(self, ctx: AgentContext, group: WorkerGroup) -> None:
        world = group.group_world_size or 1
        store = getattr(group, "store", None)
        foreign = set(ctx.foreign_ranks)
        if world - len(foreign) < 2 or store is None or not self.cfg.preflight:
            return
        value: dict[str, Any] = {"node": ctx.events.node}
        if self.compute is not None:
            value["flops_per_s"] = self.compute.flops_per_s
        try:
            values = exchange_node_values(
                store,
                prefix=f"trainguard/health/preflight/{max(ctx.attempt, 0)}",
                group_rank=group.group_rank or 0,
                world_size=world,
                value=value,
                skip=foreign,
            )
        except Exception as e:
            logger.warning("cross-node preflight comparison skipped: %s", e)
            return
        cmp = compare_nodes(
            values, min_fraction=self.cfg.min_compute_fraction, max_skew_s=self.cfg.max_clock_skew_s
        )
        me = group.group_rank or 0
        names = {r: v.get("node") for r, v in values.items()}
        ctx.events.emit(
            "preflight_compare",
            nodes={str(r): n for r, n in names.items()},
            **{
                k: ({str(r): x for r, x in v.items()} if isinstance(v, dict) else v)
                for k, v in cmp.items()
            },
        )
        if self.cfg.allreduce_probe:
            self._allreduce(ctx, group, world)
        if me in cmp["slow_nodes"] and self.cfg.preflight_policy == "exclude":
            ctx.events.emit("node_excluded", reasons=["compute below the nodes' median"])
            raise NodeUnhealthyError(f"node {ctx.events.node} is slower than its peers")

    def _allreduce(self, ctx: AgentContext, group: WorkerGroup, world: int) -> None:
        from trainguard.health.allreduce import run_allreduce_probe

        if not group.master_addr or not group.master_port:
            return
        res = run_allreduce_probe(
            master_addr=group.master_addr,
            master_port=group.master_port,
            rank=group.group_rank or 0,
            world_size=world,
            prefix=f"trainguard/health/allreduce/{max(ctx.attempt, 0)}/",
            size_mb=self.cfg.allreduce_probe_mb,
        )
        floor = self.cfg.min_allreduce_busbw_gbps
        slow = floor is not None and "busbw_gbps" in res and res["busbw_gbps"] < floor
        ctx.events.emit(
            "allreduce_probe",
            **res,
            nodes=world,
            status="warn" if slow or "error" in res else "ok",
            action=self.policy.counters["allreduce_slow"].value if slow else "ignore",
        )

    # -- in-job probing ----------------------------------------------------------------------
    def on_workers_started(self, ctx: AgentContext, group: WorkerGroup) -> None:
        self._events = ctx.events
        if self.cfg.probe_interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="trainguard-health-probe", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.probe_interval_s):
            try:
                self._probe_once()
            except Exception:  # probes never take the agent down
                logger.exception("in-job health probe failed")

    def _probe_once(self) -> None:
        report = self.run_probe()
        if report.status is not self._last_status and self._events is not None:
            self._events.emit(
                "health_probe", **report.summary(), previous=_value(self._last_status)
            )
        self._last_status = report.status
        fresh = [
            f
            for r in report.counted
            for f in r.findings
            if f.action in (HealthAction.RESTART, HealthAction.DRAIN)
            and (f.check, f.gpu) not in self._acted
        ]
        if fresh:
            self._acted.update((f.check, f.gpu) for f in fresh)
            action = max((f.action for f in fresh), key=lambda a: a.severity)
            self._pending = (action, [f.reason for f in fresh])

    def on_monitor(
        self, ctx: AgentContext, group: WorkerGroup, result: RunResult
    ) -> RunResult | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        action, reasons = pending
        from trainguard.health.hang import kill_workers, local_worker_pids

        logger.error("node %s unhealthy (%s): %s", ctx.events.node, action.value, reasons)
        pids = local_worker_pids(ctx, group)
        ctx.events.emit(
            "health_unhealthy", action=action.value, reasons=reasons, ranks=sorted(pids)
        )
        kill_workers(pids)
        if action is HealthAction.DRAIN:
            # A node to drain must not run the job again: it leaves (the launcher keeps the
            # rendezvous open for the others; a spare, or the recovery policy, takes over).
            ctx.events.emit("node_excluded", reason="health", action=action.value, reasons=reasons)
            raise NodeUnhealthyError(
                f"node {ctx.events.node} must be drained: " + "; ".join(reasons)
            )
        return None  # restart: the killed group surfaces as FAILED and restarts in place

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self.probe.close()


def _value(status: Status | None) -> str | None:
    return None if status is None else status.value


def _gpu_visible() -> bool:
    """Whether this node has a CUDA GPU (asked without creating a CUDA context)."""
    import torch

    return torch.cuda.is_available()


_PROBE_CODE = (
    "import dataclasses, json, sys\n"
    "from trainguard.health.compute import gemm_probe\n"
    "print(json.dumps(dataclasses.asdict(gemm_probe(float(sys.argv[1])))))\n"
)


def run_gemm_probe_in_child(duration_s: float) -> ComputeResult:
    """The GEMM probe in a child process, so the agent never holds a CUDA context (and its
    GPU memory) for the rest of the job."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE_CODE, str(duration_s)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60 + 20 * duration_s,
        check=False,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"compute probe exited {out.returncode}: {tail}")
    return ComputeResult(**json.loads(out.stdout.strip().splitlines()[-1]))
