"""Unit tests: every contract metric's name, unit and value on a synthetic run (in-memory reader)."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from trainguard.core.contracts.metrics import (
    INCIDENT_KINDS,
    LOSS_CAUSES,
    METRICS,
    RESTART_CAUSES,
    ROLE_STATES,
    ROLLOUT_FAILURE_REASONS,
    by_name,
    prometheus_name,
)
from trainguard.core.goodput import compute_goodput
from trainguard.telemetry.mfu import PeakResolver, peak_flops, transformer_flops_per_token
from trainguard.telemetry.recorder import HUNG_MIN_HOLD_S, MetricsRecorder

T0 = 1_700_000_000.0
PEAK = 1e12
E0 = "http://127.0.0.1:8100"
"""A rollout engine's URL (its role replica's, as the role supervisor names it)."""


def synthetic_run() -> tuple[list[dict], list[dict]]:
    """Attempt 0: launch at T0, rendezvous 1 s, steps 0..4 of 0.5 s each starting at T0+3;
    rank 1 is killed at T0+6 (steps 3 and 4 were done); attempt 1: rendezvous 2 s, restored
    from step 2, steps 3..5 again from T0+10. Checkpoint stall 0.25 s. Finished at T0+12."""
    events = [
        {"time": T0, "kind": "launch", "attempt": 0},
        {"time": T0 + 1.0, "kind": "rendezvous", "attempt": 0, "duration_s": 1.0},
        {"time": T0 + 4.6, "kind": "checkpoint_saved", "attempt": 0, "stall_s": 0.25},
        {"time": T0 + 6.0, "kind": "worker_failed", "attempt": 0, "rank": 1, "cause": "signal"},
        {"time": T0 + 6.1, "kind": "restart", "attempt": 0, "reason": "failure"},
        {"time": T0 + 8.1, "kind": "rendezvous", "attempt": 1, "duration_s": 2.0},
        {"time": T0 + 12.0, "kind": "job_finished", "attempt": 1, "state": "succeeded"},
    ]
    records = []
    for i in range(5):  # attempt 0: steps 0..4 at T0+3 .. T0+5.5
        end = T0 + 3.0 + 0.5 * (i + 1)
        for rank in (0, 1):
            records.append(
                {"time": end, "kind": "step", "rank": rank, "attempt": 0, "step": i,
                 "step_time_s": 0.5, "tokens": 1000, "samples": 8, "flops": 2e11,
                 "device": "cpu", "spans": {"rollout": 0.3, "optimize": 0.1}}
            )  # fmt: skip
    for j, i in enumerate((3, 4, 5)):  # attempt 1: steps 3..5 at T0+10 .. T0+11.5
        end = T0 + 10.0 + 0.5 * (j + 1)
        records.append(
            {"time": end, "kind": "step", "rank": 0, "attempt": 1, "step": i, "step_time_s": 0.5}
        )
    return events, records


def collect(reader: InMemoryMetricReader) -> dict[str, tuple[str, list]]:
    data = reader.get_metrics_data()
    out: dict[str, tuple[str, list]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = (m.unit, list(m.data.data_points))
    return out


def point(points: list, **attrs: str):
    for p in points:
        if all(p.attributes.get(k) == v for k, v in attrs.items()):
            return p
    raise AssertionError(f"no point with {attrs} in {[dict(p.attributes) for p in points]}")


def test_every_contract_metric_has_name_unit_and_value() -> None:
    reader = InMemoryMetricReader()
    rec = MetricsRecorder(
        MeterProvider(metric_readers=[reader]),
        node="n0",
        peak=PeakResolver(override=PEAK),
        world_size=2,
    )
    events, records = synthetic_run()
    for r in records[:10]:
        rec.record(r)
    rec.record({"time": T0 + 5.5, "kind": "step", "rank": 0, "attempt": 0, "step": 4,
                "step_time_s": 0.5, "tokens": 1000, "samples": 8, "flops": 2e11,
                "gpu_memory_bytes": 3e9, "gpu_memory_peak_bytes": 4e9})  # fmt: skip
    rec.record(
        {"kind": "log", "rank": 0, "step": 4, "loss": 2.5, "grad_norm": 0.75, "lr": 1e-3,
         "reward": 0.6, "reward_std": 0.2, "reward_min": 0.0, "reward_max": 1.0, "kl": 0.05,
         "entropy": 1.25, "clip_ratio": 0.125, "response_length": 3.5,
         "response_length_max": 6, "rollout_time_s": 0.3, "optimize_time_s": 0.1,
         "checkpoint_persist_s": 1.5, "checkpoint_stall_s": 0.25, "checkpoint_bytes": 2e6,
         "checkpoint_interval_s": 360.0, "checkpoint_failures": 2, "rollout_retries": 3,
         "rollout_latency_p50_s": 0.2, "rollout_latency_p99_s": 0.9, "rollout_tokens_per_s": 640.0,
         "engines_serving": 2, "weight_sync_s": 0.05, "weight_sync_timeout_s": 3.0,
         "staleness_max": 1, "engines_total": 3, "staleness_mean": 0.5}
    )  # fmt: skip
    for ev in events + [
        {"time": T0 + 5.0, "kind": "straggler_detected", "rank": 1},
        {"time": T0 + 5.1, "kind": "preflight", "status": "ok"},  # not an incident
        {"time": T0 + 5.2, "kind": "preflight", "status": "unhealthy"},
        {"time": T0 + 5.3, "kind": "checkpoint_committed", "step": 4},
        {"time": T0 + 5.4, "kind": "rollout_failed", "reason": "refused", "engine": "e0"},
        {
            "time": T0 + 5.5,
            "kind": "rollout_failed",
            "reason": "refused",
            "engine": "e1",
            "retried": True,
        },
        {
            "time": T0 + 5.6,
            "kind": "rollout_failed",
            "reason": "timeout",
            "engine": "e1",
            "retried": False,
        },
        {"time": T0 + 5.6, "kind": "rollout_refit_verified", "engine": E0, "version": 3},
        {"time": T0 + 5.6, "kind": "rollout_engine_quarantined", "engine": "e1", "version": 3},
        {
            "time": T0 + 5.4,
            "kind": "role_replica_started",
            "role": "rollout",
            "replica": 0,
            "restarts": 0,
            "total": 2,
            "url": E0 + "/",
        },
        {
            "time": T0 + 5.4,
            "kind": "role_replica_state",
            "role": "rollout",
            "replica": 0,
            "state": "serving",
            "weight_version": 7,
            "serving": 1,
            "total": 2,
        },
        {
            "time": T0 + 5.5,
            "kind": "role_replica_state",
            "role": "rollout",
            "replica": 0,
            "state": "dead",
            "serving": 0,
            "total": 2,
        },
        {
            "time": T0 + 5.6,
            "kind": "role_replica_started",
            "role": "rollout",
            "replica": 0,
            "restarts": 1,
            "total": 2,
        },
        {
            "time": T0 + 5.7,
            "kind": "role_replica_state",
            "role": "rollout",
            "replica": 0,
            "state": "serving",
            "weight_version": 8,
            "serving": 1,
            "total": 2,
        },
        # the scheduler's share of an allocation (trainguard sbatch's batch host)
        {
            "time": T0 + 5.8,
            "kind": "slurm_schedule",
            "job_id": "41",
            "restart": 1,
            "queue_wait_s": 13.0,
            "prolog_s": 2.0,
            "requeue_gap_s": 14.0,
        },  # fmt: skip
    ]:
        rec.event(ev)
    rec.straggler_scores({"0": 0.0, "1": 0.5})
    # fleet health: this node's attributed failure and sniff flag, another node's lemon refusal
    # (read from the run's shared event log), the sniff results
    for ev in (
        {"time": T0 + 6.0, "kind": "workers_started", "node": "n0", "attempt": 1},
        {"time": T0 + 6.1, "kind": "failure_attributed", "node": "n0", "cause": "hardware"},
        {"time": T0 + 6.2, "kind": "sniff_degraded", "node": "n0", "rank": 1},
    ):
        rec.event(ev)
    rec.fleet_event({"time": T0 + 6.3, "kind": "node_refused", "node": "n9", "lemon": True})
    rec.fleet_event({"time": T0 + 6.4, "kind": "node_refused", "node": "n8", "until": 1.0})
    rec.record({"kind": "sniff", "rank": 0, "step": 9, "gemm_s": 0.01, "allreduce_s": 0.002,
                "overhead": 0.004})  # fmt: skip
    rec.sniff_slowdowns({"0": {"ratio": 1.25}, "1": {"gemm_s": 0.02}})
    rec.run_info(run_id="r1", job_id="j1")
    rec.goodput(compute_goodput(events, records))
    rec.export_failure("otlp_traces", 3)

    got = collect(reader)
    r0 = {"rank": "0", "node": "n0"}
    expected_values = {
        "trainguard.train.step": 4,
        "trainguard.train.throughput": 2000.0,
        "trainguard.train.sample_throughput": 16.0,
        "trainguard.train.flops": 4e11,
        "trainguard.train.mfu": 0.4,
        "trainguard.train.loss": 2.5,
        "trainguard.train.grad_norm": 0.75,
        "trainguard.train.lr": 1e-3,
        "trainguard.gpu.memory.used": 3e9,
        "trainguard.gpu.memory.peak": 4e9,
        "trainguard.rl.reward.mean": 0.6,
        "trainguard.rl.reward.std": 0.2,
        "trainguard.rl.reward.min": 0.0,
        "trainguard.rl.reward.max": 1.0,
        "trainguard.rl.kl": 0.05,
        "trainguard.rl.entropy": 1.25,
        "trainguard.rl.clip_fraction": 0.125,
        "trainguard.rl.response_length.mean": 3.5,
        "trainguard.rl.response_length.max": 6,
        "trainguard.rl.rollout.duration": 0.3,
        "trainguard.rl.optimize.duration": 0.1,
        "trainguard.checkpoint.size": 2e6,
        "trainguard.checkpoint.interval": 360.0,
        "trainguard.checkpoint.failures": 2,
        "trainguard.health.straggler_score": 0.0,
        "trainguard.rl.rollout.retries": 3,
        "trainguard.rl.rollout.latency.p50": 0.2,
        "trainguard.rl.rollout.latency.p99": 0.9,
        "trainguard.rl.rollout.throughput": 640.0,
        "trainguard.rl.rollout.engines_routable": 2,
        "trainguard.rl.rollout.engines_declared": 3,
        "trainguard.rl.staleness.mean": 0.5,
        "trainguard.rl.weight_sync.duration": 0.05,
        "trainguard.rl.weight_sync.timeout": 3.0,
        "trainguard.rl.staleness.max": 1,
        "trainguard.sniff.gemm_time": 0.01,
        "trainguard.sniff.allreduce_time": 0.002,
        "trainguard.sniff.overhead": 0.004,
        "trainguard.sniff.slowdown": 1.25,
    }
    job_values = {
        "trainguard.job.throughput": 4000.0,
        "trainguard.job.sample_throughput": 32.0,
        "trainguard.job.attempt": 1,
        "trainguard.goodput.productive_time": 3.0,  # steps 0..5 once
        "trainguard.goodput.ettr": 0.25,  # 3 s of 12 s
        "trainguard.checkpoint.last_commit.time": T0 + 5.3,
        "trainguard.job.hung": 0,
    }
    fleet = got["trainguard.fleet.failures"][1]
    assert point(fleet, node="n0", cause="hardware").value == 1
    assert point(fleet, node="n0", cause="user_code").value == 0  # every cause from 0
    state = got["trainguard.fleet.node.state"][1]
    assert point(state, node="n0", state="degraded").value == 1
    assert point(state, node="n0", state="ok").value == 0
    assert point(state, node="n9", state="lemon").value == 1
    assert [p.attributes["node"] for p in got["trainguard.fleet.lemon.refused_time"][1]] == ["n9"]
    assert point(got["trainguard.fleet.lemon.refused_time"][1], node="n9").value == T0 + 6.3
    seen = set()
    for spec in METRICS:
        assert spec.name in got, f"{spec.name} has no data"
        unit, points = got[spec.name]
        assert unit == spec.unit, spec.name
        seen.add(spec.name)
        if spec.name in expected_values:
            assert point(points, **r0).value == pytest.approx(expected_values[spec.name]), spec.name
        elif spec.name in job_values:
            assert point(points, node="n0").value == pytest.approx(job_values[spec.name])
    assert seen == {m.name for m in METRICS}

    dur = point(got["trainguard.train.step.duration"][1], **r0)
    assert dur.count == 6 and dur.sum == pytest.approx(3.0)
    assert point(got["trainguard.checkpoint.stall.duration"][1]).sum == pytest.approx(0.25)
    assert point(got["trainguard.checkpoint.persist.duration"][1]).sum == pytest.approx(1.5)
    assert point(got["trainguard.job.failures"][1], cause="signal").value == 1
    # the restart's cause is the failure that caused it, not the agent's generic reason
    assert point(got["trainguard.job.restarts"][1], cause="signal").value == 1
    assert point(got["trainguard.telemetry.export.failures"][1], exporter="otlp_traces").value == 3
    info = point(got["trainguard.run.info"][1], run_id="r1")
    assert info.value == 1 and info.attributes["job_id"] == "j1"
    incidents = {p.attributes["kind"]: p.value for p in got["trainguard.health.incidents"][1]}
    assert incidents == {k: 0 for k in INCIDENT_KINDS} | {
        "straggler_detected": 1,
        "preflight_failed": 1,
    }
    assert point(got["trainguard.health.straggler_score"][1], rank="1").value == 0.5
    failed = {p.attributes["reason"]: p.value for p in got["trainguard.rl.rollout.failed"][1]}
    assert failed == {r: 0 for r in ROLLOUT_FAILURE_REASONS} | {"refused": 2, "timeout": 1}
    retried = {p.attributes["reason"]: p.value for p in got["trainguard.rl.rollout.retried"][1]}
    assert retried == {r: 0 for r in ROLLOUT_FAILURE_REASONS} | {"refused": 2}
    # the refit checks per engine: exported from 0 for each engine the rollout role started
    refits = {
        check: {p.attributes["engine"]: p.value for p in got[f"trainguard.rl.refit.{check}"][1]}
        for check in ("verified", "quarantined")
    }
    assert refits == {"verified": {E0: 1}, "quarantined": {E0: 0, "e1": 1}}
    fleet = {"node": "n0", "role": "rollout"}
    assert point(got["trainguard.role.replicas.serving"][1], **fleet).value == 1
    assert point(got["trainguard.role.replicas.total"][1], **fleet).value == 2
    assert point(got["trainguard.role.restarts"][1], **fleet).value == 1
    assert point(got["trainguard.role.restarts"][1], role="reward").value == 0
    states = {
        p.attributes["state"]: p.value
        for p in got["trainguard.role.replica.state"][1]
        if p.attributes["replica"] == "0"
    }
    assert states == {s: 0 for s in ROLE_STATES} | {"serving": 1}
    assert point(got["trainguard.role.replica.weight_version"][1], replica="0").value == 8
    lost = {p.attributes["cause"]: p.value for p in got["trainguard.goodput.lost_time"][1]}
    assert set(lost) == set(LOSS_CAUSES)
    assert lost["rendezvous"] == pytest.approx(3.0)
    sched = {p.attributes["phase"]: p.value for p in got["trainguard.slurm.schedule_time"][1]
             if p.attributes["allocation"] == "41.1"}  # fmt: skip
    assert sched == {"queue_wait": 13.0, "prolog": 2.0, "requeue_gap": 14.0}
    assert lost["recomputed_steps"] == pytest.approx(1.0)  # steps 3, 4 redone


def test_job_hung_gauge_holds_from_the_verdict_to_the_next_completed_step() -> None:
    reader = InMemoryMetricReader()
    rec = MetricsRecorder(MeterProvider(metric_readers=[reader]), node="n0")

    def hung() -> float:
        points = collect(reader)["trainguard.job.hung"][1]
        return max(p.value for p in points if p.attributes.get("node") == "n0")

    assert hung() == 0
    rec.event({"time": T0 + 10, "kind": "hang_detected", "ranks": [1]})
    assert hung() == 1
    rec.event({"time": T0 + 10.5, "kind": "hang_diagnosis", "diagnosis": "missing"})
    by_label = {
        p.attributes["diagnosis"]: p.value for p in collect(reader)["trainguard.job.hung"][1]
    }
    assert by_label == {"none": 0, "pending": 0, "missing": 1}  # the alert's diagnosis label
    # a record written before the verdict (read late) does not clear it
    rec.record({"time": T0 + 9, "kind": "step", "rank": 0, "step": 3, "step_time_s": 0.1})
    rec.event({"time": T0 + 11, "kind": "workers_started", "attempt": 1})
    assert hung() == 1
    rec.record({"time": T0 + 14, "kind": "step", "rank": 0, "step": 3, "step_time_s": 0.1})
    assert hung() == 1  # recovered, but held HUNG_MIN_HOLD_S for scrapers to see it
    rec.record({"time": T0 + 10 + HUNG_MIN_HOLD_S + 1, "kind": "step", "rank": 0, "step": 4})
    assert hung() == 0
    restarts = {
        p.attributes["cause"]: p.value for p in collect(reader)["trainguard.job.restarts"][1]
    }
    assert restarts == {c: 0 for c in RESTART_CAUSES}  # exported from 0, before any restart
    # a node that learns of the hang from another node's agent: its diagnosis raises it too
    peer = MetricsRecorder(
        MeterProvider(metric_readers=[reader2 := InMemoryMetricReader()]), node="n1"
    )
    peer.event({"time": T0 + 10.6, "kind": "hang_diagnosis", "diagnosis": "missing"})
    by_label = {
        p.attributes["diagnosis"]: p.value for p in collect(reader2)["trainguard.job.hung"][1]
    }
    assert by_label == {"none": 0, "missing": 1}


def test_goodput_breakdown_of_the_synthetic_run() -> None:
    events, records = synthetic_run()
    g = compute_goodput(events, records)
    assert g.total_s == pytest.approx(12.0)
    assert g.productive_s == pytest.approx(3.0)
    assert g.num_recomputed_steps == 2
    lost = g.lost_s
    assert lost["startup"] == pytest.approx(2.0)  # launch → first step (T0+3) less 1 s rdzv
    assert lost["rendezvous"] == pytest.approx(3.0)
    assert lost["checkpoint_stall"] == pytest.approx(0.25)
    # last step end T0+5.5 → failure T0+6 (0.5), failure → next first step T0+10 less 2 s rdzv
    assert lost["restart"] == pytest.approx(0.5 + 2.0)
    assert lost["hang"] == 0.0
    assert g.productive_s + sum(lost.values()) == pytest.approx(g.total_s)
    assert g.ettr == pytest.approx(0.25)


def test_hang_is_its_own_cause() -> None:
    events = [
        {"time": T0, "kind": "launch", "attempt": 0},
        {"time": T0 + 9.0, "kind": "hang_detected", "attempt": 0, "rank": 0},
        {"time": T0 + 10.0, "kind": "job_finished", "attempt": 0},
    ]
    records = [{"time": T0 + 2.0, "kind": "step", "rank": 0, "attempt": 0, "step": 0,
                "step_time_s": 1.0}]  # fmt: skip
    g = compute_goodput(events, records)
    assert g.lost_s["hang"] == pytest.approx(7.0)


def test_unknown_device_omits_mfu_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    reader = InMemoryMetricReader()
    rec = MetricsRecorder(MeterProvider(metric_readers=[reader]), node="n0")
    with caplog.at_level(logging.WARNING, logger="trainguard.telemetry.mfu"):
        for i in range(3):
            rec.record({"kind": "step", "rank": 0, "step": i, "step_time_s": 0.1, "flops": 1e9,
                        "device": "cpu"})  # fmt: skip
    got = collect(reader)
    assert "trainguard.train.mfu" not in got
    assert "trainguard.train.flops" in got
    assert len([r for r in caplog.records if "MFU omitted" in r.getMessage()]) == 1


def test_peak_table_and_formula() -> None:
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None
    assert PeakResolver(override=5.0).peak("NVIDIA H200") == 5.0
    f = transformer_flops_per_token(
        num_params=10, num_layers=2, num_heads=4, head_dim=8, seq_len=16
    )
    assert f == 6 * 10 + 6 * 2 * 4 * 8 * 16


def test_prometheus_names_are_derived() -> None:
    assert by_name("trainguard.train.throughput").prometheus == (
        "trainguard_train_throughput_per_second"
    )
    assert by_name("trainguard.train.mfu").prometheus == "trainguard_train_mfu_ratio"
    assert by_name("trainguard.train.step.duration").prometheus == (
        "trainguard_train_step_duration_seconds"
    )
    assert by_name("trainguard.job.failures").prometheus == "trainguard_job_failures_total"
    assert prometheus_name(by_name("trainguard.rl.kl")) == "trainguard_rl_kl"
    for m in METRICS:
        assert m.description and m.unit
