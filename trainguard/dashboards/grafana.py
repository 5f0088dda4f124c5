"""The Grafana dashboards, built with grafana-foundation-sdk's typed builders.

Two dashboards: *trainguard job* (training, RL, checkpoints, reliability and goodput of one job,
from the metric contract) and *trainguard GPU fleet* (dcgm-exporter health per node and GPU).
Both select the Prometheus data source, job, node and GPU through variables; uids are fixed so
that ``push`` updates the same dashboards. Every query is built from :mod:`.promql`, so a
panel can only name a metric of the contract or of dcgm-exporter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from trainguard.core.contracts.metrics import ROLE_STATES
from trainguard.dashboards.promql import dcgm, job_filter, tg, tg_suffix

__all__ = ["JOB_UID", "FLEET_UID", "dashboards", "to_json", "validate"]

JOB_UID = "trainguard-job"
FLEET_UID = "trainguard-gpu-fleet"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"
NODE = 'node=~"$node"'
TAGS = ["trainguard"]


@dataclass
class _Layout:
    """Places panels left to right in rows of 24 columns and numbers them."""

    x: int = 0
    y: int = 0
    h: int = 0
    next_id: int = 1

    def place(self, w: int, h: int) -> tuple[dm.GridPos, int]:
        if self.x + w > 24:
            self.x, self.y, self.h = 0, self.y + self.h, 0
        pos = dm.GridPos(h=h, w=w, x=self.x, y=self.y)
        self.x += w
        self.h = max(self.h, h)
        pid = self.next_id
        self.next_id += 1
        return pos, pid

    def row(self) -> tuple[dm.GridPos, int]:
        if self.x:
            self.x, self.y, self.h = 0, self.y + self.h, 0
        pos = dm.GridPos(h=1, w=24, x=0, y=self.y)
        self.y += 1
        pid = self.next_id
        self.next_id += 1
        return pos, pid


def _q(
    expr: str, legend: str, ref: str = "A", *, fmt: pm.PromQueryFormat | None = None
) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()
    if fmt is not None:
        q = q.format(fmt)
    return q


def _targets(queries: list[tuple[str, str]]) -> list[prometheus.Dataquery]:
    return [_q(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)]


class _Board:
    def __init__(self, title: str, uid: str, description: str) -> None:
        self.layout = _Layout()
        self.b = (
            db.Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(TAGS)
            .refresh("30s")
            .time("now-6h", "now")
            .timezone("browser")
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .editable()
        )

    def link(self, title: str, uid: str) -> None:
        """Link to another generated dashboard, carrying the time range and the variables
        (``node`` joins a job's agents to their GPUs by hostname)."""
        self.b.link(
            db.DashboardLink(title)
            .type(dm.DashboardLinkType.LINK)
            .url(f"/d/{uid}")
            .icon("dashboard")
            .include_vars(True)
            .keep_time(True)
            .target_blank(False)
        )

    def row(self, title: str) -> None:
        pos, pid = self.layout.row()
        r = db.Row(title).grid_pos(pos).id(pid)
        self.b.with_row(r)

    def timeseries(
        self, title: str, queries: list[tuple[str, str]], *, unit: str = "short",
        description: str = "", w: int = 8, h: int = 8, stacked: bool = False,
    ) -> None:  # fmt: skip
        pos, pid = self.layout.place(w, h)
        p = (
            timeseries.Panel()
            .id(pid)
            .title(title)
            .description(description)
            .datasource(DS)
            .grid_pos(pos)
            .unit(unit)
            .targets(_targets(queries))
        )
        if stacked:
            p = p.stacking(StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(40)
        self.b.with_panel(p)

    def stat(self, title: str, expr: str, *, unit: str = "short", legend: str = "", w: int = 4,
             h: int = 4, description: str = "") -> None:  # fmt: skip
        pos, pid = self.layout.place(w, h)
        p = (
            stat.Panel()
            .id(pid)
            .title(title)
            .description(description)
            .datasource(DS)
            .grid_pos(pos)
            .unit(unit)
            .targets([_q(expr, legend)])
        )
        self.b.with_panel(p)

    def heatmap(self, title: str, expr: str, legend: str, *, unit: str, description: str = "",
                w: int = 12, h: int = 9) -> None:  # fmt: skip
        pos, pid = self.layout.place(w, h)
        p = (
            heatmap.Panel()
            .id(pid)
            .title(title)
            .description(description)
            .datasource(DS)
            .grid_pos(pos)
            .calculate(False)
            .with_target(_q(expr, legend, fmt=pm.PromQueryFormat.TIME_SERIES))
            .cell_values(heatmap.CellValues().unit(unit))
        )
        self.b.with_panel(p)

    def table(
        self, title: str, expr: str, *, w: int = 24, h: int = 6, description: str = ""
    ) -> None:
        pos, pid = self.layout.place(w, h)
        q = _q(expr, "", fmt=pm.PromQueryFormat.TABLE).instant()
        p = (
            table.Panel()
            .id(pid)
            .title(title)
            .description(description)
            .datasource(DS)
            .grid_pos(pos)
            .targets([q])
        )
        self.b.with_panel(p)

    def build(self) -> dm.Dashboard:
        return self.b.build()


def _ds_var() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def _query_var(name: str, label: str, query: str, *, regex: str = "") -> db.QueryVariable:
    v = (
        db.QueryVariable(name)
        .label(label)
        .query(query)
        .datasource(DS)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )
    if regex:
        v = v.regex(regex)
    return v


def _annotation(name: str, expr: str, color: str) -> db.AnnotationQuery:
    return db.AnnotationQuery().name(name).datasource(DS).enable(True).icon_color(color).expr(expr)


def _j(expr: str) -> str:
    return job_filter(expr)


def job_dashboard() -> dm.Dashboard:
    d = _Board(
        "trainguard job",
        JOB_UID,
        "One trainguard job: training and RL metrics, checkpoints, restarts and goodput. "
        "Generated by trainguard.dashboards from the metric contract; do not edit by hand.",
    )
    d.link("GPU fleet (same nodes)", FLEET_UID)
    info = tg("trainguard.run.info")
    d.b.with_variable(_ds_var())
    d.b.with_variable(_query_var("job", "Job", f"label_values({info}, job_id)"))
    d.b.with_variable(
        _query_var(
            "slurm_job", "Slurm job", f'label_values({info}{{job_id=~"$job"}}, slurm_job_id)'
        )
    )
    d.b.with_variable(_query_var("node", "Node", f'label_values({info}{{job_id=~"$job"}}, node)'))
    d.b.with_variable(
        _query_var("rank", "Rank", f"label_values({tg('trainguard.train.step', NODE)}, rank)")
    )
    failures = tg("trainguard.job.failures", NODE)
    restarts = tg("trainguard.job.restarts", NODE)
    d.b.annotation(
        _annotation(
            "Failures", _j(f"sum by (instance, node, cause) (increase({failures}[1m])) > 0"), "red"
        )
    )
    d.b.annotation(
        _annotation(
            "Recoveries (restarts)",
            _j(f"sum by (instance, node, cause) (increase({restarts}[1m])) > 0"),
            "green",
        )
    )
    d.b.annotation(_annotation("Hangs", _j(f"{tg('trainguard.job.hung', NODE)} > 0"), "orange"))
    r = f'{NODE}, rank=~"$rank"'

    d.row("Progress")

    def agg(fn: str, name: str) -> str:
        return f"{fn}({_j(tg(name, NODE))})"

    d.stat("Step", agg("max", "trainguard.train.step"), legend="step")
    d.stat("Attempt", agg("max", "trainguard.job.attempt"), legend="attempt")
    d.stat("ETTR (goodput)", agg("min", "trainguard.goodput.ettr"), unit="percentunit",
           legend="ETTR")  # fmt: skip
    d.stat("Job throughput", agg("sum", "trainguard.job.throughput"), legend="tokens/s")
    d.stat("Hung", agg("max", "trainguard.job.hung"), legend="hung",
           description="1 while the agent's hang verdict stands (until a step completes).")  # fmt: skip
    d.stat("Last checkpoint age",
           "time() - " + agg("max", "trainguard.checkpoint.last_commit.time"),
           unit="s", legend="age")  # fmt: skip

    d.row("Training")
    d.timeseries("Loss", [(_j(tg("trainguard.train.loss", r)), "rank {{rank}}")])
    d.timeseries("Throughput per rank",
                 [(_j(tg("trainguard.train.throughput", r)), "rank {{rank}}")],
                 unit="short", description="Tokens per second of each rank.")  # fmt: skip
    d.timeseries("Job throughput", [
        (_j(tg("trainguard.job.throughput", NODE)), "tokens/s {{node}}"),
        (_j(tg("trainguard.job.sample_throughput", NODE)), "samples/s {{node}}"),
    ])  # fmt: skip
    d.timeseries("MFU", [(_j(tg("trainguard.train.mfu", r)), "rank {{rank}}")],
                 unit="percentunit")  # fmt: skip
    d.timeseries("Grad norm", [(_j(tg("trainguard.train.grad_norm", r)), "rank {{rank}}")])
    d.timeseries("Learning rate", [(_j(tg("trainguard.train.lr", r)), "rank {{rank}}")])
    step_sum = tg_suffix("trainguard.train.step.duration", "sum", r)
    step_count = tg_suffix("trainguard.train.step.duration", "count", r)
    d.heatmap(
        "Step time per rank",
        _j(
            f"sum by (instance, rank) (rate({step_sum}[{RI}]))\n"
            f"/ sum by (instance, rank) (rate({step_count}[{RI}]))"
        ),
        "{{rank}}",
        unit="s",
        description="Mean step time of each rank (rows) over time; a straggler is a hot row.",
    )
    buckets = tg_suffix("trainguard.train.step.duration", "bucket", r)
    job_info = tg("trainguard.run.info", 'job_id=~"$job"')
    d.timeseries("Step time p50 / p99", [
        (f"histogram_quantile({q}, sum by (le) (rate({buckets}[{RI}])\n"
         f"  and on(instance) {job_info}))", f"p{int(q * 100)}")
        for q in (0.5, 0.99)
    ], unit="s", w=6)  # fmt: skip
    d.timeseries("Straggler score",
                 [(_j(tg("trainguard.health.straggler_score", r)), "rank {{rank}}")],
                 unit="percentunit", w=6)  # fmt: skip

    d.row("Reinforcement learning")
    d.timeseries("Reward", [
        (_j(tg("trainguard.rl.reward.mean", r)), "mean rank {{rank}}"),
        (_j(tg("trainguard.rl.reward.std", r)), "std rank {{rank}}"),
    ])  # fmt: skip
    d.timeseries("KL to reference", [(_j(tg("trainguard.rl.kl", r)), "rank {{rank}}")])
    d.timeseries("Entropy", [(_j(tg("trainguard.rl.entropy", r)), "rank {{rank}}")])
    d.timeseries("Clip fraction", [(_j(tg("trainguard.rl.clip_fraction", r)), "rank {{rank}}")],
                 unit="percentunit")  # fmt: skip
    d.timeseries("Response length", [
        (_j(tg("trainguard.rl.response_length.mean", r)), "mean rank {{rank}}"),
        (_j(tg("trainguard.rl.response_length.max", r)), "max rank {{rank}}"),
    ])  # fmt: skip
    d.timeseries("Rollout vs optimise time", [
        (_j(tg("trainguard.rl.rollout.duration", r)), "rollout rank {{rank}}"),
        (_j(tg("trainguard.rl.optimize.duration", r)), "optimize rank {{rank}}"),
    ], unit="s")  # fmt: skip

    d.row("Rollout fleet (engines beside the trainer)")
    serving = tg("trainguard.role.replicas.serving", NODE)
    total = tg("trainguard.role.replicas.total", NODE)
    d.timeseries("Engines serving / total", [
        (_j(f"sum by (instance, role) ({serving})"), "serving {{role}}"),
        (_j(f"sum by (instance, role) ({total})"), "total {{role}}"),
    ], description="Replicas of each role (rollout engines, reward servers) that serve, "
       "against those declared.")  # fmt: skip
    d.timeseries("Engine restarts", [(_j(
        f'sum by (instance, role) (increase({tg("trainguard.role.restarts", NODE)}[1h]))'),
        "{{role}}")], stacked=True,
        description="Replica restarts in the last hour, per role (never the trainer's).")  # fmt: skip
    d.timeseries("Engine states", [(_j(
        f'sum by (instance, role, state) ({tg("trainguard.role.replica.state", NODE)})'),
        "{{role}} {{state}}")], stacked=True,
        description=f"Replicas in each lifecycle state: {', '.join(ROLE_STATES)}.")  # fmt: skip
    d.timeseries("Rollout failures by reason", [
        (_j(f'sum by (instance, reason) '
            f'(rate({tg("trainguard.rl.rollout.failed", NODE)}[{RI}]))'), "failed {{reason}}"),
        (_j(f'sum by (instance, reason) '
            f'(rate({tg("trainguard.rl.rollout.retried", NODE)}[{RI}]))'), "retried {{reason}}"),
    ], unit="reqps",
        description="Failed rollout requests per second by reason, and those of them sent again "
        "to another engine; the rest failed their batch. None is replaced by a made-up "
        "sample.")  # fmt: skip
    d.timeseries("Refit checks per engine", [
        (_j(f'sum by (instance, engine) '
            f'(increase({tg("trainguard.rl.refit.verified", NODE)}[1h]))'), "verified {{engine}}"),
        (_j(f'sum by (instance, engine) (increase('
            f'{tg("trainguard.rl.refit.quarantined", NODE)}[1h]))'), "quarantined {{engine}}"),
    ], description="Refits in the last hour that a client verified before routing to the "
       "engine, and those quarantined (an update error or log-probs that did not match the "
       "trainer's fingerprint; refit again, never served meanwhile).")  # fmt: skip
    d.timeseries("Rollout retries and routable engines", [
        (_j(tg("trainguard.rl.rollout.retries", r)), "retries rank {{rank}}"),
        (_j(tg("trainguard.rl.rollout.engines_routable", r)), "routable rank {{rank}}"),
        (_j(tg("trainguard.rl.rollout.engines_declared", r)), "declared rank {{rank}}"),
    ], description="Requests retried on another engine in the step, and the engines each "
       "rank's client routes to (serving, within the staleness bound) out of those it "
       "knows.")  # fmt: skip
    d.timeseries("Rollout latency p50 / p99", [
        (_j(tg("trainguard.rl.rollout.latency.p50", r)), "p50 rank {{rank}}"),
        (_j(tg("trainguard.rl.rollout.latency.p99", r)), "p99 rank {{rank}}"),
    ], unit="s")  # fmt: skip
    d.timeseries("Rollout tokens/s",
                 [(_j(tg("trainguard.rl.rollout.throughput", r)), "rank {{rank}}")])  # fmt: skip
    d.timeseries("Weight sync", [
        (_j(tg("trainguard.rl.weight_sync.duration", r)), "duration rank {{rank}}"),
        (_j(tg("trainguard.rl.weight_sync.timeout", r)), "timeout rank {{rank}}"),
    ], unit="s", description="Time to push a weight version to the engines, against the "
       "timeout in force (derived from measured syncs).")  # fmt: skip
    d.timeseries("Staleness and engine weight versions", [
        (_j(tg("trainguard.rl.staleness.max", r)), "staleness max rank {{rank}}"),
        (_j(tg("trainguard.rl.staleness.mean", r)), "staleness mean rank {{rank}}"),
        (_j(tg("trainguard.role.replica.weight_version", NODE)), "{{role}} {{replica}} version"),
    ], description="Trainer version minus the version that generated a sample (largest and "
       "mean of the step); the engines' versions catch up after each weight sync.")  # fmt: skip

    d.row("Checkpoints")
    for name, title in (
        ("trainguard.checkpoint.stall.duration", "Checkpoint stall (training blocked)"),
        ("trainguard.checkpoint.persist.duration", "Checkpoint persist (background)"),
    ):
        s = tg_suffix(name, "sum", NODE)
        c = tg_suffix(name, "count", NODE)
        d.timeseries(title, [(_j(
            f"sum by (instance, node) (increase({s}[1h]))\n"
            f"/ sum by (instance, node) (increase({c}[1h]))"), "mean {{node}}")],
            unit="s")  # fmt: skip
    d.timeseries("Checkpoint size and interval", [
        (_j(tg("trainguard.checkpoint.size", r)), "bytes rank {{rank}}"),
        (_j(tg("trainguard.checkpoint.interval", r)), "interval s rank {{rank}}"),
    ])  # fmt: skip

    d.row("Reliability and goodput")
    d.timeseries("Restarts by cause",
                 [(_j(f"sum by (instance, cause) (increase({restarts}[1h]))"), "{{cause}}")],
                 stacked=True, description="Worker-group restarts in the last hour.")  # fmt: skip
    d.timeseries("Failures by cause",
                 [(_j(f"sum by (instance, cause) (increase({failures}[1h]))"), "{{cause}}")],
                 stacked=True)  # fmt: skip
    d.timeseries("Health incidents by kind", [(_j(
        f'sum by (instance, kind) (increase({tg("trainguard.health.incidents", NODE)}[1h]))'),
        "{{kind}}")], stacked=True)  # fmt: skip
    d.timeseries("Goodput (ETTR)", [(_j(tg("trainguard.goodput.ettr", NODE)), "ETTR {{node}}")],
                 unit="percentunit")  # fmt: skip
    d.timeseries("Badput by cause", [(_j(
        f'sum by (instance, cause) ({tg("trainguard.goodput.lost_time", NODE)})'), "{{cause}}")],
        unit="s", stacked=True,
        description="Wall time lost so far, by cause; productive time for comparison.")  # fmt: skip
    d.timeseries("Productive time", [(_j(tg("trainguard.goodput.productive_time", NODE)),
                                      "{{node}}")], unit="s")  # fmt: skip
    d.timeseries("Scheduler's share (Slurm)", [(_j(
        f'max by (instance, allocation, phase) ({tg("trainguard.slurm.schedule_time", NODE)})'),
        "{{allocation}} {{phase}}")], unit="s", stacked=True,
        description="Under trainguard sbatch, per allocation (job id.restart count): the queue "
        "wait (submit to start), the prolog (start to the batch host's agent) and the gap "
        "since the previous allocation ended (a requeue, a resubmission), from sacct, else "
        "scontrol show job. In the badput as queue_wait, prolog and requeue_wait.")  # fmt: skip
    d.timeseries("Device memory", [
        (_j(tg("trainguard.gpu.memory.used", r)), "used rank {{rank}}"),
        (_j(tg("trainguard.gpu.memory.peak", r)), "peak rank {{rank}}"),
    ], unit="bytes")  # fmt: skip
    d.timeseries("Telemetry export failures", [(_j(
        f'sum by (instance, exporter) (increase({tg("trainguard.telemetry.export.failures", NODE)}[1h]))'),
        "{{exporter}}")])  # fmt: skip
    d.table("Run", _j(tg("trainguard.run.info", NODE)),
            description="run_id, job_id, slurm_job_id and node of each agent: the join keys.")  # fmt: skip
    return d.build()


def fleet_dashboard() -> dm.Dashboard:
    d = _Board(
        "trainguard GPU fleet",
        FLEET_UID,
        "GPU health from dcgm-exporter per node and GPU (XID, ECC, row remap, NVLink, "
        "throttling, PCIe), joinable to trainguard jobs by node, GPU UUID and Slurm job id; "
        "node health across jobs from trainguard's agents (node states, failures by cause, "
        "lemon nodes, sniff tests). Generated by trainguard.dashboards; do not edit by hand.",
    )
    d.link("trainguard job", JOB_UID)
    info = tg("trainguard.run.info")
    host_regex = '/[hH]ostname="([^"]+)"/'
    d.b.with_variable(_ds_var())
    d.b.with_variable(_query_var("job", "trainguard job", f"label_values({info}, job_id)"))
    d.b.with_variable(
        _query_var(
            "slurm_job", "Slurm job", f'label_values({info}{{job_id=~"$job"}}, slurm_job_id)'
        )
    )
    d.b.with_variable(
        _query_var(
            "node", "Node",
            "query_result(count by (hostname, Hostname) (DCGM_FI_DEV_GPU_TEMP))",
            regex=host_regex,
        )
    )  # fmt: skip
    d.b.with_variable(_query_var("gpu", "GPU (UUID)", "label_values(DCGM_FI_DEV_GPU_TEMP, UUID)"))
    sel = '{host}=~"$node", UUID=~"$gpu"'
    legend = "{{hostname}} gpu {{gpu}}"

    def g(metric: str, **kw: str) -> str:
        return dcgm(metric, sel, **kw)

    def rate(metric: str) -> str:
        return g(metric, fn="rate", window=RI)

    def inc(metric: str) -> str:
        return g(metric, fn="increase", window="1h")

    d.row("Overview")
    d.stat("GPUs", f"count({g('DCGM_FI_DEV_GPU_TEMP')})", legend="GPUs")
    d.stat("Critical XIDs now",
           f'count({g("DCGM_FI_DEV_XID_ERRORS")} > 0) or vector(0)', legend="GPUs")  # fmt: skip
    d.stat("GPUs with DBE", f'count({g("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL")} > 0) or vector(0)',
           legend="GPUs")  # fmt: skip
    d.stat("Row remap failures",
           f'count({g("DCGM_FI_DEV_ROW_REMAP_FAILURE")} > 0) or vector(0)', legend="GPUs")  # fmt: skip
    d.stat("Max temperature", f"max({g('DCGM_FI_DEV_GPU_TEMP')})", unit="celsius", legend="max")
    d.stat("Power", f"sum({g('DCGM_FI_DEV_POWER_USAGE')})", unit="watt", legend="total")
    d.table(
        "trainguard jobs on these nodes",
        f'{info}{{job_id=~"$job", slurm_job_id=~"$slurm_job"}}',
        description="Join a GPU's node (hostname) to the trainguard job and Slurm job running on it.",
        h=5,
    )

    d.row("Utilisation")
    d.timeseries("Temperature", [(g("DCGM_FI_DEV_GPU_TEMP"), legend),
                                 (g("DCGM_FI_DEV_MEMORY_TEMP"), "mem " + legend)],
                 unit="celsius")  # fmt: skip
    d.timeseries("Power", [(g("DCGM_FI_DEV_POWER_USAGE"), legend)], unit="watt")
    d.timeseries("GPU utilisation", [(g("DCGM_FI_DEV_GPU_UTIL"), legend)], unit="percent")
    d.timeseries("Tensor / graphics / DRAM active", [
        (g("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), "tensor " + legend),
        (g("DCGM_FI_PROF_GR_ENGINE_ACTIVE"), "graphics " + legend),
        (g("DCGM_FI_PROF_DRAM_ACTIVE"), "dram " + legend),
    ], unit="percentunit")  # fmt: skip
    d.timeseries("Framebuffer memory", [(g("DCGM_FI_DEV_FB_USED"), "used " + legend),
                                        (g("DCGM_FI_DEV_FB_FREE"), "free " + legend)],
                 unit="decmbytes")  # fmt: skip
    d.timeseries("Clocks", [(g("DCGM_FI_DEV_SM_CLOCK"), "sm " + legend),
                            (g("DCGM_FI_DEV_MEM_CLOCK"), "mem " + legend)],
                 unit="MHz")  # fmt: skip

    d.row("Errors")
    d.timeseries("XID by code", [
        (f'count by (hostname, err_code) ({g("DCGM_FI_DEV_XID_ERRORS")} > 0)',
         "{{hostname}} XID {{err_code}}"),
        (f'sum by (hostname, xid) ({g("DCGM_EXP_XID_ERRORS_COUNT")})',
         "{{hostname}} XID {{xid}} (count)"),
    ], description="Last XID per GPU (DCGM_FI_DEV_XID_ERRORS) and XIDs in the exporter's "
        "window (DCGM_EXP_XID_ERRORS_COUNT, when enabled).")  # fmt: skip
    d.timeseries("ECC errors (volatile)", [
        (g("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"), "SBE " + legend),
        (g("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), "DBE " + legend),
    ])  # fmt: skip
    d.timeseries("ECC errors (aggregate)", [
        (g("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"), "SBE " + legend),
        (g("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"), "DBE " + legend),
    ])  # fmt: skip
    d.timeseries("Row remapping / retired pages", [
        (g("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"), "correctable " + legend),
        (g("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"), "uncorrectable " + legend),
        (g("DCGM_FI_DEV_ROW_REMAP_FAILURE"), "remap failure " + legend),
        (g("DCGM_FI_DEV_RETIRED_PENDING"), "pages pending " + legend),
    ])  # fmt: skip
    d.timeseries("NVLink errors (per hour)", [
        (inc("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"), "CRC flit " + legend),
        (inc("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"), "replay " + legend),
        (inc("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"), "recovery " + legend),
    ])  # fmt: skip
    d.timeseries("PCIe replays (per hour)",
                 [(inc("DCGM_FI_DEV_PCIE_REPLAY_COUNTER"), legend)])  # fmt: skip

    d.row("Throttling and I/O")
    d.timeseries("Thermal throttling (fraction of time)",
                 [(f'{rate("DCGM_FI_DEV_THERMAL_VIOLATION")} / 1e6', legend)],
                 unit="percentunit")  # fmt: skip
    d.timeseries("Clock event reasons (bitmask)",
                 [(g("DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), legend)],
                 description="0x8 HW slowdown, 0x20 SW thermal, 0x40 HW thermal, 0x80 power brake.")  # fmt: skip
    d.timeseries("PCIe bandwidth", [
        (rate("DCGM_FI_PROF_PCIE_TX_BYTES"), "tx " + legend),
        (rate("DCGM_FI_PROF_PCIE_RX_BYTES"), "rx " + legend),
    ], unit="Bps")  # fmt: skip
    d.timeseries("NVLink bandwidth", [(rate("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), legend)])
    _node_health_row(d)
    return d.build()


def _node_health_row(d: _Board) -> None:
    """Node health across jobs (trainguard's agents): states, attributed failures, lemons,
    sniff tests."""
    state = tg("trainguard.fleet.node.state")
    failures = tg("trainguard.fleet.failures")
    refused = tg("trainguard.fleet.lemon.refused_time")
    d.row("Node health across jobs")
    d.timeseries("Nodes by state",
                 [(f"count by (state) (max by (node, state) ({state}) == 1)", "{{state}}")],
                 description="Nodes whose trainguard agents report each state: ok (running "
                 "work), degraded (a sniff test flagged a slow rank), excluded, evicted, lemon "
                 "(refused at a job's start).", stacked=True)  # fmt: skip
    d.timeseries("Failures by cause",
                 [(f"sum by (cause) (increase({failures}[1h]))", "{{cause}}")],
                 description="Failures trainguard attributed, per hour, by cause (user_code, "
                 "out_of_memory, hardware, network, data, control_plane, transient).",
                 stacked=True)  # fmt: skip
    d.table("Lemon nodes refused", f"max by (node) ({refused}) * 1000",
            description="Nodes refused at a job's start because their fleet history crossed "
            "the lemon threshold, with the time of the last refusal (ms since the epoch); "
            "trainguard fleet lemons shows their history, trainguard fleet release NODE frees "
            "one.", w=8, h=8)  # fmt: skip
    d.timeseries("Sniff GEMM time by node",
                 [(f"max by (node, rank) ({tg('trainguard.sniff.gemm_time')})",
                   "{{node}} rank {{rank}}")], unit="s",
                 description="The fixed GEMM of the sniff tests, timed on each rank's device.")  # fmt: skip
    d.timeseries("Sniff slowdown by node",
                 [(f"max by (node, rank) ({tg('trainguard.sniff.slowdown')})",
                   "{{node}} rank {{rank}}")],
                 description="A rank's sniff GEMM time over its reference (the node's other "
                 "ranks, or the fleet's history for its device model): 1 as fast; at "
                 "[fleet] sniff_slow_factor in most of its last sniff_window sniffs the rank is flagged.")  # fmt: skip
    d.timeseries("Sniff all-reduce time and overhead", [
        (f"max by (node) ({tg('trainguard.sniff.allreduce_time')})", "all-reduce {{node}}"),
        (f"max by (node) ({tg('trainguard.sniff.overhead')})", "overhead {{node}}"),
    ], description="The sniff all-reduce's time, and the share of the training time the sniff "
        "tests took (bounded by [fleet] sniff_budget).")  # fmt: skip


def dashboards() -> dict[str, dm.Dashboard]:
    """File stem → dashboard."""
    return {"trainguard-job": job_dashboard(), "trainguard-gpu-fleet": fleet_dashboard()}


def to_json(d: dm.Dashboard) -> str:
    """Stable JSON text (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(d, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def validate(text: str) -> None:
    """Check dashboard JSON against the SDK's types: it must parse into the SDK's
    ``Dashboard`` model and serialise back to the same document; ValueError otherwise."""
    data = json.loads(text)
    back = json.loads(to_json(dm.Dashboard.from_json(data)))
    if back != data:
        raise ValueError("dashboard JSON does not round-trip through the SDK's Dashboard type")
