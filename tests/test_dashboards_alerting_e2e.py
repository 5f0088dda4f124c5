"""End to end: a rank of a real 2-process run is SIGSTOPped; the generated rules in a real
Prometheus fire TrainGuardJobHung, a real Alertmanager routed by the generated template pages a
local PagerDuty-style receiver within hang detection + 10 s, and the resolve follows once the
job recovers. The agent's direct pager (no Prometheus) pages the same receiver too."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.health_fixtures.jobs import WORKER, events, job_env
from tests.services.alerting_services import Alertmanager, PrometheusRules, WebhookReceiver
from tests.services.telemetry_services import free_port
from trainguard.dashboards import export
from trainguard.dashboards.alertmanager import AlertmanagerParams, alertmanager_document
from trainguard.dashboards.yamlgen import dump

pytestmark = pytest.mark.prometheus

HANG_TIMEOUT_S = 5
logger = logging.getLogger(__name__)


@pytest.mark.slow
def test_sigstopped_rank_pages_through_prometheus_and_alertmanager_then_resolves(
    tmp_path: Path,
) -> None:
    from tests.launch_utils import REPO

    rx = WebhookReceiver()
    am = prom = proc = None
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
        port = free_port()
        prom = PrometheusRules(
            tmp_path / "prom", {"trainguard": [f"127.0.0.1:{port}"]},
            rule_files=[REPO / "dashboards" / export.RULES_FILE], alertmanager_url=am.url,
        )  # fmt: skip
        run_dir = tmp_path / "run"
        env = job_env(hang_timeout_s=HANG_TIMEOUT_S)
        env.update(
            TRAINGUARD_TELEMETRY_ENABLED="true",
            TRAINGUARD_TELEMETRY_PROMETHEUS_PORT=str(port),
            TRAINGUARD_TELEMETRY_POLL_INTERVAL_S="0.2",
            TRAINGUARD_ALERTS_WEBHOOK_URL=rx.base + "/direct",
        )
        cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir),
               str(WORKER), "--steps", "60", "--compute-s", "0.15", "--sleep",
               "--stop-rank", "1", "--stop-at-step", "15"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip

        def is_page(item: tuple) -> bool:
            _, path, b = item
            return (path == "/pd" and b.get("event_action") == "trigger"
                    and "hung" in b["payload"]["summary"])  # fmt: skip

        t_page, _, page = rx.wait_for(is_page, 120, "the PagerDuty trigger for the hang")
        stopped_at = float((run_dir / "stopped_at").read_text())
        logger.info("page %.2f s after the SIGSTOP (hang timeout %d s)", t_page - stopped_at,
                    HANG_TIMEOUT_S)  # fmt: skip
        assert t_page - stopped_at <= HANG_TIMEOUT_S + 10, t_page - stopped_at
        assert page["routing_key"] == "PDKEY" and page["payload"]["severity"] == "critical"
        details = page["payload"]["custom_details"]
        assert details["node"] and "hang_stacks" in details["runbook"]
        [hang] = events(run_dir, "hang_detected")
        assert hang["ranks"] == [1]

        def is_resolve(item: tuple) -> bool:
            _, path, b = item
            return (path == "/pd" and b.get("event_action") == "resolve"
                    and b["dedup_key"] == page["dedup_key"])  # fmt: skip

        t_resolve, _, _ = rx.wait_for(is_resolve, 120, "the PagerDuty resolve after recovery")
        steps_after = [e for e in events(run_dir, "workers_started") if e["time"] > hang["time"]]
        assert steps_after, "the workers were restarted before the resolve"
        assert t_resolve > steps_after[0]["time"]
        logger.info(
            "resolve %.2f s after the workers restarted", t_resolve - steps_after[0]["time"]
        )
        # the generic webhook gets both too, in Alertmanager's format
        for status in ("firing", "resolved"):
            rx.wait_for(
                lambda x, st=status: x[1] == "/generic" and x[2]["status"] == st
                and x[2]["commonLabels"].get("alertname") == "TrainGuardJobHung",
                30, f"the generic webhook's {status} notice",
            )  # fmt: skip
        # the agent's direct pager (embedded default) paged and resolved the same hang
        direct = [b for _, path, b in rx.got if path == "/direct"]
        assert [b["status"] for b in direct][:2] == ["firing", "resolved"], direct
        assert direct[0]["alerts"][0]["labels"]["alertname"] == "TrainGuardJobHung"
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert (run_dir / "done").read_text() == "1"
    finally:
        if proc is not None and proc.poll() is None:
            # the job is still running (a failed assertion): its workers first, then the agent
            for ev in events(tmp_path / "run", "workers_started"):
                for w in ev.get("workers", []):
                    try:
                        os.kill(int(w["pid"]), signal.SIGKILL)  # stopped ones too: no CONT needed
                    except (OSError, TypeError, ValueError):
                        pass  # already gone
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        for svc in (prom, am):
            if svc is not None:
                svc.stop()
        rx.close()
