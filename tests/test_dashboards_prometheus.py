"""The generated rules, Alertmanager config and dashboards against Debian's real Prometheus 2.42
and Alertmanager 0.25: promtool/amtool checks, every rule's unit tests (and that each case can
fail), routing and inhibition in a running Alertmanager, and every dashboard query run against
a Prometheus that scraped two real trainguard runs and two dcgm-exporter text endpoints."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO, base_env, popen
from tests.procs import alive, descendants, kill_tree
from tests.services.alerting_services import Alertmanager, PrometheusRules, WebhookReceiver
from tests.services.telemetry_services import apt_ensure, free_port, wait_until
from trainguard.dashboards import export, rule_tests
from trainguard.dashboards.alertmanager import AlertmanagerParams, alertmanager_document
from trainguard.dashboards.rules import alert_rules
from trainguard.dashboards.yamlgen import dump
from trainguard.testing.dcgm import ExporterServer, h100_node

pytestmark = pytest.mark.prometheus

DASH = REPO / "dashboards"
RULES = DASH / export.RULES_FILE


def _run(
    cmd: list[str], cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def _packages() -> None:
    apt_ensure("prometheus", "prometheus-alertmanager")


def test_promtool_checks_and_unit_tests_every_rule(tmp_path: Path) -> None:
    p = _run(["promtool", "check", "rules", str(RULES)])
    assert p.returncode == 0 and f"SUCCESS: {len(alert_rules())} rules found" in p.stdout, (
        p.stdout + p.stderr
    )
    # Every rule's unit tests pass and every case can fail, in one promtool run: each test
    # group of the exported file (tests/test_dashboards_units.py keeps it equal to
    # tests_document) gets its case's flipped twin beside it, evaluated on the same series;
    # promtool must report each twin, and only the twins.
    doc = rule_tests.tests_document(str(RULES))
    flipped = [dataclasses.replace(c, fires=not c.fires) for c in rule_tests.CASES]
    saved = rule_tests.CASES[:]
    try:
        rule_tests.CASES[:] = flipped
        twins = rule_tests.tests_document(str(RULES))
    finally:
        rule_tests.CASES[:] = saved
    groups: list[dict[str, Any]] = doc["tests"]  # type: ignore[assignment]
    assert len(groups) == len(twins["tests"]) == len(saved)  # type: ignore[arg-type]
    want: Counter[tuple[str, str]] = Counter()
    for group, twin, case in zip(groups, twins["tests"], saved, strict=True):  # type: ignore[call-overload]
        group["alert_rule_test"] = group["alert_rule_test"] + twin["alert_rule_test"]
        want[group["name"], "silence expected" if case.fires else "nothing fired"] += 1
    (tmp_path / "twins.test.yml").write_text(dump(doc))
    # ~15 CPU-s of rule evaluation (what two runs of 120 s each had before)
    p = _run(["promtool", "test", "rules", "twins.test.yml"], tmp_path, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    got: Counter[tuple[str, str]] = Counter()
    for block in out.split("\n    name: ")[1:]:  # one per failed expectation
        name = block.split(",\n", 1)[0]
        if "exp:[], " in block:
            got[name, "silence expected"] += 1  # a twin of a case that fires
        elif block.rstrip().endswith("got:[]"):
            got[name, "nothing fired"] += 1  # a twin of a case that stays quiet
        else:
            got[name, "other: " + block[:2000]] += 1
    assert got == want, out[-6000:]


def test_amtool_checks_the_alertmanager_template() -> None:
    p = _run(["amtool", "check-config", str(DASH / export.ALERTMANAGER_FILE)])
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr
    assert "3 receivers" in p.stdout and "2 inhibit rules" in p.stdout


def test_alertmanager_routes_by_severity_and_node_down_inhibits_gpu_alerts(tmp_path: Path) -> None:
    rx = WebhookReceiver()
    am = None
    try:
        (tmp_path / "pd_key").write_text("PDKEY\n")
        (tmp_path / "slack_url").write_text(rx.base + "/slack\n")
        params = AlertmanagerParams(
            webhook_url=rx.base + "/generic", pagerduty_url=rx.base + "/pd",
            pagerduty_routing_key_file=str(tmp_path / "pd_key"),
            slack_api_url_file=str(tmp_path / "slack_url"),
            group_wait="0s", group_interval="1s",
        )  # fmt: skip
        am = Alertmanager(tmp_path / "am", dump(alertmanager_document(params)))

        def alert(name: str, severity: str, component: str, node: str, **extra: str) -> dict:
            return {"labels": {"alertname": name, "severity": severity, "component": component,
                               "node": node, **extra},
                    "annotations": {"summary": f"{name} on {node}", "runbook": "do x",
                                    "description": "d"}}  # fmt: skip

        # The node is down before its GPU alerts arrive (as the rules fire them): posted in one
        # batch, Alertmanager may route the GPU alert before the inhibiting one is active.
        am.post_alerts([alert("TrainGuardNodeDown", "critical", "node", "node-1")])
        wait_until(
            lambda: any(
                a["labels"]["alertname"] == "TrainGuardNodeDown"
                for a in am.alerts(inhibited="false", active="true", silenced="false")
            ),
            30,
            "the node-down alert active",
        )
        am.post_alerts([
            alert("TrainGuardEccDbe", "critical", "gpu", "node-1", gpu="3"),
            alert("TrainGuardEccDbe", "critical", "gpu", "node-2", gpu="5"),
            alert("TrainGuardRestartStorm", "warning", "job", "node-3", job_id="j1"),
        ])  # fmt: skip

        def inhibited() -> list[dict]:
            got = am.alerts(inhibited="true", active="false", silenced="false")
            return [a for a in got if a["status"]["inhibitedBy"]]

        [inh] = wait_until(inhibited, 30, "an inhibited alert")
        assert (
            inh["labels"]["node"] == "node-1" and inh["labels"]["alertname"] == "TrainGuardEccDbe"
        )
        pd = rx.wait_for(lambda x: x[1] == "/pd" and "node-2" in json.dumps(x[2]), 30, "page")[2]
        assert pd["routing_key"] == "PDKEY" and pd["event_action"] == "trigger"
        assert pd["payload"]["severity"] == "critical"
        rx.wait_for(lambda x: x[1] == "/slack" and "TrainGuardRestartStorm" in json.dumps(x[2]),
                    30, "slack message")  # fmt: skip
        rx.wait_for(lambda x: x[1] == "/generic" and x[2]["commonLabels"].get("node") == "node-3",
                    30, "generic webhook")  # fmt: skip
        time.sleep(2)  # give Alertmanager the chance to (wrongly) send the inhibited one
        pages = [b["payload"]["summary"] for _, path, b in rx.got if path == "/pd"]
        assert "TrainGuardEccDbe on node-2" in pages and "TrainGuardNodeDown on node-1" in pages
        assert "TrainGuardEccDbe on node-1" not in pages  # inhibited by its node being down
        slack = [json.dumps(b) for _, path, b in rx.got if path == "/slack"]
        assert slack and all("TrainGuardRestartStorm" in m for m in slack)  # warnings only
    finally:
        if am is not None:
            am.stop()
        rx.close()


# -- every dashboard query returns data from real runs and exporters ------------------------------
GPU_ONLY = {"trainguard_gpu_memory_used_bytes", "trainguard_gpu_memory_peak_bytes"}
"""Logged only by CUDA workers: empty on a CPU machine (each has its panel to itself)."""
LEMON_ONLY = {"trainguard_fleet_lemon_refused_time_seconds"}
"""Exported once a lemon node was refused at a job's start (tests/test_fleet.py's lemon job and
the recorder's unit test in tests/test_telemetry_units.py): empty for these two jobs."""
SLURM_ONLY = {"trainguard_slurm_schedule_time_seconds"}
"""Exported by the agents of a trainguard sbatch job (the batch host's agent measures each
allocation; tests/test_telemetry_contract.py maps the event): empty for these two jobs."""
FLEET_TRAINER_ONLY = {
    "trainguard_rl_rollout_retries",
    "trainguard_rl_rollout_latency_p50_seconds",
    "trainguard_rl_rollout_latency_p99_seconds",
    "trainguard_rl_rollout_throughput_per_second",
    "trainguard_rl_rollout_engines_routable",
    "trainguard_rl_rollout_engines_declared",
    "trainguard_rl_weight_sync_duration_seconds",
    "trainguard_rl_weight_sync_timeout_seconds",
    "trainguard_rl_staleness_max",
    "trainguard_rl_staleness_mean",
}
"""Logged only by a trainer that generates through the rollout fleet (trainguard.rl's client,
examples/rl_fleet.py), not by grpo_toy's in-process generation; the fleet's own series (the
role gauges, the failure and timeout counters exported from 0) come from the run below; every
one of these reaches the agent's /metrics in tests/test_rl_fleet_job.py's real fleet job."""


@pytest.fixture
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("panels")
    exp_a = ExporterServer(h100_node(hostname="node-a", host_label="Hostname",
                                     faults={3: {"DCGM_FI_DEV_XID_ERRORS": 79,
                                                 "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2}},
                                     xid_counts={3: {79: 1}}))  # fmt: skip
    exp_b = ExporterServer(h100_node(hostname="node-b", host_label="hostname",
                                     faults={1: {"DCGM_FI_DEV_ROW_REMAP_FAILURE": 1}}))  # fmt: skip
    exp_a.__enter__()
    exp_b.__enter__()
    ports = [free_port(), free_port()]
    dcgm_targets = [e.url.split("/")[2] for e in (exp_a, exp_b)]
    prom = PrometheusRules(tmp / "prom", {"trainguard": [f"127.0.0.1:{p}" for p in ports],
                                          "dcgm": dcgm_targets})  # fmt: skip
    start = time.time()
    runs = []
    jobs = [
        # with a rollout fleet beside it: two real replica processes (the role gauges)
        ["--tg-role", f"rollout=2:{sys.executable} {REPO / 'tests' / 'workers' / 'role_replica.py'}",
         str(REPO / "examples" / "grpo_toy.py"), "--steps", "100000", "--step-sleep", "0.05",
         "--fail-at-step", "100", "--fail-rank", "1"],
        # without the DDP wrapper (its torch._dynamo import: ~2 CPU s a worker); the gradients
        # are still averaged by a collective inside tg.step()
        [str(REPO / "examples" / "train_mlp.py"), "--no-ddp", "--steps", "100000",
         "--step-sleep", "0.05", "--ckpt-every", "5"],
    ]  # fmt: skip
    try:
        for i, (port, job) in enumerate(zip(ports, jobs, strict=True)):
            env = base_env(
                TRAINGUARD_TELEMETRY_PROMETHEUS_PORT=str(port),
                TRAINGUARD_TELEMETRY_PEAK_FLOPS="1e10",
                TRAINGUARD_TELEMETRY_POLL_INTERVAL_S="0.2",
                TRAINGUARD_TELEMETRY_EXPORT_INTERVAL_S="1",
                TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
                TRAINGUARD_CHECKPOINT_AUTO_INTERVAL="true",
                TRAINGUARD_CHECKPOINT_AUTO_MIN_INTERVAL_S="1",
                # sniff tests in the second job (the sniff panels); a collective in tg.step()
                TRAINGUARD_FLEET_SNIFF_INTERVAL_S="1" if i == 1 else "0",
                TRAINGUARD_FLEET_SNIFF_BUDGET="0.05",
            )
            runs.append(popen("trainguard", ["--standalone", "--nproc-per-node", "2",
                                             "--max-restarts", "2", "--tg-run-dir",
                                             str(tmp / f"run{i}"), *job],
                              cwd=tmp, env=env))  # fmt: skip
        yield {"prom": prom, "start": start, "runs": runs, "tmp": tmp}
    finally:
        # the workers are found before the agents are told to stop: an agent that does not stop
        # in time is killed with them, none left training for the rest of the suite
        tree = {pid for p in runs for pid in descendants(p.pid)}
        for p in runs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in runs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(p)
                p.communicate(timeout=30)
        for pid in tree:
            if alive(pid):
                kill_tree(pid)
        prom.stop()
        exp_a.__exit__(None, None, None)
        exp_b.__exit__(None, None, None)


def _substitute(expr: str) -> str:
    for var in ("$job", "$slurm_job", "$node", "$rank", "$gpu"):
        expr = expr.replace(f'"{var}"', '".*"')
    return expr.replace("$__rate_interval", "10s")


def _targets() -> list[tuple[str, str, str]]:
    out = []
    for name in ("trainguard-job", "trainguard-gpu-fleet"):
        board = json.loads(export.render()[f"grafana/{name}.json"])
        for p in board["panels"]:
            for t in p.get("targets", []):
                out.append((f"{name}: {p['title']}", t["refId"], t["expr"]))
    return out


@pytest.mark.slow
def test_every_panel_query_returns_data_from_real_runs_and_dcgm(scraped: dict[str, Any]) -> None:
    prom: PrometheusRules = scraped["prom"]
    targets = _targets()
    from trainguard.dashboards.promql import metric_names

    # a query that returned data over [start, now] returns it over every later range: each
    # poll asks only the queries still without data
    pending = [
        t
        for t in targets
        if not (
            metric_names(t[2]) & (GPU_ONLY | LEMON_ONLY | SLURM_ONLY)
            or metric_names(t[2]) <= FLEET_TRAINER_ONLY | {"trainguard_run_info"}
        )
    ]

    def empty() -> list[str]:
        now = time.time()
        pending[:] = [
            t
            for t in pending
            if not prom.query_range(_substitute(t[2]), scraped["start"], now, 1.0)
        ]
        missing = [f"{panel} [{ref}]" for panel, ref, _ in pending]
        for p in scraped["runs"]:
            assert p.poll() is None, p.communicate()[1][-3000:]
        return missing

    last: list[list[str]] = [[]]

    def all_have_data() -> bool:
        last[0] = empty()
        return not last[0]

    try:
        wait_until(all_have_data, 240, "data for every panel query", interval=3)
    except TimeoutError:
        raise AssertionError(f"panel queries without data: {last[0]}") from None
    # both dcgm-exporter host label spellings end up under hostname
    hosts = {r["metric"]["hostname"] for r in prom.query_range(
        _substitute(targets[[t[0] for t in targets].index("trainguard-gpu-fleet: Temperature")][2]),
        scraped["start"], time.time())}  # fmt: skip
    assert hosts == {"node-a", "node-b"}
    # the GPU-only panels are exactly the two device-memory queries
    gpu_only = [t for t in targets if metric_names(t[2]) & GPU_ONLY]
    assert {t[0] for t in gpu_only} == {"trainguard-job: Device memory"}
    # annotations run too; failures and restarts happened in the GRPO run (at step 100, a few
    # seconds into training: a counter's increase() needs a scrape from before the failure, and
    # the agent's first scrapes can time out while its workers start on a loaded machine)
    job = json.loads(export.render()["grafana/trainguard-job.json"])
    for a in job["annotations"]["list"]:
        prom.query_range(_substitute(a["expr"]), scraped["start"], time.time())  # valid PromQL
        if a["name"] in ("Failures", "Recoveries (restarts)"):
            wait_until(
                lambda a=a: prom.query_range(_substitute(a["expr"]), scraped["start"], time.time()),
                120,
                f"the {a['name']} annotation",
                interval=2,
            )
