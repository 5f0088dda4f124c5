"""The node agent's telemetry plugin.

It tails the JSON records its local workers append to ``<run_dir>/metrics/rank_<r>.jsonl``
and the run's ``events.jsonl``, maps them onto the metric contract, and exports through:
the JSONL files (always), ``/metrics`` on 127.0.0.1 (one port per node), and OTLP when
configured. Everything runs on the agent's own threads: workers never open a port, and a
failing exporter is counted, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.telemetry import TelemetryConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.event_kinds import SLURM_SCHEDULE, SNIFF_RESULTS
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import MSG_STRAGGLER_SCORES
from trainguard.core.goodput import GoodputTracker
from trainguard.core.jsonl import JsonlTail
from trainguard.core.plugin import AgentContext, AgentPlugin

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from trainguard.core.failures import WorkerFailure
    from trainguard.telemetry.prometheus import PrometheusBridge, PrometheusEndpoint
    from trainguard.telemetry.recorder import MetricsRecorder
    from trainguard.telemetry.tracing import AgentTracer

__all__ = ["TelemetryPlugin", "create_telemetry_plugin"]

logger = logging.getLogger(__name__)


def _resource_attrs(ctx: AgentContext) -> dict[str, Any]:
    node = ctx.node
    attrs: dict[str, Any] = {
        "service.name": "trainguard",
        "host.name": node,
        "trainguard.run_id": ctx.run_dir.name,
        "trainguard.job_id": ctx.run_id,
        "trainguard.node": node,
    }
    if os.environ.get("SLURM_JOB_ID"):
        attrs["slurm.job_id"] = os.environ["SLURM_JOB_ID"]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("NVIDIA_VISIBLE_DEVICES")
    if gpus and "GPU-" in gpus:
        attrs["gpu.uuids"] = gpus
    else:
        uuids = _gpu_uuids()
        if uuids:
            attrs["gpu.uuids"] = ",".join(uuids)
    return attrs


def _gpu_uuids() -> list[str]:
    """UUIDs of this node's GPUs from ``nvidia-smi`` (none when absent or slow)."""
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=5, check=False,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip().startswith("GPU-")]


class TelemetryPlugin(AgentPlugin):
    name = "telemetry"

    # Built by _build (on a thread with background=True); every hook first waits in _ready().
    meter_provider: MeterProvider
    recorder: MetricsRecorder
    tracer: AgentTracer
    bridge: PrometheusBridge | None
    """The Prometheus reader (``[telemetry] prometheus``), served by ``endpoint``."""
    endpoint: PrometheusEndpoint | None
    otlp: tuple[str, str] | None
    """(endpoint, protocol) of the OTLP export, when configured."""

    def __init__(self, ctx: AgentContext, *, background: bool = False) -> None:
        """``background=True`` builds the providers on a thread, overlapping the agent's
        rendezvous, so telemetry adds nothing to launch-to-first-step; hooks wait for it."""
        self.ctx = ctx
        self.cfg: TelemetryConfig = ctx.config.telemetry
        self._traceparent: str | None = None
        self.run_dir = ctx.run_dir
        self.node = ctx.node
        self.export_failures: dict[str, int] = {}
        self._lock = threading.Lock()  # export_failures (exporter threads)
        self._state_lock = threading.RLock()  # poll thread vs the agent's hooks
        self._ranks: set[int] = set()
        self._tails: dict[int, JsonlTail] = {}
        self._events_tail = JsonlTail(RunDir(self.run_dir).events)
        self._events: list[dict[str, Any]] = []
        self._goodput = GoodputTracker()
        self._last_goodput = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scores: dict[str, Any] | None = None  # latest from the bus, not yet recorded
        ctx.events.subscribe(self._on_scores, kinds=[MSG_STRAGGLER_SCORES])
        self._sniffs: dict[str, Any] | None = None  # latest from the bus, not yet recorded
        ctx.events.subscribe(self._on_sniffs, kinds=[SNIFF_RESULTS])
        self._round_start_ns: int | None = None
        # what the build creates (meter_provider, recorder, tracer) is unset until it did;
        # close() stops whatever exists
        self.endpoint: PrometheusEndpoint | None = None
        self._builder: threading.Thread | None = None
        self._build_error: BaseException | None = None
        self._built = threading.Event()
        if background:
            self._builder = threading.Thread(
                target=self._build_in_background, name="tg-telemetry-init", daemon=True
            )
            self._builder.start()
        else:
            self._build()
            self._built.set()

    def _build_in_background(self) -> None:
        try:
            self._build()
        except BaseException as e:  # telemetry never stops a launch: hooks become no-ops
            self._build_error = e
            logger.exception("telemetry disabled for this run: the agent plugin failed to start")
        finally:
            self._built.set()

    def _ready(self, timeout: float = 60.0) -> bool:
        """Wait for a background build; False when it failed or timed out."""
        if not self._built.wait(timeout):
            logger.warning("telemetry still starting after %.0f s; skipping a hook", timeout)
            return False
        return self._build_error is None

    # -- build (the OTel SDK is imported here, off the launch path) ----------------------------
    def _build(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource

        from trainguard.telemetry.tracing import AgentTracer

        resource = Resource.create(_resource_attrs(self.ctx))
        RunDir(self.run_dir).telemetry.mkdir(parents=True, exist_ok=True)
        readers, processors = self._exporters()
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self.recorder = self._recorder(resource.attributes)
        self.tracer = AgentTracer(
            run_id=str(resource.attributes["trainguard.job_id"]),
            node=self.node,
            resource=resource,
            processors=processors,
        )
        self.endpoint = self._open_endpoint()

    def _exporters(self) -> tuple[list[Any], list[Any]]:
        """Metric readers and span processors: JSONL always, the Prometheus bridge and OTLP
        as configured; every exporter counts its failures."""
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from trainguard.telemetry import exporters as ex
        from trainguard.telemetry.prometheus import PrometheusBridge

        cfg, rd, failed = self.cfg, RunDir(self.run_dir), self._on_export_failure
        interval_ms = cfg.export_interval_s * 1000
        jsonl_metrics = ex.JsonlMetricExporter(rd.telemetry_file("metrics", self.node))
        jsonl_spans = ex.JsonlSpanExporter(rd.telemetry_file("traces", self.node))
        readers: list[Any] = [
            PeriodicExportingMetricReader(
                ex.CountingMetricExporter(jsonl_metrics, "jsonl", failed),
                export_interval_millis=interval_ms,
            )
        ]
        processors: list[Any] = [
            SimpleSpanProcessor(ex.CountingSpanExporter(jsonl_spans, "jsonl", failed))
        ]
        self.bridge = PrometheusBridge() if cfg.prometheus else None
        if self.bridge is not None:
            readers.append(self.bridge)
        self.otlp = ex.resolve_otlp(cfg.otlp_endpoint, cfg.otlp_protocol)
        built = (
            ex.build_otlp_exporters(*self.otlp, timeout_s=cfg.otlp_timeout_s)
            if self.otlp is not None
            else None
        )
        if built is not None:
            span_exp, metric_exp = built
            readers.append(
                PeriodicExportingMetricReader(
                    ex.CountingMetricExporter(metric_exp, "otlp_metrics", failed),
                    export_interval_millis=interval_ms,
                    export_timeout_millis=cfg.otlp_timeout_s * 1000,
                )
            )
            processors.append(
                BatchSpanProcessor(
                    ex.CountingSpanExporter(span_exp, "otlp_traces", failed),
                    schedule_delay_millis=interval_ms,
                    export_timeout_millis=cfg.otlp_timeout_s * 1000,
                )
            )
        return readers, processors

    def _recorder(self, ra: Any) -> MetricsRecorder:
        from trainguard.telemetry.mfu import PeakResolver
        from trainguard.telemetry.recorder import MetricsRecorder

        cfg = self.cfg
        recorder = MetricsRecorder(
            self.meter_provider,
            node=self.node,
            peak=PeakResolver(override=cfg.peak_flops, device_name=cfg.device_name),
            flops_per_step=cfg.flops_per_step,
        )
        recorder.export_failure("jsonl", 0)  # exported from 0, like the other counters
        recorder.run_info(
            run_id=str(ra["trainguard.run_id"]),
            job_id=str(ra["trainguard.job_id"]),
            slurm_job_id=str(ra.get("slurm.job_id", "")),
        )
        return recorder

    def _open_endpoint(self) -> PrometheusEndpoint | None:
        """This node's ``/metrics`` (127.0.0.1 by default), announced in the run directory."""
        from trainguard.telemetry.prometheus import PrometheusEndpoint, endpoint_file

        if self.bridge is None:
            return None
        try:
            endpoint = PrometheusEndpoint(
                self.bridge, host=self.cfg.prometheus_host, port=self.cfg.prometheus_port
            )
        except OSError as e:
            logger.warning("no metrics endpoint for node %s: %s", self.node, e)
            return None
        self.endpoint = endpoint  # from here on close() stops it, whatever fails next
        try:
            endpoint.write(endpoint_file(self.run_dir, self.node))
        except OSError as e:
            logger.warning("no metrics endpoint for node %s: %s", self.node, e)
            self.endpoint = None
            endpoint.close()
            return None
        logger.info("metrics of node %s at %s", self.node, endpoint.url)
        return endpoint

    # -- export failure accounting -----------------------------------------------------------
    def _on_export_failure(self, exporter: str) -> None:
        with self._lock:
            self.export_failures[exporter] = self.export_failures.get(exporter, 0) + 1
        self.recorder.export_failure(exporter)

    # -- tailing -----------------------------------------------------------------------------
    def poll(self) -> None:
        """Read and map every new record and event (also called by tests)."""
        if not self._ready():
            return
        with self._state_lock:
            self._poll()

    def _poll(self) -> None:
        ref = min(self._ranks) if self._ranks else 0
        for ev in self._events_tail.read():
            if ev.get("node") != self.node and ev.get("kind") != SLURM_SCHEDULE:
                self.recorder.fleet_event(ev)  # (the scheduler's share is every node's)
                continue
            self._events.append(ev)
            ckpt = str(ev.get("kind", "")).startswith("checkpoint")
            if not ckpt or ev.get("rank", ref) == ref:
                self.recorder.event(ev)
            self.tracer.event(ev)
        for rank in sorted(self._ranks):
            tail = self._tails.setdefault(rank, JsonlTail(RunDir(self.run_dir).metrics(rank)))
            for rec in tail.read():
                kind = rec.get("kind")
                if kind == "span":
                    self.tracer.worker_span(rec)
                    continue
                self.recorder.record(rec)
                if rank == ref:
                    self._goodput.add(rec)
        scores, self._scores = self._scores, None
        if scores is not None:
            self.recorder.straggler_scores(scores)
        sniffs, self._sniffs = self._sniffs, None
        if sniffs is not None:
            self.recorder.sniff_slowdowns(sniffs)
        now = time.time()
        if now - self._last_goodput >= self.cfg.export_interval_s / 2:
            self._last_goodput = now
            self.update_goodput(now)

    def _on_scores(self, msg: dict[str, Any]) -> None:
        """Bus listener (the straggler detector's thread): the next poll records them."""
        scores = msg.get("scores")
        if isinstance(scores, dict):
            self._scores = scores

    def _on_sniffs(self, msg: dict[str, Any]) -> None:
        """Bus listener (the fleet plugin's sniff results): the next poll records them."""
        results = msg.get("results")
        if isinstance(results, dict):
            self._sniffs = results

    def update_goodput(self, now: float | None = None) -> Any:
        g = self._goodput.result(self._events, now=now)
        self.recorder.goodput(g)
        return g

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.poll_interval_s):
            try:
                self.poll()
            except Exception:
                logger.exception("telemetry poll failed")

    # -- hooks -------------------------------------------------------------------------------
    def worker_env(self, ctx: AgentContext) -> dict[str, str]:
        """The attempt's trace context: the workers' spans join it."""
        return {envvars.TRACEPARENT: self._traceparent} if self._traceparent else {}

    def before_rendezvous(self, ctx: AgentContext) -> None:
        if not self._built.is_set():  # still building: open the round span when it is done
            self._round_start_ns = time.time_ns()
            return
        if not self._ready():
            return
        with self._state_lock:
            self.tracer.begin_round()

    def after_rendezvous(self, ctx: AgentContext, group: WorkerGroup) -> None:
        if not self._ready():
            return
        if self._round_start_ns is not None:
            with self._state_lock:
                self.tracer.begin_round(start_time=self._round_start_ns)
            self._round_start_ns = None

        world = group.workers[0].world_size if group.workers else 1
        with self._state_lock:
            self.recorder.world_size = world
            self._ranks.update(w.global_rank for w in group.workers)
            for w in group.workers:
                self.tracer.local_ranks[w.global_rank] = getattr(w, "local_rank", None)
            tp = self.tracer.begin_attempt(
                ctx.attempt, group_rank=group.group_rank or 0, world_size=world
            )
        self._traceparent = tp  # the workers' spans join the attempt's (worker_env)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tg-telemetry", daemon=True)
            self._thread.start()

    def on_failure(self, ctx: AgentContext, failures: list[WorkerFailure]) -> None:
        if not self._ready():
            return
        with self._state_lock:
            self.tracer.failure(failures)

    def on_finish(self, ctx: AgentContext, state: str) -> None:
        if not self._ready():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.poll()
        except Exception:
            logger.exception("final telemetry poll failed")
        with self._state_lock:
            g = self.update_goodput()
            self.tracer.finish(state)
        self._write_summary(state, g)

    def _write_summary(self, state: str, g: Any) -> None:
        path = RunDir(self.run_dir).telemetry_file("summary", self.node)
        with self._lock:
            failures = dict(self.export_failures)
        info = {
            "node": self.node,
            "state": state,
            "export_failures": failures,
            "otlp": list(self.otlp) if self.otlp else None,
            "prometheus_url": self.endpoint.url if self.endpoint else None,
            "goodput": g.to_dict(),
            "bad_records": self.recorder.num_bad_records,
        }
        try:
            write_atomic(path, json.dumps(info, indent=2) + "\n")
        except OSError as e:
            logger.warning("could not write %s: %s", path, e)

    def close(self) -> None:
        """Stop what the build started, all of it also after a build that failed partway."""
        self._built.wait(60.0)
        self._stop.set()
        parts: tuple[AgentTracer | MeterProvider | None, ...] = (
            getattr(self, "tracer", None),
            getattr(self, "meter_provider", None),
        )
        for part in parts:
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception:
                logger.exception("telemetry shutdown step failed")
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self._build_error is not None:
            return
        # export failures during shutdown land in the summary too
        summary = RunDir(self.run_dir).telemetry_file("summary", self.node)
        try:
            info = json.loads(summary.read_text())
            with self._lock:
                info["export_failures"] = dict(self.export_failures)
            write_atomic(summary, json.dumps(info, indent=2) + "\n")
        except (OSError, ValueError):
            pass


def create_telemetry_plugin(ctx: AgentContext) -> TelemetryPlugin | None:
    """The plugin, or None (logged) when it cannot start: telemetry never stops a launch."""
    try:
        return TelemetryPlugin(ctx, background=True)
    except Exception:
        logger.exception("telemetry disabled for this run: the agent plugin failed to start")
        return None
