"""`trainguard watch`: a watcher outside the job pages when every agent dies or freezes.

Real jobs (`trainguard run`, workers that only sleep: the agents are the subject), a real
Alertmanager routed by the generated configuration, a local PagerDuty-style receiver behind
it, and the watcher as its own process. The logic's corners (dedup, resolve, queued) are unit
tests on a run directory written by hand.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import base_env
from tests.procs import descendants, kill_tree
from tests.services.alerting_services import Alertmanager, WebhookReceiver
from trainguard.core.config.alerts import AlertsConfig
from trainguard.core.contracts.rundir import RunDir
from trainguard.dashboards.alertmanager import AlertmanagerParams, alertmanager_document
from trainguard.dashboards.watch import EXIT_LOST, Watcher, silence_for
from trainguard.dashboards.yamlgen import dump

HEARTBEAT_S = 1.0
SILENCE_S = 4.0


# -- the logic, on a run directory written by hand ---------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _write_event(run: RunDir, **ev: Any) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    with run.events.open("a") as f:
        f.write(json.dumps(ev) + "\n")


def _beat(run: RunDir, node: str, t: float, pid: int = 4242) -> None:
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    beat = {"time": t, "node": node, "host": os.uname().nodename, "pid": pid,
            "process_start": 1.0, "attempt": 0, "seq": 1}  # fmt: skip
    run.heartbeat(node).write_text(json.dumps(beat))


def test_silent_pages_once_resolves_when_heard_again_and_a_clean_end_pages_nothing(
    tmp_path: Path,
) -> None:
    run, clock, alive = RunDir(tmp_path / "run"), _Clock(), {4242: True}
    cfg = AlertsConfig(heartbeat_s=HEARTBEAT_S, silence_s=SILENCE_S)
    w = Watcher(run.root, cfg, None, clock=clock, pid_alive=lambda pid, _s: alive.get(pid, False))
    assert w.step().state == "waiting"
    _write_event(run, time=clock.t, kind="launch", node="n0", attempt=-1, pid=4242)
    _beat(run, "n0", clock.t)
    assert w.step().state == "running"
    clock.t += SILENCE_S + 1
    v = w.step()
    assert v.state == "silent" and "frozen" in v.message
    clock.t += 30  # still silent: no second page
    assert w.step().state == "silent"
    assert [(p.alertname, p.status) for p in w.pages] == [("TrainGuardJobSilent", "firing")]
    assert w.pages[0].details["last_event"]["kind"] == "launch"
    assert w.pages[0].details["run_dir"] == str(run.root)
    _beat(run, "n0", clock.t)  # heard again
    assert w.step().state == "running"
    assert [p.status for p in w.pages] == ["firing", "resolved"]
    _write_event(run, time=clock.t, kind="job_finished", node="n0", attempt=0, state="succeeded")
    alive[4242] = False
    assert w.step().state == "finished"
    assert len(w.pages) == 2


def test_lost_only_when_every_agent_here_is_gone_without_a_final_event(tmp_path: Path) -> None:
    run, clock, alive = RunDir(tmp_path / "run"), _Clock(), {1: True, 2: True}
    cfg = AlertsConfig(heartbeat_s=HEARTBEAT_S)
    w = Watcher(run.root, cfg, None, clock=clock, pid_alive=lambda pid, _s: alive.get(pid, False))
    for node, pid in (("n0", 1), ("n1", 2)):
        _write_event(run, time=clock.t, kind="launch", node=node, attempt=-1, pid=pid)
        _beat(run, node, clock.t, pid=pid)
    alive[1] = False
    assert w.step().state == "running"  # n1's agent still lives
    alive[2] = False
    v = w.step()
    assert v.state == "lost" and "n0, n1" in v.message
    assert [p.alertname for p in w.pages] == ["TrainGuardJobLost"]
    assert w.step().state == "lost" and len(w.pages) == 1


def test_queued_past_the_limit_pages_once_then_resolves_at_launch(tmp_path: Path) -> None:
    run, clock = RunDir(tmp_path / "run"), _Clock()
    states = {"7": "PENDING"}
    w = Watcher(run.root, AlertsConfig(), None, clock=clock, queued_limit_s=60,
                slurm_job="7", slurm_state=states.get, pid_alive=lambda _p, _s: True)  # fmt: skip
    clock.t += 30
    assert w.step().state == "waiting" and not w.pages
    clock.t += 40
    assert w.step().state == "queued"
    assert w.step().state == "queued"
    assert [p.alertname for p in w.pages] == ["TrainGuardJobQueued"]
    assert "Slurm job 7 still PENDING" in w.pages[0].summary
    _write_event(run, time=clock.t, kind="launch", node="n0", attempt=-1, pid=os.getpid())
    _beat(run, "n0", clock.t, pid=os.getpid())
    assert w.step().state == "running"
    assert [p.status for p in w.pages] == ["firing", "resolved"]


def test_bad_settings_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="silence_s 1.0 must be longer than heartbeat_s 5.0"):
        AlertsConfig(silence_s=1.0)
    with pytest.raises(ValueError, match="heartbeat_s -1"):
        AlertsConfig(heartbeat_s=-1)
    assert silence_for(AlertsConfig()) == 20.0
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "watch", str(tmp_path)], env=base_env(),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "trainguard watch: error: no pager configured: set [alerts] webhook_url (--config) or "
        "TRAINGUARD_ALERTS_WEBHOOK_URL"
    ]


# -- real jobs, a real Alertmanager -----------------------------------------------------------
@pytest.fixture(scope="module")
def alerting(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("watch-am")
    rx = WebhookReceiver()
    (tmp / "pd_key").write_text("PDKEY\n")
    (tmp / "slack_url").write_text(rx.base + "/slack\n")
    params = AlertmanagerParams(
        webhook_url=rx.base + "/generic", pagerduty_url=rx.base + "/pd",
        pagerduty_routing_key_file=str(tmp / "pd_key"),
        slack_api_url_file=str(tmp / "slack_url"), group_wait="0s", group_interval="1s",
    )  # fmt: skip
    am = Alertmanager(tmp / "am", dump(alertmanager_document(params)))
    try:
        yield am, rx
    finally:
        am.stop()
        rx.close()


def _env(am: Alertmanager) -> dict[str, str]:
    return base_env(
        TRAINGUARD_ALERTS_WEBHOOK_URL=am.url, TRAINGUARD_ALERTS_FORMAT="alertmanager_api",
        TRAINGUARD_ALERTS_HEARTBEAT_S=str(HEARTBEAT_S), TRAINGUARD_ALERTS_SILENCE_S=str(SILENCE_S),
        TRAINGUARD_TELEMETRY_ENABLED="false", TRAINGUARD_HEALTH_ENABLED="false",
    )  # fmt: skip


def _job(run_dir: Path, env: dict[str, str], seconds: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", "--tg-run-dir", str(run_dir), "--no-python",
           "sleep", str(seconds)]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)  # fmt: skip


def _watch(run_dir: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard", "watch", str(run_dir), "--poll", "0.5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _pages(rx: WebhookReceiver, run_dir: Path, action: str = "trigger") -> list[dict[str, Any]]:
    return [b for _, path, b in list(rx.got) if path == "/pd"
            and b.get("event_action") == action and run_dir.name in json.dumps(b)]  # fmt: skip


@pytest.mark.prometheus
def test_every_agent_killed_pages_once_through_alertmanager(alerting: Any, tmp_path: Path) -> None:
    am, rx = alerting
    run_dir, env = tmp_path / f"{tmp_path.name}-lost", _env(am)
    job = _job(run_dir, env, 600)
    watcher = _watch(run_dir, env)
    workers: list[int] = []
    try:
        _until(lambda: any(RunDir(run_dir).heartbeats.glob("*.json")), 60, "a heartbeat")
        _until(lambda: len(descendants(job.pid)) >= 2, 60, "the workers")
        workers = descendants(job.pid)
        time.sleep(2 * HEARTBEAT_S)
        killed_at = time.time()
        os.kill(job.pid, signal.SIGKILL)  # every agent of the job (one node)
        job.wait(timeout=10)
        assert watcher.wait(timeout=SILENCE_S + 30) == EXIT_LOST, watcher.stdout.read()  # type: ignore[union-attr]
        t_page, _, page = rx.wait_for(
            lambda x: x[1] == "/pd" and x[2].get("event_action") == "trigger"
            and "TrainGuardJobLost" in json.dumps(x[2])
            and run_dir.name in json.dumps(x[2]), SILENCE_S + 10, "the page for the lost job",
        )  # fmt: skip
        assert t_page - killed_at <= SILENCE_S + 10
        summary = page["payload"]["summary"]
        assert "gone without a final event" in summary, summary
        time.sleep(3)  # Alertmanager's group_interval: a second notice would come by now
        assert len(_pages(rx, run_dir)) == 1, _pages(rx, run_dir)
        [alert] = [a for a in am.alerts() if a["labels"].get("run_id") == run_dir.name]
        assert alert["labels"]["alertname"] == "TrainGuardJobLost"
        assert json.loads(alert["annotations"]["details"])["run_dir"] == str(run_dir)
        assert json.loads(alert["annotations"]["details"])["last_event"]["kind"]
    finally:
        for p in (job, watcher):
            kill_tree(p.pid)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.prometheus
def test_stopped_job_pages_once_and_a_job_that_ends_normally_pages_nothing(
    alerting: Any, tmp_path: Path
) -> None:
    am, rx = alerting
    run_dir, env = tmp_path / f"{tmp_path.name}-stopped", _env(am)
    clean_dir = tmp_path / f"{tmp_path.name}-clean"
    job = _job(run_dir, env, 40)
    clean = _job(clean_dir, env, 3)
    watcher, clean_watcher = _watch(run_dir, env), _watch(clean_dir, env)
    tree: list[int] = []
    try:
        _until(lambda: len(descendants(job.pid)) >= 2, 60, "the workers")
        time.sleep(2 * HEARTBEAT_S)
        tree = [job.pid, *descendants(job.pid)]
        stopped_at = time.time()
        for pid in tree:  # the whole job: its agent and its workers
            os.kill(pid, signal.SIGSTOP)
        t_page, _, page = rx.wait_for(
            lambda x: x[1] == "/pd" and x[2].get("event_action") == "trigger"
            and run_dir.name in json.dumps(x[2]), SILENCE_S + 10, "the page for the stopped job",
        )  # fmt: skip
        assert t_page - stopped_at <= SILENCE_S + 10
        assert "TrainGuardJobSilent" in json.dumps(page)
        assert "trainguard events" in page["payload"]["custom_details"]["runbook"]
        time.sleep(3)
        assert len(_pages(rx, run_dir)) == 1
        assert watcher.poll() is None  # still watching: a frozen job may come back
        for pid in tree:
            os.kill(pid, signal.SIGCONT)
        rx.wait_for(
            lambda x: x[1] == "/pd" and x[2].get("event_action") == "resolve"
            and x[2]["dedup_key"] == page["dedup_key"], 60, "the resolve once heard again",
        )  # fmt: skip
        # the clean job ended with its final events: its watcher exits 0 and paged nothing
        assert clean.wait(timeout=60) == 0, clean.stderr.read()  # type: ignore[union-attr]
        assert clean_watcher.wait(timeout=30) == 0, clean_watcher.stdout.read()  # type: ignore[union-attr]
        assert not [b for _, _, b in list(rx.got) if clean_dir.name in json.dumps(b)]
        assert not [a for a in am.alerts() if a["labels"].get("run_id") == clean_dir.name]
    finally:
        for pid in tree:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for p in (job, clean, watcher, clean_watcher):
            kill_tree(p.pid)


def test_step_ended_without_final_events_pages_lost_and_with_them_nothing(tmp_path: Path) -> None:
    run, clock = RunDir(tmp_path / "run"), _Clock()
    _write_event(run, time=clock.t, kind="launch", node="n0", attempt=-1, pid=1)
    _write_event(run, time=clock.t, kind="launch", node="n1", attempt=-1, pid=2)
    _write_event(run, time=clock.t, kind="job_finished", node="n0", attempt=0, state="failed")
    w = Watcher(run.root, AlertsConfig(), None, clock=clock)
    v = w.step_ended(137)
    assert v.state == "lost" and "exit 137" in v.message and "node(s) n1" in v.message
    assert [p.alertname for p in w.pages] == ["TrainGuardJobLost"]
    _write_event(run, time=clock.t, kind="job_finished", node="n1", attempt=0, state="failed")
    w2 = Watcher(run.root, AlertsConfig(), None, clock=clock)
    assert w2.step_ended(1).state == "finished" and not w2.pages
