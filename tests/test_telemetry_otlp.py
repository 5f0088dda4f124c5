"""OTLP export from the node agent to a real receiver (rotel): span tree, metrics, and a
receiver that dies mid-run (training unaffected, failures counted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.launch_utils import REPO, base_env, launch, popen
from tests.services.telemetry_services import Rotel, wait_until

pytestmark = pytest.mark.prometheus

GRPO = str(REPO / "examples" / "grpo_toy.py")
SPAN_RE = re.compile(
    r"Span #\d+\n\s+Trace ID\s+: (\w+)\n\s+Parent ID\s+: (\w*)\n\s+ID\s+: (\w+)\n\s+Name\s+: (\S+)"
)


def received_spans(text: str) -> list[dict[str, str]]:
    return [{"trace": t, "parent": p, "id": i, "name": n} for t, p, i, n in SPAN_RE.findall(text)]


def received_metrics(text: str) -> set[str]:
    return set(re.findall(r"-> Name: (trainguard\.[\w.]+)", text))


def step_logs(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "metrics" / f"rank_{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "log" and "reward" in r]


@pytest.mark.slow
def test_otlp_grpc_span_tree_and_metrics_reach_rotel(tmp_path: Path) -> None:
    rotel = Rotel(tmp_path / "rotel")
    run_dir = tmp_path / "run"
    try:
        env = base_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=rotel.grpc_endpoint,
            TRAINGUARD_TELEMETRY_EXPORT_INTERVAL_S="0.5",
            TRAINGUARD_TELEMETRY_TRACE_EVERY_N_STEPS="10",
        )
        res = launch(
            "trainguard",
            ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", str(run_dir), GRPO,
             "--steps", "30"],
            cwd=tmp_path, env=env, timeout=240,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        spans = wait_until(
            lambda: (s := received_spans(rotel.text())) and any(
                x["name"] == "trainguard.job" for x in s
            ) and s,
            30, "the job span at the receiver",
        )  # fmt: skip
    finally:
        rotel.stop()
    by_id = {s["id"]: s for s in spans}
    assert len({s["trace"] for s in spans}) == 1, "one trace per job"
    (job,) = [s for s in spans if s["name"] == "trainguard.job"]
    assert job["parent"] == ""

    def chain(span: dict[str, str]) -> list[str]:
        names = [span["name"]]
        while span["parent"]:
            span = by_id[span["parent"]]
            names.append(span["name"])
        return names

    rollouts = [s for s in spans if s["name"] == "rollout"]
    # steps 0, 1, 2, 10, 20 are sampled, on both ranks
    assert len(rollouts) == 10
    for s in rollouts:
        assert chain(s) == [
            "rollout", "step", "trainguard.attempt", "trainguard.rendezvous_round",
            "trainguard.job",
        ]  # fmt: skip
    metrics = received_metrics(rotel.text())
    for name in ("trainguard.rl.reward.mean", "trainguard.rl.kl", "trainguard.train.throughput",
                 "trainguard.train.step.duration", "trainguard.goodput.ettr"):  # fmt: skip
        assert name in metrics
    summary = json.loads(next((run_dir / "telemetry").glob("summary_*.json")).read_text())
    assert summary["export_failures"] == {}


@pytest.mark.slow
def test_receiver_stopped_mid_run_leaves_training_unaffected(tmp_path: Path) -> None:
    rotel = Rotel(tmp_path / "rotel")
    run_dir = tmp_path / "run"
    steps = 120
    env = base_env(
        TRAINGUARD_TELEMETRY_OTLP_ENDPOINT=f"http://127.0.0.1:{rotel.http_port}",
        TRAINGUARD_TELEMETRY_OTLP_PROTOCOL="http/protobuf",
        TRAINGUARD_TELEMETRY_EXPORT_INTERVAL_S="0.5",
        TRAINGUARD_TELEMETRY_OTLP_TIMEOUT_S="1",
    )
    proc = popen(
        "trainguard",
        ["--standalone", "--nproc-per-node", "2", "--tg-run-dir", str(run_dir), GRPO,
         "--steps", str(steps), "--step-sleep", "0.05"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        wait_until(
            lambda: "trainguard.rl.reward.mean" in received_metrics(rotel.text())
            and any(s["name"] == "rollout" for s in received_spans(rotel.text())),
            90, "metrics and spans at the receiver",
        )  # fmt: skip
        assert proc.poll() is None, "the run ended before the receiver was stopped"
        rotel.stop()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
        rotel.stop()
    assert proc.returncode == 0, err[-3000:]
    for rank in (0, 1):
        assert [r["step"] for r in step_logs(run_dir, rank)] == list(range(steps))
    summary = json.loads(next((run_dir / "telemetry").glob("summary_*.json")).read_text())
    failures = summary["export_failures"]
    assert failures.get("otlp_metrics", 0) + failures.get("otlp_traces", 0) > 0, failures
    assert "jsonl" not in failures
    assert summary["state"] == "succeeded"
