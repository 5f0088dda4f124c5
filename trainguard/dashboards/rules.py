"""Prometheus alert rules for trainguard jobs and GPU nodes, generated from the metric contract.

Every rule has a severity (``critical`` pages, ``warning`` goes to chat), a component (``job``,
``gpu``, ``node`` or ``telemetry``: Alertmanager's inhibition uses it), a summary, a description
and a runbook. Faults trainguard recovers from by itself (a restart, a hang it killed, a
straggler) are warnings; what needs a human (a job that cannot make progress, a node that must
be drained, a GPU that lost memory) is critical.

Job alerts carry ``node``, ``instance`` (the agent's endpoint) and, joined from
``trainguard_run_info``, ``job_id`` and ``slurm_job_id``; GPU alerts carry ``node`` (from
dcgm-exporter's ``hostname`` or ``Hostname``), ``gpu`` and ``UUID``. Each rule ships with a
promtool unit test that makes it fire and one that keeps it quiet (:mod:`.rule_tests`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from trainguard.core.contracts.metrics import HUNG_MIN_HOLD_S
from trainguard.dashboards.promql import dcgm, tg

__all__ = ["AlertRule", "RuleParams", "alert_rules", "render_annotation", "rules_document"]

Severity = Literal["critical", "warning"]
Component = Literal["job", "gpu", "node", "telemetry"]

RUNBOOK_BASE = "https://github.com/trainguard/trainguard/blob/main/dashboards/RUNBOOK.md"


@dataclass(frozen=True, slots=True)
class RuleParams:
    """Thresholds of the generated rules (the committed files use the defaults)."""

    trainguard_job: str = "trainguard"
    """Prometheus scrape job of the node agents' ``/metrics`` endpoints."""
    dcgm_job: str = "dcgm"
    """Prometheus scrape job of dcgm-exporter."""
    no_progress_window: str = "15m"
    """No completed step in this long (while the series existed before it): hung."""
    restart_storm: int = 5
    """More restarts than this in an hour: restart storm (recovered, but costly)."""
    crash_loop_restarts: int = 3
    """This many restarts in 15 minutes without a new highest step: crash loop."""
    drop_fraction: float = 0.7
    """Throughput or MFU below this fraction of the trailing 2 h baseline: drop."""
    goodput_target: float = 0.9
    """ETTR below this for 30 minutes: goodput under target."""
    kl_floor: float = 0.1
    """A KL blow-up must also exceed this absolute value."""
    stale_fallback_s: int = 7200
    """Checkpoint stale after this long when the job reports no checkpoint interval."""
    fleet_serving_fraction: float = 0.5
    """A role (rollout engines, reward servers) with fewer serving replicas than this fraction
    of its declared ones for 5 minutes: fleet degraded."""
    rollout_failure_rate: float = 0.05
    """Failed rollout requests per second (10-minute rate) above this: rollouts failing."""
    node_failures: int = 3
    """This many failures attributed to a node's hardware or network within
    ``node_failure_window`` (across its jobs): the node fails too often."""
    node_failure_window: str = "6h"
    lemon_refused_s: int = 1800
    """A lemon node refused at a job's start alerts for this long."""
    critical_xids: tuple[int, ...] = (46, 48, 64, 74, 79, 95, 119, 120)
    """XIDs that mean drain the node (NVIDIA's Xid catalog, docs.nvidia.com/deploy/xid-errors)."""
    warning_xids: tuple[int, ...] = (13, 31, 43, 45, 63, 92, 94)
    """XIDs trainguard's restart usually handles: watch them."""


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    expr: str
    severity: Severity
    component: Component
    summary: str
    description: str
    runbook: str
    """What the on-call engineer does, in a few sentences."""
    for_: str = "0s"
    recovered_by_trainguard: bool = False
    """trainguard handles this fault itself; the alert informs (always a warning)."""
    group: str = "trainguard-job"
    extra_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.recovered_by_trainguard and self.severity != "warning":
            raise ValueError(f"{self.name}: a fault trainguard recovers from must be a warning")

    @property
    def runbook_url(self) -> str:
        return f"{RUNBOOK_BASE}#{self.name.lower()}"

    def labels(self) -> dict[str, str]:
        return {"severity": self.severity, "component": self.component, **self.extra_labels}

    def annotations(self) -> dict[str, str]:
        return {
            "summary": self.summary,
            "description": self.description,
            "runbook": self.runbook,
            "runbook_url": self.runbook_url,
        }

    def to_rule(self) -> dict[str, object]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": self.labels(),
            "annotations": self.annotations(),
        }


_LABEL_REF = re.compile(r"\{\{\s*\$labels\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def render_annotation(template: str, labels: dict[str, str]) -> str:
    """Render the only template form the rules use, ``{{ $labels.NAME }}`` (for unit tests)."""
    if "{{" in _LABEL_REF.sub("", template):
        raise ValueError(f"annotation uses a template form render_annotation cannot: {template!r}")
    return _LABEL_REF.sub(lambda m: labels.get(m.group(1), ""), template)


# -- expression helpers ---------------------------------------------------------------------------
def _with_job(expr: str) -> str:
    """Add ``job_id``/``slurm_job_id`` of the agent endpoint (``instance``) to a job alert."""
    info = tg("trainguard.run.info")
    return (
        f"({expr})\n* on(instance) group_left(job_id, slurm_job_id)\n"
        f"  max by (instance, job_id, slurm_job_id) ({info})"
    )


def _by_agent(agg: str, inner: str) -> str:
    return f"{agg} by (instance, node) ({inner})"


def _gpu(metric: str, selector: str = "", **range_fn: str) -> str:
    """A dcgm-exporter series with ``node`` set from its host label."""
    inner = dcgm(metric, selector, **range_fn)
    return f'label_replace({inner}, "node", "$1", "hostname", "(.+)")'


def _gpu_by(agg: str, inner: str, extra: str = "") -> str:
    by = "node, gpu, UUID" + (f", {extra}" if extra else "")
    return f"{agg} by ({by}) ({inner})"


def _job_rules(p: RuleParams) -> list[AlertRule]:
    step = tg("trainguard.train.step")
    restarts = tg("trainguard.job.restarts")
    incidents = tg("trainguard.health.incidents")
    loss = tg("trainguard.train.loss")
    kl = tg("trainguard.rl.kl")
    reward = tg("trainguard.rl.reward.mean")
    reward_std = tg("trainguard.rl.reward.std")
    job_tput = tg("trainguard.job.throughput")
    mfu = tg("trainguard.train.mfu")
    ettr = tg("trainguard.goodput.ettr")
    last_commit = tg("trainguard.checkpoint.last_commit.time")
    interval = tg("trainguard.checkpoint.interval")
    w = p.no_progress_window
    cur = _by_agent("max", loss)
    base = _by_agent("max", f"avg_over_time({loss}[1h] offset 15m)")
    spread = _by_agent("max", f"stddev_over_time({loss}[1h] offset 15m)")
    where = "job {{ $labels.job_id }} on node {{ $labels.node }}"
    return [
        AlertRule(
            name="TrainGuardJobHung",
            expr=_with_job(f"max by (instance, node, diagnosis) ({tg('trainguard.job.hung')}) > 0"),
            severity="critical",
            component="job",
            summary=f"Training {where} is hung ({{{{ $labels.diagnosis }}}})",
            description="The node agent found a rank that stopped making progress (frozen or "
            "stuck in a collective) and is recovering; it resolves when a step completes again, at "
            f"least {HUNG_MIN_HOLD_S:.0f} s after the verdict (held through two 15 s scrapes).",
            runbook="The diagnosis label says where: missing (a rank or host never entered the "
            "collective the others wait in: check that host), divergent (ranks in different "
            "collectives: a code path only some ranks took, e.g. a data-dependent branch), "
            "transport (every rank entered, none completed: network / NIC / peer), pending "
            "(collection still running). The hang_diagnosis and hang_stacks events (trainguard events "
            "RUN_DIR) "
            "and RUN_DIR/hangs/<attempt>/diagnosis.json name the collective (op, sequence id), "
            "the ranks and hosts, and hold every rank's stack grouped; the HTML report shows "
            "them too. If it does not resolve within a few minutes, the restart failed: check "
            "the node and restart the job.",
        ),
        AlertRule(
            name="TrainGuardNoStepProgress",
            expr=_with_job(
                _by_agent("max", f"changes({step}[{w}])")
                + " == 0\nand on(instance, node) "
                + _by_agent("max", f"{step} offset {w}")
            ),
            severity="critical",
            component="job",
            summary=f"No training step completed in {w} ({where})",
            description=f"The step counter did not change for {w} while the agent is up: the "
            "job is hung and the agent's hang detection did not act (it may be disabled).",
            runbook="Check the workers' stacks (py-spy dump --pid PID), the rendezvous and the "
            "data loader; kill the job's workers to force a restart if needed.",
        ),
        AlertRule(
            name="TrainGuardCrashLoop",
            expr=_with_job(
                _by_agent("sum", f"increase({restarts}[15m])")
                + f" >= {p.crash_loop_restarts}\nunless on(instance) (\n  "
                + f"max by (instance) (max_over_time({step}[15m]))\n  > "
                + f"max by (instance) (max_over_time({step}[15m] offset 15m))\n)"
            ),
            severity="critical",
            component="job",
            summary=f"Crash loop: restarts without progress ({where})",
            description=f"{p.crash_loop_restarts} or more restarts in 15 minutes and no new "
            "highest step: the job restarts into the same failure.",
            runbook="Read the root cause of the last worker_failed events (trainguard events "
            "RUN_DIR); a bad checkpoint, a code or data error or a bad node keeps failing. "
            "Stop the job, fix the cause, resume from the last good checkpoint.",
        ),
        AlertRule(
            name="TrainGuardTrainingStopped",
            expr=f'up{{job="{p.trainguard_job}"}} == 0',
            for_="1m",
            severity="critical",
            component="job",
            summary="trainguard agent endpoint {{ $labels.instance }} is down",
            description="A node agent's metrics endpoint stopped answering: the job stopped "
            "(failed, out of restarts) or its node died. Remove the target when a job ends "
            "normally (e.g. in the Slurm epilog) so that only failures page.",
            runbook="trainguard events RUN_DIR shows job_finished and its state; on a failed "
            "job read the failure report, on a dead node drain it and requeue the job.",
        ),
        AlertRule(
            name="TrainGuardRestartStorm",
            expr=_with_job(_by_agent("sum", f"increase({restarts}[1h])") + f" > {p.restart_storm}"),
            severity="warning",
            component="job",
            recovered_by_trainguard=True,
            summary=f"Many restarts in the last hour ({where})",
            description=f"More than {p.restart_storm} worker-group restarts in an hour. "
            "trainguard recovered each, but goodput suffers.",
            runbook="Look at the restarts-by-cause panel: one cause (a node, a rank, OOM) "
            "dominating usually means a node to drain or a setting to fix.",
        ),
        AlertRule(
            name="TrainGuardNodeDrained",
            expr=_with_job(
                _by_agent("sum", f'increase({incidents}{{kind="node_excluded"}}[30m])') + " > 0"
            ),
            severity="critical",
            component="node",
            summary="trainguard evicted node {{ $labels.node }} from job {{ $labels.job_id }}",
            description="The node failed its health checks and left the job (a spare takes "
            "over if there is one); the node needs repair before it takes work again.",
            runbook="Read the node_excluded and preflight events for the reasons, run "
            "'trainguard health' and 'dcgmi diag -r 2' on the node, repair or RMA, then resume it.",
        ),
        AlertRule(
            name="TrainGuardHangRecovered",
            expr=_with_job(
                _by_agent("sum", f'increase({incidents}{{kind="hang_detected"}}[30m])') + " > 0"
            ),
            severity="warning",
            component="job",
            recovered_by_trainguard=True,
            summary=f"trainguard recovered a hang ({where})",
            description="A hang was detected in the last 30 minutes and the workers restarted.",
            runbook="Nothing urgent; repeated hangs on one node or rank point at hardware "
            "or a collective bug: read the hang_stacks events.",
        ),
        AlertRule(
            name="TrainGuardThroughputDrop",
            expr=_with_job(
                _by_agent("avg", f"avg_over_time({job_tput}[10m])")
                + f"\n< {p.drop_fraction} * "
                + _by_agent("avg", f"avg_over_time({job_tput}[2h] offset 10m)")
            ),
            for_="10m",
            severity="warning",
            component="job",
            summary=f"Throughput dropped below {p.drop_fraction:.0%} of its 2 h baseline ({where})",
            description="Tokens per second of the job fell against its own trailing baseline.",
            runbook="Check the straggler scores and per-rank step time heatmap for a slow rank, "
            "thermal throttling on the GPU dashboard, and the data loader.",
        ),
        AlertRule(
            name="TrainGuardMfuDrop",
            expr=_with_job(
                _by_agent("avg", f"avg_over_time({mfu}[10m])")
                + f"\n< {p.drop_fraction} * "
                + _by_agent("avg", f"avg_over_time({mfu}[2h] offset 10m)")
            ),
            for_="10m",
            severity="warning",
            component="job",
            summary=f"MFU dropped below {p.drop_fraction:.0%} of its 2 h baseline ({where})",
            description="Model FLOPs utilisation fell against its own trailing baseline.",
            runbook="As for a throughput drop: stragglers, throttling, a changed batch shape.",
        ),
        AlertRule(
            name="TrainGuardLossNaN",
            expr=_with_job(
                _by_agent("count", f"({loss} != {loss}) or (abs({loss}) == Inf)") + " > 0"
            ),
            severity="critical",
            component="job",
            summary=f"Loss is NaN or infinite ({where})",
            description="The training loss is not a finite number: the run is diverging and "
            "every further step is wasted.",
            runbook="Stop the job, roll back to the last checkpoint with a finite loss, lower "
            "the learning rate or skip the offending batch.",
        ),
        AlertRule(
            name="TrainGuardLossSpike",
            expr=_with_job(
                f"{cur} - {base} > 5 * {spread}\nand {cur} - {base} > 0.5 * abs({base})"
            ),
            for_="5m",
            severity="warning",
            component="job",
            summary=f"Loss spiked above its trailing hour ({where})",
            description="For 5 minutes the loss has been more than 5 standard deviations (and "
            "half its level) above its mean of the hour before the last 15 minutes.",
            runbook="Look at grad norm and the learning rate; if it does not come back, roll "
            "back to an earlier checkpoint.",
        ),
        AlertRule(
            name="TrainGuardKlBlowup",
            expr=_with_job(
                _by_agent("max", kl)
                + "\n> 10 * "
                + _by_agent("max", f"avg_over_time({kl}[1h] offset 10m)")
                + f"\nand {_by_agent('max', kl)} > {p.kl_floor}"
            ),
            for_="5m",
            severity="warning",
            component="job",
            summary=f"KL to the reference policy blew up ({where})",
            description=f"KL is 10x its mean of the previous hour and above {p.kl_floor}: the "
            "policy is running away from the reference.",
            runbook="Raise the KL penalty or lower the learning rate; roll back if the reward "
            "also collapsed.",
        ),
        AlertRule(
            name="TrainGuardRewardCollapse",
            expr=_with_job(
                _by_agent("avg", f"avg_over_time({reward}[15m])")
                + "\n< "
                + _by_agent("avg", f"avg_over_time({reward}[2h] offset 15m)")
                + " - 3 * "
                + _by_agent("avg", f"stddev_over_time({reward}[2h] offset 15m)")
                + "\nor "
                + _by_agent("max", f"max_over_time({reward_std}[15m])")
                + " == 0"
            ),
            for_="5m",
            severity="warning",
            component="job",
            summary=f"Reward collapsed ({where})",
            description="The mean reward fell 3 standard deviations below its trailing 2 h "
            "level, or every rollout got the same reward for 15 minutes (no learning signal).",
            runbook="Check the reward model or verifier, the response length (collapse to "
            "empty answers) and entropy; roll back to a checkpoint before the drop.",
        ),
        AlertRule(
            name="TrainGuardRolloutFleetDegraded",
            expr=_with_job(
                f"sum by (instance, node, role) ({tg('trainguard.role.replicas.serving')})\n< "
                f"{p.fleet_serving_fraction} * "
                f"sum by (instance, node, role) ({tg('trainguard.role.replicas.total')})"
            ),
            for_="5m",
            severity="warning",
            component="job",
            recovered_by_trainguard=True,
            summary=f"Fewer than {p.fleet_serving_fraction:.0%} of the {{{{ $labels.role }}}} "
            f"replicas serve ({where})",
            description="The role's replicas are restarting, loading weights or dead for 5 "
            "minutes: rollouts run on what is left, slower (trainguard restarts each replica "
            "within its role's budget).",
            runbook="Read the role_replica_failed events (trainguard events RUN_DIR) and the "
            "replicas' logs (RUN_DIR/roles/<role>/<i>.log): an engine that crashes on start, "
            "runs out of memory or never gets the trainer's weights. The engine-fleet timeline "
            "of the HTML report shows each replica's states.",
        ),
        AlertRule(
            name="TrainGuardRolloutFailures",
            expr=_with_job(
                _by_agent("sum", f"rate({tg('trainguard.rl.rollout.failed')}[10m])")
                + f" > {p.rollout_failure_rate}"
            ),
            for_="10m",
            severity="warning",
            component="job",
            summary=f"Rollouts failing at over {p.rollout_failure_rate} per second ({where})",
            description="Generation requests to the engines keep failing (timeouts, refused "
            "connections, HTTP errors, malformed answers); each is retried on another engine "
            "or fails its batch, never replaced by a made-up sample.",
            runbook="The rollout-failures-by-reason panel names the reason: timeout or "
            "engine_dead (engines overloaded or frozen), refused or connection (engines "
            "restarting), not_serving (engines loading weights), http_5xx / malformed (an "
            "engine bug, or another process on an engine's port), http_4xx (the trainer's requests "
            "are invalid), unauthorized (the trainer's rollout token is not the engines': "
            "TRAINGUARD_ROLLOUT_TOKEN), stale (engines behind "
            "the staleness bound); check the engines' logs (RUN_DIR/roles/rollout/<i>.log).",
        ),
        AlertRule(
            name="TrainGuardWeightSyncTimeout",
            expr=_with_job(
                _by_agent("max", tg("trainguard.rl.weight_sync.duration"))
                + "\n>= on(instance, node) ("
                + _by_agent("max", tg("trainguard.rl.weight_sync.timeout"))
                + " > 0)"
            ),
            severity="warning",
            component="job",
            recovered_by_trainguard=True,
            summary=f"A weight sync ran into its timeout ({where})",
            description="The last weight sync took as long as its timeout: an engine did not "
            "confirm the trainer's new weights in time; it was taken out of routing and is "
            "refit later, the update did not wait for it.",
            runbook="Repeated timeouts on one engine point at it (its log, its host); on every "
            "engine at the weight-sync panel: the transport is slow for the model size.",
        ),
        AlertRule(
            name="TrainGuardCheckpointStale",
            expr=_with_job(
                f"(time() - max by (instance, node) ({last_commit}))\n"
                f"> on(instance, node) 2 * max by (instance, node) ({interval})\n"
                f"or (time() - max by (instance, node) ({last_commit})) > {p.stale_fallback_s}\n"
                f"  unless on(instance, node) max by (instance, node) ({interval})"
            ),
            severity="warning",
            component="job",
            summary=f"No checkpoint committed in 2x the interval ({where})",
            description="The last committed checkpoint is older than twice the checkpoint "
            "interval: a failure now loses that much work.",
            runbook="Look for checkpoint_failed events and the persist time panel: storage "
            "full or slow, or a persister that died.",
        ),
        AlertRule(
            name="TrainGuardGoodputLow",
            expr=_with_job(_by_agent("min", ettr) + f" < {p.goodput_target}"),
            for_="30m",
            severity="warning",
            component="job",
            summary=f"Goodput (ETTR) under {p.goodput_target:.0%} ({where})",
            description="Productive time over wall time is under target; the badput-by-cause "
            "panel shows where the time goes.",
            runbook="The largest badput cause decides: restarts (fix failures), "
            "checkpoint_stall (async or less often), recomputed_steps (checkpoint more often).",
        ),
    ]


def _gpu_rules(p: RuleParams) -> list[AlertRule]:
    host = '{host}=~".+"'
    crit = "|".join(str(x) for x in p.critical_xids)
    warn = "|".join(str(x) for x in p.warning_xids)
    xid = "DCGM_FI_DEV_XID_ERRORS"
    xid_count = "DCGM_EXP_XID_ERRORS_COUNT"
    on = "GPU {{ $labels.gpu }} ({{ $labels.UUID }}) of node {{ $labels.node }}"
    temp = _gpu("DCGM_FI_DEV_GPU_TEMP")
    return [
        AlertRule(
            name="TrainGuardCriticalXid",
            expr=_gpu_by("max", _gpu(xid, f'err_code=~"{crit}"'), "err_code")
            + " > 0\nor "
            + _gpu_by(
                "max",
                f"label_replace({_gpu(xid_count, f'xid=~{chr(34)}{crit}{chr(34)}')}, "
                f'"err_code", "$1", "xid", "(.+)")',
                "err_code",
            )
            + " > 0",
            severity="critical",
            component="gpu",
            group="trainguard-gpu",
            summary=f"Critical XID {{{{ $labels.err_code }}}} on {on}",
            description=f"XIDs {crit} mean the GPU is unusable until reset or repaired "
            "(double-bit ECC, fallen off the bus, NVLink, GSP...).",
            runbook="Drain the node (scontrol update nodename=N state=drain reason=xid), reset "
            "or reboot it, run 'dcgmi diag -r 3'; RMA on repeat.",
        ),
        AlertRule(
            name="TrainGuardXid",
            expr=_gpu_by("max", _gpu(xid, f'err_code=~"{warn}"'), "err_code") + " > 0",
            severity="warning",
            component="gpu",
            group="trainguard-gpu",
            recovered_by_trainguard=True,
            summary=f"XID {{{{ $labels.err_code }}}} on {on}",
            description="An XID that usually comes from the application (restart the job's "
            "processes, which trainguard does); a repeat on one GPU points at hardware.",
            runbook="Nothing urgent; if the same GPU repeats it, drain and diagnose the node.",
        ),
        AlertRule(
            name="TrainGuardEccDbe",
            expr=_gpu_by("max", _gpu("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", host)) + " > 0",
            severity="critical",
            component="gpu",
            group="trainguard-gpu",
            summary=f"Double-bit ECC errors on {on}",
            description="Uncorrectable memory errors since the last reset: data on this GPU "
            "cannot be trusted.",
            runbook="Drain the node, reset the GPU (row remapping needs a reset), check "
            "DCGM_FI_DEV_ROW_REMAP_FAILURE; RMA if remapping failed.",
        ),
        AlertRule(
            name="TrainGuardRowRemapFailure",
            expr=_gpu_by("max", _gpu("DCGM_FI_DEV_ROW_REMAP_FAILURE", host)) + " > 0",
            severity="critical",
            component="gpu",
            group="trainguard-gpu",
            summary=f"Row remapping failed on {on}",
            description="The GPU ran out of spare memory rows: it must be replaced.",
            runbook="Drain the node permanently and open an RMA for the GPU (UUID above).",
        ),
        AlertRule(
            name="TrainGuardGpuMissing",
            expr=f"max_over_time((count by (node) ({temp}))[1h:5m])\n> count by (node) ({temp})",
            severity="critical",
            component="gpu",
            group="trainguard-gpu",
            summary="Node {{ $labels.node }} reports fewer GPUs than in the last hour",
            description="A GPU disappeared from dcgm-exporter (fallen off the bus, driver "
            "reset failed).",
            runbook="Check nvidia-smi and dmesg for XID 79 on the node; drain and reboot it.",
        ),
        AlertRule(
            name="TrainGuardThermalThrottling",
            expr=_gpu_by("max", _gpu("DCGM_FI_DEV_THERMAL_VIOLATION", host, fn="rate", window="5m"))
            + " / 1e6 > 0.1",
            for_="10m",
            severity="warning",
            component="gpu",
            group="trainguard-gpu",
            summary=f"Sustained thermal throttling on {on}",
            description="The GPU spent more than 10 % of the last 5 minutes throttled for "
            "temperature, for 10 minutes: it slows the whole job.",
            runbook="Check the node's cooling (fans, airflow, inlet temperature); move the "
            "job off the node if it persists.",
        ),
    ]


def _infra_rules(p: RuleParams) -> list[AlertRule]:
    node_of = '"node", "$1", "instance", "([^:]+)(:[0-9]+)?"'
    return [
        AlertRule(
            name="TrainGuardNodeDown",
            expr=f"max by (node) (label_replace(up, {node_of})) == 0",
            for_="1m",
            severity="critical",
            component="node",
            group="trainguard-infra",
            summary="Node {{ $labels.node }} is down: none of its exporters answers",
            description="Every scrape target of the node is down. Its GPU alerts are "
            "inhibited while this fires.",
            runbook="Check the node's power and network (ipmitool, the BMC), drain it in the "
            "scheduler and requeue its jobs.",
        ),
        AlertRule(
            name="TrainGuardExporterDown",
            expr=f'label_replace(up{{job="{p.dcgm_job}"}}, {node_of}) == 0',
            for_="2m",
            severity="warning",
            component="telemetry",
            group="trainguard-infra",
            summary="dcgm-exporter {{ $labels.instance }} is down",
            description="GPU health of the node is not being watched while the exporter is down.",
            runbook="Restart dcgm-exporter on the node (systemctl restart dcgm-exporter or its "
            "pod) and check its log.",
        ),
    ]


def _fleet_rules(p: RuleParams) -> list[AlertRule]:
    failures = tg("trainguard.fleet.failures", 'cause=~"hardware|network"')
    refused = tg("trainguard.fleet.lemon.refused_time")
    w = p.node_failure_window
    return [
        AlertRule(
            name="TrainGuardNodeFailureRate",
            expr=f"sum by (node) (increase({failures}[{w}])) >= {p.node_failures}",
            severity="warning",
            component="node",
            group="trainguard-fleet",
            summary=f"Node {{{{ $labels.node }}}} failed {p.node_failures} or more times in {w}",
            description="trainguard attributed that many failures to the node's hardware or "
            "network across its jobs; each cost a restart. Past [fleet] lemon_failures the "
            "node is refused by every later job.",
            runbook="trainguard fleet nodes and trainguard fleet lemons show the node's "
            "history with its evidence (XIDs, failed probes, collective timeouts); drain it "
            "(scontrol update nodename=N state=drain reason=...), run 'dcgmi diag -r 3' and "
            "repair it before it takes work again.",
        ),
        AlertRule(
            name="TrainGuardLemonRefused",
            expr=f"time() - max by (node) ({refused}) < {p.lemon_refused_s}",
            severity="warning",
            component="node",
            group="trainguard-fleet",
            recovered_by_trainguard=True,
            summary="Lemon node {{ $labels.node }} was refused at a job's start",
            description="Its fleet history crossed the lemon threshold: the job started "
            "without it (a spare took its place, if there was one) and every later job will "
            "refuse it too until an operator releases it.",
            runbook="Repair the node (trainguard fleet nodes shows why it is a lemon), then "
            "release it with 'trainguard fleet release NODE' (which runs its health check "
            "and resumes it in Slurm).",
        ),
    ]


def alert_rules(params: RuleParams | None = None) -> list[AlertRule]:
    p = params or RuleParams()
    rules = _job_rules(p) + _gpu_rules(p) + _infra_rules(p) + _fleet_rules(p)
    names = [r.name for r in rules]
    assert len(set(names)) == len(names), "duplicate alert names"
    return rules


def rules_document(params: RuleParams | None = None) -> dict[str, object]:
    """The rule file's content (``groups:``), one group per area."""
    groups: dict[str, list[dict[str, object]]] = {}
    for r in alert_rules(params):
        groups.setdefault(r.group, []).append(r.to_rule())
    return {"groups": [{"name": g, "rules": rs} for g, rs in groups.items()]}
