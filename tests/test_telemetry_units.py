"""Unit tests of the telemetry pieces: worker spans, tailing, exporters, endpoint, plugin."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tests.launch_utils import REPO, base_env
from trainguard.core.config import TrainGuardConfig
from trainguard.core.config.telemetry import TelemetryConfig
from trainguard.core.events import MSG_STRAGGLER_SCORES
from trainguard.core.jsonl import JsonlTail
from trainguard.core.plugin import AgentContext
from trainguard.telemetry.exporters import (
    CountingMetricExporter,
    CountingSpanExporter,
    JsonlMetricExporter,
    resolve_otlp,
)
from trainguard.telemetry.plugin import TelemetryPlugin
from trainguard.telemetry.prometheus import PrometheusBridge, PrometheusEndpoint
from trainguard.telemetry.spans import (
    TRACEPARENT_ENV,
    SpanRecorder,
    format_traceparent,
    parse_traceparent,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def test_traceparent_roundtrip_and_malformed() -> None:
    assert parse_traceparent(format_traceparent(TRACE, PARENT)) == (TRACE, PARENT)
    for bad in (
        None,
        "",
        "00-xyz-abc-01",
        f"00-{TRACE}-{PARENT}",
        f"00-{TRACE}-zzzzzzzzzzzzzzzz-01",
    ):
        assert parse_traceparent(bad) is None


def test_worker_spans_sampling_parentage_and_durations() -> None:
    out: list[dict] = []
    rec = SpanRecorder(out.append, traceparent=format_traceparent(TRACE, PARENT), every_n_steps=5)
    for step in range(11):
        sid, start = rec.begin_step(step)
        with rec.span("rollout", batch=4):
            pass
        with rec.span("optimize"):
            pass
        durations = rec.take_durations()
        assert set(durations) == {"rollout", "optimize"}
        rec.end_step(step, sid, start)
    steps = [r for r in out if r["name"] == "step"]
    assert [r["attributes"]["step"] for r in steps] == [0, 1, 2, 5, 10]
    by_id = {r["span_id"]: r for r in out}
    for r in out:
        assert r["trace_id"] == TRACE and r["kind"] == "span"
        if r["name"] == "step":
            assert r["parent_span_id"] == PARENT
        else:
            assert by_id[r["parent_span_id"]]["name"] == "step"
            assert r["start"] <= r["end"]
    assert len([r for r in out if r["name"] == "rollout"]) == 5
    assert next(r for r in out if r["name"] == "rollout")["attributes"] == {"batch": 4}


def test_worker_span_records_exceptions() -> None:
    out: list[dict] = []
    rec = SpanRecorder(out.append)
    with pytest.raises(KeyError):
        with rec.span("reward"):
            raise KeyError("boom")
    (span,) = out
    assert span["status"] == "error"
    assert span["events"][0]["attributes"]["exception.type"] == "KeyError"
    assert span["parent_span_id"] is None


def test_import_and_init_do_not_load_opentelemetry(tmp_path: Path) -> None:
    code = (
        "import sys, trainguard; tg = trainguard.init(run_dir=sys.argv[1]);"
        "\nwith tg.step(tokens=1):\n    with tg.span('x'): pass\n"
        "tg.log(loss=1.0); tg.close();"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', 'prometheus'))))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
        env=base_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    recs = [json.loads(x) for x in (tmp_path / "metrics" / "rank_0.jsonl").open()]
    assert [r["kind"] for r in recs] == ["span", "step", "span", "log"]


def test_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []
    path.write_text('{"a": 1}\n{"b"')
    assert tail.read() == [{"a": 1}]
    with path.open("a") as f:
        f.write(': 2}\nnot json\n{"c": 3}\n')
    assert tail.read() == [{"b": 2}, {"c": 3}]
    assert tail.read() == []


class _Boom(SpanExporter):
    def export(self, spans):  # noqa: ANN001, ANN201
        raise ConnectionError("receiver down")

    def shutdown(self) -> None:
        raise RuntimeError("also broken")


def test_counting_exporters_count_and_never_raise(tmp_path: Path) -> None:
    seen: list[str] = []
    span_exp = CountingSpanExporter(_Boom(), "otlp_traces", seen.append)
    assert span_exp.export([]) == SpanExportResult.FAILURE
    assert span_exp.export([]) == SpanExportResult.FAILURE
    span_exp.shutdown()
    assert span_exp.num_failures == 2 and seen == ["otlp_traces", "otlp_traces"]

    class BadMetric(JsonlMetricExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kw):  # noqa: ANN001, ANN003, ANN201
            raise OSError("disk full")

    m = CountingMetricExporter(BadMetric(tmp_path / "m.jsonl"), "jsonl", seen.append)
    assert m.export(None) == MetricExportResult.FAILURE  # type: ignore[arg-type]
    assert seen[-1] == "jsonl"


def test_otlp_resolution_precedence() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    assert resolve_otlp(None, None, {}) is None
    assert resolve_otlp(None, None, env) == ("http://env:4317", "http/protobuf")
    assert resolve_otlp("http://cfg:4317", "grpc", env) == ("http://cfg:4317", "grpc")
    assert resolve_otlp(None, None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}) == (
        "http://x",
        "grpc",
    )


def test_endpoint_falls_back_when_port_taken(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        ep = PrometheusEndpoint(PrometheusBridge(), port=taken)
        try:
            assert ep.port != taken
            ep.write(tmp_path / "prometheus_n.json")
            info = json.loads((tmp_path / "prometheus_n.json").read_text())
            assert info["port"] == ep.port and info["url"].endswith("/metrics")
            with urllib.request.urlopen(ep.url, timeout=5) as r:
                assert r.status == 200
        finally:
            ep.close()


def test_bridge_serves_scrapes_and_lets_the_provider_force_flush() -> None:
    """The bridge keeps the SDK's MetricReader.collect (force_flush calls it with
    timeout_millis) and serves a real scrape of a counter through the endpoint."""
    from opentelemetry.sdk.metrics import MeterProvider

    bridge = PrometheusBridge()
    provider = MeterProvider(metric_readers=[bridge])
    ep = PrometheusEndpoint(bridge)
    try:
        provider.get_meter("t").create_counter("bridge_probe").add(3, {"node": "n0"})
        assert provider.force_flush(timeout_millis=5_000) is True
        with urllib.request.urlopen(ep.url, timeout=5) as r:
            body = r.read().decode()
        assert 'bridge_probe_total{node="n0"} 3.0' in body
    finally:
        ep.close()
        provider.shutdown()


def test_config_validation() -> None:
    for kw in ({"prometheus_port": 70000}, {"peak_flops": 0.0}, {"trace_every_n_steps": -1},
               {"poll_interval_s": 0.0}, {"flops_per_step": -1.0}, {"flush_interval_s": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            TelemetryConfig(**kw)


def _fake_group(ranks: list[int]) -> SimpleNamespace:
    workers = [SimpleNamespace(global_rank=r, local_rank=r, world_size=len(ranks)) for r in ranks]
    return SimpleNamespace(workers=workers, group_rank=0)


def test_plugin_end_to_end_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainguard.core.events import EventLog

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    cfg = TelemetryConfig(prometheus_port=0, peak_flops=1e9, export_interval_s=0.2)
    events = EventLog(tmp_path, node="n1")
    ctx = AgentContext(config=TrainGuardConfig(telemetry=cfg), run_dir=tmp_path, events=events)
    plugin = TelemetryPlugin(ctx)
    try:
        group = _fake_group([0, 1])
        events.emit("launch", attempt=0, agent_restarts=0)
        plugin.before_rendezvous(ctx)
        ctx.attempt = 0
        events.emit("rendezvous", attempt=0, duration_s=0.1, agent_restarts=0)
        plugin.after_rendezvous(ctx, group)
        tp = parse_traceparent(plugin.worker_env(ctx)[TRACEPARENT_ENV])  # the workers' context
        assert tp is not None
        metrics = tmp_path / "metrics"
        metrics.mkdir()
        for rank in (0, 1):
            with (metrics / f"rank_{rank}.jsonl").open("w") as f:
                for step in range(3):
                    f.write(json.dumps({"time": 1.0 + step, "kind": "step", "rank": rank,
                                        "attempt": 0, "step": step, "step_time_s": 0.5,
                                        "tokens": 100, "flops": 2e8, "device": "cpu"}) + "\n")  # fmt: skip
                    f.write(json.dumps({"kind": "log", "rank": rank, "step": step, "reward": 0.5,
                                        "kl": 0.1}) + "\n")  # fmt: skip
                f.write(json.dumps({"time": 2.0, "kind": "span", "rank": rank, "attempt": 0,
                                    "name": "rollout", "trace_id": tp[0], "span_id": f"{rank + 1:016x}",
                                    "parent_span_id": tp[1], "start": 1.5, "end": 2.0}) + "\n")  # fmt: skip
        plugin.poll()
        assert plugin.endpoint is not None
        with urllib.request.urlopen(plugin.endpoint.url, timeout=5) as r:
            text = r.read().decode()
        assert 'trainguard_train_mfu_ratio{node="n1",rank="1"} 0.4' in text
        assert 'trainguard_train_throughput_per_second{node="n1",rank="0"} 200.0' in text
        assert 'trainguard_job_throughput_per_second{node="n1"} 400.0' in text
        assert 'trainguard_rl_kl{node="n1",rank="0"} 0.1' in text
        # another plugin's message over the in-process bus (the straggler detector's scores)
        assert "trainguard_health_straggler_score" not in text
        events.publish(MSG_STRAGGLER_SCORES, scores={"0": 0.0, "1": 0.5}, stragglers=[])
        plugin.poll()
        with urllib.request.urlopen(plugin.endpoint.url, timeout=5) as r:
            text = r.read().decode()
        assert 'trainguard_health_straggler_score_ratio{node="n1",rank="1"} 0.5' in text
        assert "straggler_scores" not in (tmp_path / "events.jsonl").read_text()  # not logged
        plugin.on_failure(ctx, [SimpleNamespace(rank=1, kind=SimpleNamespace(value="killed"),
                                                  exitcode=-9, signal="SIGKILL", message="")])  # fmt: skip
        events.emit("worker_failed", attempt=0, rank=1, cause="killed", agent_restarts=0)
        events.emit("restart", attempt=0, reason="failure", agent_restarts=1)
        plugin.before_rendezvous(ctx)
        ctx.attempt = 1
        plugin.after_rendezvous(ctx, group)
        ckpt = events.emit("checkpoint_committed", attempt=1, rank=0, step=5, stall_s=0.1,
                           persist_s=0.2, commit_s=0.05, bytes=100)  # fmt: skip
        plugin.poll()
        with urllib.request.urlopen(plugin.endpoint.url, timeout=5) as r:
            text = r.read().decode()
        assert 'trainguard_job_restarts_total{cause="killed",node="n1"} 1.0' in text
        events.emit("job_finished", attempt=1, state="succeeded", agent_restarts=1)
        plugin.on_finish(ctx, "succeeded")
    finally:
        plugin.close()
    summary = json.loads((tmp_path / "telemetry" / "summary_n1.json").read_text())
    assert summary["state"] == "succeeded" and summary["export_failures"] == {}
    spans = [json.loads(x) for x in (tmp_path / "telemetry" / "traces_n1.jsonl").open()]
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    (job,) = by_name["trainguard.job"]
    assert len(by_name["trainguard.rendezvous_round"]) == 2
    a0, a1 = sorted(by_name["trainguard.attempt"], key=lambda s: s["start"])
    assert a0["status"] == "ERROR" and a0["events"][0]["name"] == "worker_failed"
    assert a0["events"][0]["attributes"]["cause"] == "killed"
    recoveries = [e for r in by_name["trainguard.rendezvous_round"] for e in r["events"]
                  if e["name"] == "restart"]  # fmt: skip
    assert recoveries and recoveries[0]["attributes"]["reason"] == "failure"
    (stage,) = by_name["checkpoint.stage"]
    (persist,) = by_name["checkpoint.persist"]
    assert stage["parent_span_id"] == persist["parent_span_id"] == a1["span_id"]
    assert persist["end"] == pytest.approx(ckpt["time"], abs=1e-6)
    assert persist["end"] - persist["start"] == pytest.approx(0.25, abs=1e-6)
    assert stage["end"] == pytest.approx(persist["start"], abs=1e-6)
    assert stage["end"] - stage["start"] == pytest.approx(0.1, abs=1e-6)
    assert a1["links"] == [{"trace_id": job["trace_id"], "span_id": a0["span_id"]}]
    assert {s["parent_span_id"] for s in by_name["rollout"]} == {a0["span_id"]}
    assert {s["resource"]["trainguard.rank"] for s in by_name["rollout"]} == {0, 1}
    assert {s["resource"]["trainguard.local_rank"] for s in by_name["rollout"]} == {0, 1}
    for key in ("trainguard.job_id", "trainguard.run_id", "trainguard.node", "service.name"):
        assert key in job["resource"]
    assert len({s["trace_id"] for s in spans}) == 1
    points = [json.loads(x) for x in (tmp_path / "telemetry" / "metrics_n1.jsonl").open()]
    assert any(p["name"] == "trainguard.goodput.ettr" for p in points)


def test_a_step_that_raises_is_recorded_as_failed(tmp_path: Path) -> None:
    code = (
        "import sys, trainguard\ntg = trainguard.init(run_dir=sys.argv[1])\n"
        "with tg.step(tokens=8): pass\n"
        "try:\n    with tg.step(tokens=8):\n        raise RuntimeError('peer died')\n"
        "except RuntimeError: pass\ntg.close()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
        env=base_env(), cwd=REPO, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in (tmp_path / "metrics" / "rank_0.jsonl").open()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [s.get("failed", False) for s in steps] == [False, True]
    assert (
        next(r for r in recs if r["kind"] == "span" and r["attributes"]["step"] == 1)["status"]
        == "error"
    )
    from trainguard.core.goodput import compute_goodput

    g = compute_goodput([], recs)
    assert g.productive_s == pytest.approx(steps[0]["step_time_s"])


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_failed_build_never_leaves_the_metrics_server_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build fails after the /metrics server started: close() still stops it; and an
    endpoint that cannot be announced in the run directory is stopped at once."""
    from trainguard.core.events import EventLog
    from trainguard.telemetry import prometheus as prom

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    cfg = TelemetryConfig(prometheus_port=0, export_interval_s=0.2)
    ctx = AgentContext(
        config=TrainGuardConfig(telemetry=cfg), run_dir=tmp_path, events=EventLog(tmp_path)
    )
    ports: list[int] = []
    original = TelemetryPlugin._open_endpoint

    def open_then_fail(self: TelemetryPlugin) -> Any:
        endpoint = original(self)
        ports.append(endpoint.port)
        raise RuntimeError("a later build step failed")

    monkeypatch.setattr(TelemetryPlugin, "_open_endpoint", open_then_fail)
    plugin = TelemetryPlugin(ctx, background=True)
    assert plugin._built.wait(30) and plugin._build_error is not None
    assert _listening(ports[0])
    plugin.close()
    assert not _listening(ports[0])
    monkeypatch.setattr(TelemetryPlugin, "_open_endpoint", original)

    started: list[int] = []

    def unannounced(self: prom.PrometheusEndpoint, path: Path) -> None:
        started.append(self.port)
        raise OSError("read-only file system")

    monkeypatch.setattr(prom.PrometheusEndpoint, "write", unannounced)
    plugin = TelemetryPlugin(ctx, background=False)
    try:
        assert plugin.endpoint is None and started and not _listening(started[0])
    finally:
        plugin.close()
