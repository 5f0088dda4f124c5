"""Dashboards, rules and pager without Prometheus: generation is deterministic and in sync with
the committed dashboards/, queries name only known metrics, push speaks Grafana's HTTP API to a
real local server, and the pager dedups, retries, rate-limits and reaches a real webhook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import REPO, base_env
from trainguard.core.config.alerts import AlertsConfig
from trainguard.core.contracts.metrics import METRICS
from trainguard.core.events import EventLog
from trainguard.dashboards import export
from trainguard.dashboards.grafana import FLEET_UID, JOB_UID, validate
from trainguard.dashboards.pager import Page, Pager, PagerPlugin
from trainguard.dashboards.promql import DCGM_METRICS, OTHER_METRICS, metric_names
from trainguard.dashboards.rule_tests import CASES
from trainguard.dashboards.rules import alert_rules

ALLOWED = (
    {m.prometheus for m in METRICS}
    | {f"{m.prometheus}_{s}" for m in METRICS if m.kind == "histogram" for s in ("bucket", "sum", "count")}
    | DCGM_METRICS
    | OTHER_METRICS
)  # fmt: skip


def _exprs(panel_or_board: dict[str, Any]) -> list[str]:
    out = []
    for p in panel_or_board.get("panels", []):
        out += [t["expr"] for t in p.get("targets", [])]
    return out


def board(name: str) -> dict[str, Any]:
    return json.loads(export.render()[f"grafana/{name}.json"])


def test_committed_dashboards_dir_equals_fresh_generation() -> None:
    # Deterministic across processes: another interpreter with other hash seeds (set and dict
    # order of str keys) renders byte for byte what this one does.
    here = export.render()
    code = (
        "import json; from trainguard.dashboards import export; print(json.dumps(export.render()))"
    )
    for seed in ("1", "2"):
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={**base_env(), "PYTHONHASHSEED": seed},
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout) == here, f"render() differs under PYTHONHASHSEED={seed}"
    stale = export.diff(REPO / "dashboards")
    assert stale == [], f"run: trainguard dashboards export dashboards ({stale})"


def test_dashboards_validate_against_sdk_types_and_keep_uids() -> None:
    files = export.render()
    assert json.loads(files["grafana/trainguard-job.json"])["uid"] == JOB_UID
    assert json.loads(files["grafana/trainguard-gpu-fleet.json"])["uid"] == FLEET_UID
    for name in ("trainguard-job", "trainguard-gpu-fleet"):
        validate(files[f"grafana/{name}.json"])
    broken = json.loads(files["grafana/trainguard-job.json"])
    broken["panels"][1]["gridPos"] = "left"
    with pytest.raises((ValueError, TypeError, AttributeError)):
        validate(json.dumps(broken))


def test_every_query_names_only_contract_or_dcgm_metrics() -> None:
    for name in ("trainguard-job", "trainguard-gpu-fleet"):
        b = board(name)
        exprs = _exprs(b) + [a["expr"] for a in b["annotations"].get("list", []) if "expr" in a]
        exprs += [v["query"] for v in b["templating"]["list"] if v["type"] == "query"]
        assert len(exprs) > 20
        ids = [p["id"] for p in b["panels"]]
        assert len(set(ids)) == len(ids)
        for e in exprs:
            names = metric_names(e)
            assert names, e
            assert names <= ALLOWED, (names - ALLOWED, e)
    for rule in alert_rules():
        assert metric_names(rule.expr) <= ALLOWED, rule.name
    # the scan does find an unknown name
    assert metric_names('rate(trainguard_nope_total{node="a"}[5m]) > 1e6') == {
        "trainguard_nope_total"
    }


def test_job_dashboard_covers_the_issue_panels() -> None:
    titles = {p["title"] for p in board("trainguard-job")["panels"]}
    for t in ("Loss", "Reward", "KL to reference", "Entropy", "Clip fraction", "Response length",
              "Job throughput", "MFU", "Step time per rank", "Restarts by cause",
              "Goodput (ETTR)", "Badput by cause", "Checkpoint stall (training blocked)",
              "Checkpoint persist (background)",
              # the rollout fleet: engines serving / total, weight sync, staleness, failures
              "Engines serving / total", "Engine states", "Rollout failures by reason",
              "Rollout retries and routable engines", "Rollout latency p50 / p99",
              "Rollout tokens/s", "Weight sync", "Staleness and engine weight versions"):  # fmt: skip
        assert t in titles, t
    heat = [p for p in board("trainguard-job")["panels"] if p["type"] == "heatmap"]
    assert heat and "rank" in heat[0]["targets"][0]["expr"]
    ann = {a["name"] for a in board("trainguard-job")["annotations"]["list"]}
    assert {"Failures", "Recoveries (restarts)", "Hangs"} <= ann
    fleet = board("trainguard-gpu-fleet")
    fleet_text = json.dumps(fleet)
    for m in ("XID_ERRORS", "ECC_DBE", "REMAPPED_ROWS", "NVLINK_CRC", "THERMAL_VIOLATION",
              "PCIE_REPLAY", "Hostname", "hostname"):  # fmt: skip
        assert m in fleet_text, m
    assert {v["name"] for v in fleet["templating"]["list"]} >= {"datasource", "job", "node", "gpu"}


def test_every_alert_has_a_firing_and_a_quiet_unit_test_and_sane_severity() -> None:
    rules = alert_rules()
    assert len(rules) >= 20
    for r in rules:
        kinds = {c.fires for c in CASES if c.alert == r.name}
        assert kinds == {True, False}, r.name
        assert r.severity in ("critical", "warning") and r.summary and r.runbook
        if r.recovered_by_trainguard:
            assert r.severity == "warning", r.name
    by = {r.name: r for r in rules}
    for name in ("TrainGuardJobHung", "TrainGuardCrashLoop", "TrainGuardNodeDrained",
                 "TrainGuardCriticalXid", "TrainGuardEccDbe", "TrainGuardGpuMissing"):  # fmt: skip
        assert by[name].severity == "critical"
    for name in ("TrainGuardRestartStorm", "TrainGuardHangRecovered", "TrainGuardXid"):
        assert by[name].severity == "warning" and by[name].recovered_by_trainguard


# -- push against a real local HTTP server that behaves like Grafana's API ----------------------
class FakeGrafana:
    """A real HTTP server checking the requests Grafana's API expects."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.folders: dict[str, str] = {}
        self.dashboards: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _auth(self) -> bool:
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    self._reply(401, {"message": "Unauthorized"})
                    return False
                return True

            def do_GET(self) -> None:  # noqa: N802
                outer.requests.append(("GET", self.path, None))
                if not self._auth():
                    return
                if self.path.startswith("/api/folders/"):
                    uid = self.path.rsplit("/", 1)[1]
                    if uid in outer.folders:
                        self._reply(200, {"uid": uid, "title": outer.folders[uid]})
                    else:
                        self._reply(404, {"message": "folder not found"})
                    return
                self._reply(404, {"message": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(("POST", self.path, body))
                if not self._auth():
                    return
                if self.path == "/api/folders":
                    if body["uid"] in outer.folders:
                        self._reply(409, {"message": "a folder with that uid exists"})
                        return
                    outer.folders[body["uid"]] = body["title"]
                    self._reply(200, {"uid": body["uid"], "title": body["title"]})
                elif self.path == "/api/dashboards/db":
                    d = body["dashboard"]
                    if body.get("folderUid") not in outer.folders:
                        self._reply(400, {"message": "folder not found"})
                        return
                    if d["uid"] in outer.dashboards and not body.get("overwrite"):
                        self._reply(412, {"message": "version-mismatch"})
                        return
                    outer.dashboards[d["uid"]] = d
                    self._reply(
                        200, {"uid": d["uid"], "url": f"/d/{d['uid']}/x", "status": "success"}
                    )
                else:
                    self._reply(404, {"message": "not found"})

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard", "dashboards", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_push_creates_folder_once_and_updates_by_uid(tmp_path: Path) -> None:
    g = FakeGrafana("s3cret")
    try:
        env = base_env(TRAINGUARD_GRAFANA_TOKEN="s3cret")
        p = _cli(["push", "--url", g.url], env)
        assert p.returncode == 0, p.stderr
        assert g.folders == {"trainguard": "trainguard"}
        assert set(g.dashboards) == {JOB_UID, FLEET_UID}
        posts = [b for m, path, b in g.requests if path == "/api/dashboards/db"]
        assert all(b["overwrite"] is True and b["folderUid"] == "trainguard" for b in posts)
        assert all("id" not in b["dashboard"] for b in posts)
        n_folder_posts = sum(1 for _, path, _ in g.requests if path == "/api/folders")
        # second push, token from a file: folder found, same uids updated
        tok = tmp_path / "token"
        tok.write_text("s3cret\n")
        p = _cli(["push", "--url", g.url, "--token-file", str(tok)], base_env())
        assert p.returncode == 0, p.stderr
        assert sum(1 for _, path, _ in g.requests if path == "/api/folders") == n_folder_posts
        assert set(g.dashboards) == {JOB_UID, FLEET_UID}
        assert len([1 for _, path, _ in g.requests if path == "/api/dashboards/db"]) == 4
        # a wrong token: one clear line, non-zero exit, no traceback
        p = _cli(["push", "--url", g.url], base_env(TRAINGUARD_GRAFANA_TOKEN="wrong"))
        assert p.returncode == 1 and "check the token" in p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    finally:
        g.close()
    p = _cli(["push", "--url", "grafana:3000"], base_env())
    assert p.returncode == 2 and "must start with http" in p.stderr


def test_export_and_check_cli(tmp_path: Path) -> None:
    out = tmp_path / "dash"
    p = _cli(["export", str(out)], base_env())
    assert p.returncode == 0, p.stderr
    first = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    assert _cli(["check", str(out)], base_env()).returncode == 0
    (out / "prometheus" / "trainguard-alerts.yml").write_text("groups: []\n")
    p = _cli(["check", str(out)], base_env())
    assert p.returncode == 1 and "trainguard-alerts.yml differs" in p.stderr
    assert _cli(["export", str(out)], base_env()).returncode == 0
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == first


# -- pager ----------------------------------------------------------------------------------------
def _page(key: str = "k", status: str = "firing") -> Page:
    return Page(key, "TrainGuardJobHung", status, "hung", {"node": "n1", "severity": "critical"})


def test_pager_dedups_retries_with_backoff_and_rate_limits() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    statuses = iter([503, 503, 200] + [200] * 50)
    sleeps: list[float] = []

    def send(url: str, body: bytes, headers: dict[str, str], timeout: float) -> int:
        calls.append((url, json.loads(body)))
        return next(statuses)

    cfg = AlertsConfig(webhook_url="http://x/hook", retry_backoff_s=0.5, rate_limit_per_min=3,
                       max_retries=4)  # fmt: skip
    now = [1000.0]
    pager = Pager(cfg, send=send, clock=lambda: now[0], sleep=sleeps.append)
    assert pager.submit(_page("a"))
    assert not pager.submit(_page("a"))  # same incident: deduplicated
    assert not pager.submit(_page("b", "resolved"))  # never fired: nothing to resolve
    assert pager.submit(_page("a", "resolved"))
    assert pager.submit(_page("c"))
    assert not pager.submit(_page("d"))  # 4th page within a minute: rate-limited
    now[0] += 61
    assert pager.submit(_page("d"))
    pager.close(timeout_s=10)
    assert sleeps == [0.5, 1.0]  # two 503s, exponential backoff
    assert [c[1]["status"] for c in calls] == ["firing"] * 3 + ["resolved", "firing", "firing"]
    assert pager.num_sent == 4 and pager.num_deduplicated == 1 and pager.num_rate_limited == 1
    body = calls[0][1]
    assert (
        body["version"] == "4" and body["alerts"][0]["labels"]["alertname"] == "TrainGuardJobHung"
    )


def test_pager_gives_up_on_a_4xx_and_after_max_retries() -> None:
    codes = iter([400, 500, 500, 500])
    sleeps: list[float] = []
    cfg = AlertsConfig(webhook_url="http://x/hook", max_retries=2, retry_backoff_s=0.1)
    pager = Pager(cfg, send=lambda *a: next(codes), sleep=sleeps.append)
    pager.submit(_page("a"))
    pager.submit(_page("b"))
    pager.close(timeout_s=10)
    assert pager.num_failed == 2 and pager.num_sent == 0 and sleeps == [0.1, 0.2]


class Receiver:
    """A real local webhook receiver recording what it gets."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.cond = threading.Condition()
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.cond:
                    outer.got.append((dict(self.headers), body))
                    outer.cond.notify_all()
                self.send_response(202)
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/hook"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.mark.parametrize("fmt", ["alertmanager", "pagerduty"])
def test_pager_plugin_pages_hang_resolve_eviction_and_stop_to_a_real_webhook(
    tmp_path: Path, fmt: str
) -> None:
    rx = Receiver()
    try:
        key_file = tmp_path / "routing_key"
        key_file.write_text("R0UTING\n")
        cfg = AlertsConfig(webhook_url=rx.url, format=fmt, routing_key_file=str(key_file),
                           routing_key_env="TG_TEST_UNSET_KEY")  # fmt: skip
        run_dir = tmp_path / "run"
        events = EventLog(run_dir, node="n1")
        plugin = PagerPlugin(cfg, run_dir, events)
        events.emit("hang_detected", ranks=[1], message="rank(s) 1 frozen on node n1")
        events.emit("hang_detected", ranks=[1], message="again")  # same incident
        events.emit("workers_started", attempt=1)
        events.emit("node_excluded", reasons=["xid 79"])
        events.emit("job_finished", state="failed")
        plugin.close()
        bodies = [b for _, b in rx.got]
        assert len(bodies) == 4, bodies
        if fmt == "pagerduty":
            assert [b["event_action"] for b in bodies] == [
                "trigger",
                "resolve",
                "trigger",
                "trigger",
            ]
            assert all(b["routing_key"] == "R0UTING" for b in bodies)
            assert bodies[0]["dedup_key"] == bodies[1]["dedup_key"]
            assert bodies[0]["payload"]["severity"] == "critical"
            assert "frozen" in bodies[0]["payload"]["summary"]
            assert bodies[3]["payload"]["class"] == "TrainGuardJobStopped"
        else:
            assert [b["status"] for b in bodies] == ["firing", "resolved", "firing", "firing"]
            names = [b["alerts"][0]["labels"]["alertname"] for b in bodies]
            assert names == ["TrainGuardJobHung", "TrainGuardJobHung", "TrainGuardNodeEvicted",
                             "TrainGuardJobStopped"]  # fmt: skip
            assert rx.got[0][0].get("Authorization") == "Bearer R0UTING"
    finally:
        rx.close()


def test_a_job_that_fails_after_its_restarts_pages_the_restart_count(tmp_path: Path) -> None:
    """A real ``trainguard run`` job whose worker fails every attempt (``--max-restarts 2``):
    its ``job_finished`` event carries the restarts and the stop page annotates them."""
    from tests.launch_utils import WORKERS, launch

    rx = Receiver()
    try:
        run_dir = tmp_path / "run"
        env = base_env(
            DUMP_DIR=str(tmp_path / "dump"),
            EXIT_CODE="1",
            TRAINGUARD_ALERTS_WEBHOOK_URL=rx.url,
            TRAINGUARD_HEALTH_ENABLED="false",
            TRAINGUARD_TELEMETRY_ENABLED="false",
        )
        r = launch(
            "trainguard",
            ["--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
             "--tg-run-dir", str(run_dir), str(WORKERS / "dump_env.py")],
            cwd=tmp_path, env=env, timeout=300,
        )  # fmt: skip
        assert r.returncode != 0
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        finished = [e for e in events if e["kind"] == "job_finished"]
        assert [(e["state"], e["restarts"]) for e in finished] == [("failed", 2)]
        stops = [
            b for _, b in rx.got if b["alerts"][0]["labels"]["alertname"] == "TrainGuardJobStopped"
        ]
        assert len(stops) == 1, rx.got
        details = json.loads(stops[0]["alerts"][0]["annotations"]["details"])
        assert details == {"restarts": 2}
        assert "(2 restart(s))" in stops[0]["alerts"][0]["annotations"]["summary"]
    finally:
        rx.close()


def test_pager_is_registered_only_when_configured(tmp_path: Path) -> None:
    from trainguard.core.config import load_config
    from trainguard.core.plugin import AgentContext
    from trainguard.runtime.registry import default_plugins

    def ctx(env: dict[str, str]) -> AgentContext:
        return AgentContext(
            config=load_config(env=env), run_dir=tmp_path, events=EventLog(tmp_path)
        )

    env = {"TRAINGUARD_TELEMETRY_ENABLED": "false", "TRAINGUARD_HEALTH_ENABLED": "false"}
    names = [p.name for p in default_plugins(ctx(env))]
    assert "pager" not in names
    env["TRAINGUARD_ALERTS_WEBHOOK_URL"] = "http://127.0.0.1:9/hook"
    plugins = default_plugins(ctx(env))
    assert [p.name for p in plugins if p.name == "pager"] == ["pager"]
    for p in plugins:
        p.close()
    assert os.environ.get("TRAINGUARD_PAGER_ROUTING_KEY") is None
