"""promtool unit tests for every alert rule: a case that fires it and one that keeps it quiet.

``promtool test rules dashboards/prometheus/trainguard-alerts.test.yml`` runs them; the test
suite does too, and checks that every rule has both kinds of case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.dashboards.promql import tg
from trainguard.dashboards.rules import AlertRule, alert_rules, render_annotation

__all__ = ["CASES", "Case", "tests_document"]

AGENT = {"job": "trainguard", "instance": "n1:9464", "node": "n1"}
JOB = {"instance": "n1:9464", "node": "n1", "job_id": "j1", "slurm_job_id": "42"}


def _sel(name: str, labels: dict[str, str]) -> str:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{name}{{{inner}}}"


def _tg(name: str, values: str, **labels: str) -> tuple[str, str]:
    return _sel(tg(name), {**AGENT, **labels}), values


def _run_info(minutes: int) -> tuple[str, str]:
    info = {**AGENT, "run_id": "r1", "job_id": "j1", "slurm_job_id": "42"}
    return _sel(tg("trainguard.run.info"), info), f"1x{minutes}"


def _dcgm(name: str, values: str, *, gpu: str = "3", host_label: str = "Hostname",
          host: str = "node-1", **labels: str) -> tuple[str, str]:  # fmt: skip
    base = {"job": "dcgm", "instance": f"{host}:9400", "gpu": gpu, "UUID": f"GPU-{gpu}",
            "modelName": "NVIDIA H100 80GB HBM3", host_label: host}  # fmt: skip
    return _sel(name, {**base, **labels}), values


def _gpu_labels(gpu: str = "3", node: str = "node-1", **extra: str) -> dict[str, str]:
    return {"node": node, "gpu": gpu, "UUID": f"GPU-{gpu}", **extra}


@dataclass(frozen=True)
class Case:
    alert: str
    fires: bool
    eval_time: str
    series: list[tuple[str, str]]
    labels: dict[str, str] = field(default_factory=dict)
    """The fired alert's labels besides alertname, severity and component."""
    note: str = ""


def _job_cases() -> list[Case]:
    m = 60
    return [
        Case("TrainGuardJobHung", True, "3m",
             [_run_info(m), _tg("trainguard.job.hung", "0 0 1 1", diagnosis="missing")],
             {**JOB, "diagnosis": "missing"}),
        Case("TrainGuardJobHung", False, "3m",
             [_run_info(m), _tg("trainguard.job.hung", "0 1 0 0", diagnosis="divergent")],
             note="recovered"),
        Case("TrainGuardNoStepProgress", True, "45m",
             [_run_info(m), _tg("trainguard.train.step", "1+1x20 21x30", rank="0")], JOB),
        Case("TrainGuardNoStepProgress", False, "45m",
             [_run_info(m), _tg("trainguard.train.step", "1+1x50", rank="0")]),
        Case("TrainGuardNoStepProgress", False, "40m",
             [_run_info(m), _tg("trainguard.train.step", "_x30 5x15", rank="0")],
             note="a job younger than the window is not hung"),
        Case("TrainGuardCrashLoop", True, "20m",
             [_run_info(m), _tg("trainguard.job.restarts", "0x10 1 2 3 3x20", cause="killed"),
              _tg("trainguard.train.step", "5x40", rank="0")], JOB),
        Case("TrainGuardCrashLoop", False, "20m",
             [_run_info(m), _tg("trainguard.job.restarts", "0x10 1 2 3 3x20", cause="killed"),
              _tg("trainguard.train.step", "1+1x40", rank="0")], note="restarts but progress"),
        Case("TrainGuardTrainingStopped", True, "5m",
             [(_sel("up", {"job": "trainguard", "instance": "n1:9464"}), "1 1 0 0 0 0")],
             {"job": "trainguard", "instance": "n1:9464"}),
        Case("TrainGuardTrainingStopped", False, "5m",
             [(_sel("up", {"job": "trainguard", "instance": "n1:9464"}), "1x5")]),
        Case("TrainGuardRestartStorm", True, "10m",
             [_run_info(m), _tg("trainguard.job.restarts", "0+1x10", cause="killed")], JOB),
        Case("TrainGuardRestartStorm", False, "10m",
             [_run_info(m), _tg("trainguard.job.restarts", "0 0 1 1x8", cause="killed")]),
        Case("TrainGuardNodeDrained", True, "3m",
             [_run_info(m), _tg("trainguard.health.incidents", "0 0 1 1", kind="node_excluded")],
             JOB),
        Case("TrainGuardNodeDrained", False, "3m",
             [_run_info(m), _tg("trainguard.health.incidents", "0 0 1 1", kind="straggler_detected")]),
        Case("TrainGuardHangRecovered", True, "3m",
             [_run_info(m), _tg("trainguard.health.incidents", "0 0 1 1", kind="hang_detected")],
             JOB),
        Case("TrainGuardHangRecovered", False, "3m",
             [_run_info(m), _tg("trainguard.health.incidents", "0 0 0 0", kind="hang_detected")]),
        Case("TrainGuardThroughputDrop", True, "160m",
             [_run_info(200), _tg("trainguard.job.throughput", "1000x130 500x40")], JOB),
        Case("TrainGuardThroughputDrop", False, "160m",
             [_run_info(200), _tg("trainguard.job.throughput", "1000x170")]),
        Case("TrainGuardMfuDrop", True, "160m",
             [_run_info(200), _tg("trainguard.train.mfu", "0.4x130 0.2x40", rank="0")], JOB),
        Case("TrainGuardMfuDrop", False, "160m",
             [_run_info(200), _tg("trainguard.train.mfu", "0.4x130 0.35x40", rank="0")]),
        Case("TrainGuardLossNaN", True, "3m",
             [_run_info(m), _tg("trainguard.train.loss", "1 2 NaN NaN", rank="0")], JOB),
        Case("TrainGuardLossNaN", True, "3m",
             [_run_info(m), _tg("trainguard.train.loss", "1 2 Inf Inf", rank="1")], JOB),
        Case("TrainGuardLossNaN", False, "3m",
             [_run_info(m), _tg("trainguard.train.loss", "1 2 3 3", rank="0")]),
        Case("TrainGuardLossSpike", True, "80m",
             [_run_info(100), _tg("trainguard.train.loss", "2+0x70 100x20", rank="0")], JOB),
        Case("TrainGuardLossSpike", False, "80m",
             [_run_info(100), _tg("trainguard.train.loss", "2x70 2.1x20", rank="0")]),
        Case("TrainGuardKlBlowup", True, "80m",
             [_run_info(100), _tg("trainguard.rl.kl", "0.01x70 1x20", rank="0")], JOB),
        Case("TrainGuardKlBlowup", False, "80m",
             [_run_info(100), _tg("trainguard.rl.kl", "0.01x70 0.05x20", rank="0")],
             note="10x but under the absolute floor"),
        Case("TrainGuardRewardCollapse", True, "175m",
             [_run_info(200), _tg("trainguard.rl.reward.mean", "0.5x150 0.1x30", rank="0"),
              _tg("trainguard.rl.reward.std", "0.2x180", rank="0")], JOB),
        Case("TrainGuardRewardCollapse", True, "30m",
             [_run_info(m), _tg("trainguard.rl.reward.mean", "0.5x40", rank="0"),
              _tg("trainguard.rl.reward.std", "0.2x5 0x35", rank="0")], JOB,
             note="every rollout gets the same reward"),
        Case("TrainGuardRewardCollapse", False, "175m",
             [_run_info(200), _tg("trainguard.rl.reward.mean", "0.5x180", rank="0"),
              _tg("trainguard.rl.reward.std", "0.2x180", rank="0")]),
        Case("TrainGuardRolloutFleetDegraded", True, "10m",
             [_run_info(m), _tg("trainguard.role.replicas.serving", "2 2 0x10", role="rollout"),
              _tg("trainguard.role.replicas.total", "2x12", role="rollout")],
             {**JOB, "role": "rollout"}),
        Case("TrainGuardRolloutFleetDegraded", False, "10m",
             [_run_info(m), _tg("trainguard.role.replicas.serving", "2 2 1x10", role="rollout"),
              _tg("trainguard.role.replicas.total", "2x12", role="rollout")],
             note="half the fleet serves"),
        Case("TrainGuardRolloutFleetDegraded", False, "10m",
             [_run_info(m), _tg("trainguard.role.replicas.serving", "2 0 0 2x9", role="rollout"),
              _tg("trainguard.role.replicas.total", "2x12", role="rollout")],
             note="an engine restart"),
        Case("TrainGuardRolloutFailures", True, "30m",
             [_run_info(m), _tg("trainguard.rl.rollout.failed", "0+6x40", reason="timeout")], JOB),
        Case("TrainGuardRolloutFailures", False, "30m",
             [_run_info(m), _tg("trainguard.rl.rollout.failed", "0+1x40", reason="timeout")],
             note="one a minute"),
        Case("TrainGuardWeightSyncTimeout", True, "5m",
             [_run_info(m), _tg("trainguard.rl.weight_sync.duration", "0.05x4 3.2x2", rank="0"),
              _tg("trainguard.rl.weight_sync.timeout", "3x6", rank="0")], JOB),
        Case("TrainGuardWeightSyncTimeout", False, "5m",
             [_run_info(m), _tg("trainguard.rl.weight_sync.duration", "0.05x3 3.2 0.05 0.05", rank="0"),
              _tg("trainguard.rl.weight_sync.timeout", "3x6", rank="0")],
             note="the next sync was in time"),
        Case("TrainGuardWeightSyncTimeout", False, "5m",
             [_run_info(m), _tg("trainguard.rl.weight_sync.duration", "0.05x3 0x3", rank="0"),
              _tg("trainguard.rl.weight_sync.timeout", "3x3 0x3", rank="0")],
             note="a restarted trainer reattached without a sync (0 s of 0 s)"),
        Case("TrainGuardCheckpointStale", True, "30m",
             [_run_info(m), _tg("trainguard.checkpoint.last_commit.time", "60x40"),
              _tg("trainguard.checkpoint.interval", "300x40", rank="0")], JOB),
        Case("TrainGuardCheckpointStale", True, "130m",
             [_run_info(150), _tg("trainguard.checkpoint.last_commit.time", "60x150")], JOB,
             note="no interval reported: the fallback age"),
        Case("TrainGuardCheckpointStale", False, "30m",
             [_run_info(m), _tg("trainguard.checkpoint.last_commit.time", "0+60x40"),
              _tg("trainguard.checkpoint.interval", "300x40", rank="0")]),
        Case("TrainGuardGoodputLow", True, "35m",
             [_run_info(m), _tg("trainguard.goodput.ettr", "0.5x40")], JOB),
        Case("TrainGuardGoodputLow", False, "35m",
             [_run_info(m), _tg("trainguard.goodput.ettr", "0.95x40")]),
    ]  # fmt: skip


def _gpu_cases() -> list[Case]:
    xid = "DCGM_FI_DEV_XID_ERRORS"
    return [
        Case("TrainGuardCriticalXid", True, "2m",
             [_dcgm(xid, "0 79 79", err_code="79", err_msg="GPU has fallen off the bus")],
             _gpu_labels(err_code="79")),
        Case("TrainGuardCriticalXid", True, "2m",
             [_dcgm("DCGM_EXP_XID_ERRORS_COUNT", "0 1 1", gpu="5", host_label="hostname",
                    host="node-2", xid="48", window_size_in_ms="300000")],
             _gpu_labels("5", "node-2", err_code="48"), note="the XID count metric"),
        Case("TrainGuardCriticalXid", False, "2m",
             [_dcgm(xid, "0 13 13", err_code="13", err_msg="Graphics engine exception")]),
        Case("TrainGuardXid", True, "2m",
             [_dcgm(xid, "0 13 13", host_label="hostname", err_code="13", err_msg="")],
             _gpu_labels(err_code="13")),
        Case("TrainGuardXid", False, "2m", [_dcgm(xid, "0 0 0", err_code="0", err_msg="")]),
        Case("TrainGuardEccDbe", True, "2m",
             [_dcgm("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "0 0 2")], _gpu_labels()),
        Case("TrainGuardEccDbe", False, "2m",
             [_dcgm("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "0 0 0", host_label="hostname")]),
        Case("TrainGuardRowRemapFailure", True, "2m",
             [_dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", "0 1 1", host_label="hostname")],
             _gpu_labels()),
        Case("TrainGuardRowRemapFailure", False, "2m",
             [_dcgm("DCGM_FI_DEV_ROW_REMAP_FAILURE", "0 0 0")]),
        Case("TrainGuardGpuMissing", True, "60m",
             [_dcgm("DCGM_FI_DEV_GPU_TEMP", "40x70", gpu="0", host_label="hostname"),
              _dcgm("DCGM_FI_DEV_GPU_TEMP", "40x30", gpu="1", host_label="hostname")],
             {"node": "node-1"}),
        Case("TrainGuardGpuMissing", False, "60m",
             [_dcgm("DCGM_FI_DEV_GPU_TEMP", "40x70", gpu="0"),
              _dcgm("DCGM_FI_DEV_GPU_TEMP", "40x70", gpu="1")]),
        Case("TrainGuardThermalThrottling", True, "20m",
             [_dcgm("DCGM_FI_DEV_THERMAL_VIOLATION", "0+12000000x30")], _gpu_labels()),
        Case("TrainGuardThermalThrottling", False, "20m",
             [_dcgm("DCGM_FI_DEV_THERMAL_VIOLATION", "0+1000000x30")]),
        Case("TrainGuardNodeDown", True, "3m",
             [(_sel("up", {"job": "dcgm", "instance": "node-1:9400"}), "0x5"),
              (_sel("up", {"job": "trainguard", "instance": "node-1:9464"}), "0x5")],
             {"node": "node-1"}),
        Case("TrainGuardNodeDown", False, "3m",
             [(_sel("up", {"job": "dcgm", "instance": "node-1:9400"}), "0x5"),
              (_sel("up", {"job": "trainguard", "instance": "node-1:9464"}), "1x5")],
             note="one exporter down is not a node down"),
        Case("TrainGuardExporterDown", True, "4m",
             [(_sel("up", {"job": "dcgm", "instance": "node-1:9400"}), "0x5")],
             {"job": "dcgm", "instance": "node-1:9400", "node": "node-1"}),
        Case("TrainGuardExporterDown", False, "4m",
             [(_sel("up", {"job": "dcgm", "instance": "node-1:9400"}), "1x5")]),
    ]  # fmt: skip


def _fleet_cases() -> list[Case]:
    f = "trainguard.fleet.failures"
    refused = tg("trainguard.fleet.lemon.refused_time")
    other = {"job": "trainguard", "instance": "n2:9464", "node": "n7"}
    return [
        Case("TrainGuardNodeFailureRate", True, "60m",
             [_tg(f, "0x10 1x10 2x10 3x40", cause="hardware"),
              _tg(f, "0x70", cause="user_code")], {"node": "n1"}),
        Case("TrainGuardNodeFailureRate", True, "60m",
             [_tg(f, "0x10 1x60", cause="hardware"),
              (_sel(tg(f), {**AGENT, "instance": "n1:9465", "cause": "network"}), "0x20 2x50")],
             {"node": "n1"}, note="two jobs' agents on the node"),
        Case("TrainGuardNodeFailureRate", False, "60m",
             [_tg(f, "0x10 1x10 2x50", cause="hardware"),
              _tg(f, "0x10 5x60", cause="user_code")], note="user errors are not the node's"),
        Case("TrainGuardLemonRefused", True, "10m",
             [(_sel(refused, other), "_x5 300x10")], {"node": "n7"}),
        Case("TrainGuardLemonRefused", False, "40m",
             [(_sel(refused, other), "60x45")], note="refused more than 30 minutes ago"),
    ]  # fmt: skip


CASES: list[Case] = _job_cases() + _gpu_cases() + _fleet_cases()


def _expected(rule: AlertRule, case: Case) -> dict[str, object]:
    labels = {**case.labels, **rule.labels()}
    render = {**labels, "alertname": rule.name}
    return {
        "exp_labels": dict(sorted(labels.items())),
        "exp_annotations": {k: render_annotation(v, render) for k, v in rule.annotations().items()},
    }


def tests_document(rule_file: str) -> dict[str, object]:
    """The promtool test file for the rule file named ``rule_file`` (relative to it)."""
    rules = {r.name: r for r in alert_rules()}
    tests = []
    for case in CASES:
        rule = rules[case.alert]
        tests.append(
            {
                "name": f"{case.alert} {'fires' if case.fires else 'stays quiet'}"
                + (f" ({case.note})" if case.note else ""),
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series],
                "alert_rule_test": [
                    {
                        "eval_time": case.eval_time,
                        "alertname": case.alert,
                        "exp_alerts": [_expected(rule, case)] if case.fires else [],
                    }
                ],
            }
        )
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
