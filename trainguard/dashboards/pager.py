"""Direct paging for the embedded default (no Prometheus or Alertmanager).

The agent plugin listens to its node's lifecycle events (``EventLog.subscribe``) and sends
the critical ones to a webhook: ``hang_detected`` (resolved when the workers are started
again), ``node_excluded`` (node evicted) and ``job_finished`` with state ``failed`` (job
stopped). Payloads are Alertmanager's webhook JSON (version 4) or PagerDuty Events API v2.
Pages are deduplicated by key, retried with exponential backoff, rate-limited, and sent from
a background thread: a slow or dead receiver never blocks the agent, and ``close()`` flushes
what is queued within a bounded time.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainguard.core.config.alerts import AlertsConfig
from trainguard.core.contracts.event_kinds import (
    HANG_DETECTED,
    JOB_FINISHED,
    NODE_EXCLUDED,
    WORKERS_STARTED,
)
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import EventLog
from trainguard.core.plugin import AgentPlugin
from trainguard.core.urls import redact_url

__all__ = ["Page", "Pager", "PagerPlugin", "http_post"]

logger = logging.getLogger(__name__)

Sender = Callable[[str, bytes, dict[str, str], float], int]
"""``send(url, body, headers, timeout_s) -> HTTP status``; raises OSError when unreachable."""


MAX_BACKOFF_S = 30.0
"""The longest wait between two tries of one page."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as it came (a 3xx status), never followed: urllib would carry
    the ``Authorization`` header (the bearer token) to wherever ``Location`` points."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def http_post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        e.close()
        return int(e.code)


@dataclass(frozen=True, slots=True)
class Page:
    key: str
    """Dedup key: one incident, e.g. ``<run>/<node>/hang``."""
    alertname: str
    status: str
    """``firing`` or ``resolved``."""
    summary: str
    labels: dict[str, str] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    starts_at: float = 0.0
    ends_at: float | None = None


def _iso(t: float | None) -> str:
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def alertmanager_payload(page: Page) -> dict[str, Any]:
    labels = {"alertname": page.alertname, **page.labels}
    annotations = {"summary": page.summary}
    if page.details:
        annotations["details"] = json.dumps(page.details, sort_keys=True, default=str)
    alert = {
        "status": page.status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": _iso(page.starts_at),
        "endsAt": _iso(page.ends_at),
        "generatorURL": "",
        "fingerprint": page.key,
    }
    return {
        "version": "4",
        "groupKey": page.key,
        "truncatedAlerts": 0,
        "status": page.status,
        "receiver": "trainguard-pager",
        "groupLabels": {"alertname": page.alertname},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "",
        "alerts": [alert],
    }


def alertmanager_api_payload(page: Page) -> list[dict[str, Any]]:
    """The page as an alert posted to Alertmanager's ``/api/v2/alerts`` (what Prometheus
    sends): Alertmanager groups, routes and repeats it by its own configuration."""
    annotations = {"summary": page.summary}
    if page.details:
        annotations["details"] = json.dumps(page.details, sort_keys=True, default=str)
        if isinstance(page.details.get("runbook"), str):
            annotations["runbook"] = page.details["runbook"]
    alert: dict[str, Any] = {
        "labels": {"alertname": page.alertname, **page.labels},
        "annotations": annotations,
        "startsAt": _iso(page.starts_at),
        "generatorURL": "",
    }
    if page.status == "resolved":
        alert["endsAt"] = _iso(page.ends_at)
    return [alert]


def pagerduty_payload(page: Page, routing_key: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "trigger" if page.status == "firing" else "resolve",
        "dedup_key": page.key,
    }
    if page.status == "firing":
        body["payload"] = {
            "summary": page.summary[:1024],
            "source": page.labels.get("node", "trainguard"),
            "severity": page.labels.get("severity", "critical"),
            "timestamp": _iso(page.starts_at),
            "component": page.labels.get("component", "job"),
            "group": page.labels.get("job_id", ""),
            "class": page.alertname,
            "custom_details": {**page.labels, **page.details},
        }
    return body


class Pager:
    """Queue, deduplicate, rate-limit and send pages (transport injected for tests)."""

    def __init__(
        self,
        cfg: AlertsConfig,
        *,
        secret: str | None = None,
        send: Sender = http_post,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        assert cfg.webhook_url, "a Pager needs alerts.webhook_url"
        self.cfg = cfg
        self.url = cfg.webhook_url
        if cfg.format == "alertmanager_api":
            self.url = cfg.webhook_url.rstrip("/") + "/api/v2/alerts"
        self.shown_url = redact_url(cfg.webhook_url)
        """The URL as logs show it (its path and query may hold the token)."""
        self.secret = secret
        self._send = send
        self._clock = clock
        self._closing = threading.Event()
        self._close_by = float("inf")
        self._sleep = sleep if sleep is not None else self._closing.wait
        self._firing: dict[str, float] = {}  # key → when its trigger was sent
        self._sent_times: deque[float] = deque()
        self._queue: queue.Queue[Page | None] = queue.Queue()
        self._lock = threading.Lock()
        self.num_sent = 0
        self.num_failed = 0
        self.num_deduplicated = 0
        self.num_rate_limited = 0
        self._thread = threading.Thread(target=self._run, name="tg-pager", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------------
    def submit(self, page: Page) -> bool:
        """Queue ``page`` unless deduplicated or rate-limited; True when queued."""
        now = self._clock()
        with self._lock:
            if page.status == "firing":
                sent = self._firing.get(page.key)
                if sent is not None and now - sent < self.cfg.dedup_window_s:
                    self.num_deduplicated += 1
                    return False
            elif page.key not in self._firing:
                return False  # nothing to resolve
            while self._sent_times and now - self._sent_times[0] >= 60.0:
                self._sent_times.popleft()
            if len(self._sent_times) >= self.cfg.rate_limit_per_min:
                self.num_rate_limited += 1
                logger.warning("page %s dropped: over %d pages a minute", page.key,
                               self.cfg.rate_limit_per_min)  # fmt: skip
                return False
            self._sent_times.append(now)
            if page.status == "firing":
                self._firing[page.key] = now
            else:
                self._firing.pop(page.key, None)
        self._queue.put(page)
        return True

    def is_firing(self, key: str) -> bool:
        with self._lock:
            return key in self._firing

    def close(self, timeout_s: float | None = None) -> None:
        """Send what is queued within ``timeout_s`` (default: two requests' timeouts), then
        stop: a page in a retry's backoff is tried again at once, and no retry starts that
        the deadline would not leave time for; what is left is logged, not waited for."""
        if timeout_s is None:
            timeout_s = 2 * self.cfg.timeout_s
        self._close_by = time.monotonic() + timeout_s
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.error("pager closed before every page was sent to %s", self.shown_url)

    # -- sending -------------------------------------------------------------------------------
    def _body(self, page: Page) -> tuple[bytes, dict[str, str]]:
        headers = {"Content-Type": "application/json", "User-Agent": "trainguard-pager"}
        payload: Any
        if self.cfg.format == "pagerduty":
            payload = pagerduty_payload(page, self.secret or "")
        elif self.cfg.format == "alertmanager_api":
            payload = alertmanager_api_payload(page)
            if self.secret:
                headers["Authorization"] = f"Bearer {self.secret}"
        else:
            payload = alertmanager_payload(page)
            if self.secret:
                headers["Authorization"] = f"Bearer {self.secret}"
        return json.dumps(payload, sort_keys=True).encode(), headers

    def _run(self) -> None:
        while True:
            page = self._queue.get()
            if page is None:
                return
            if time.monotonic() >= self._close_by:
                self.num_failed += 1
                logger.error("page %s (%s) not sent: the pager closed", page.key, page.status)
                continue
            self._deliver(page)

    def _deliver(self, page: Page) -> None:
        body, headers = self._body(page)
        delay = self.cfg.retry_backoff_s
        for attempt in range(self.cfg.max_retries + 1):
            try:
                status = self._send(self.url, body, headers, self.cfg.timeout_s)
            except OSError as e:
                status, err = 0, str(e)
            else:
                err = f"HTTP {status}"
            if 200 <= status < 300:
                self.num_sent += 1
                logger.info("paged %s (%s) to %s", page.key, page.status, self.shown_url)
                return
            if 300 <= status < 400:
                err += " (a redirect, not followed: the token would go with it; set webhook_url to the final URL)"
                break
            if 400 <= status < 500 and status != 429:
                break  # the receiver rejects this payload: retrying will not help
            if attempt >= self.cfg.max_retries:
                break
            if self._closing.is_set() and time.monotonic() + delay >= self._close_by:
                err += " (the pager is closing)"
                break
            logger.warning("page %s failed (%s); retrying in %.1f s", page.key, err, delay)
            self._sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
        self.num_failed += 1
        logger.error("page %s (%s) could not be sent to %s: %s", page.key, page.status,
                     self.shown_url, err)  # fmt: skip


def read_secret(cfg: AlertsConfig, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    value = env.get(cfg.routing_key_env)
    if value:
        return value.strip()
    if cfg.routing_key_file:
        try:
            return Path(cfg.routing_key_file).read_text().strip() or None
        except OSError as e:
            logger.error("cannot read alerts.routing_key_file %s: %s", cfg.routing_key_file, e)
    return None


class PagerPlugin(AgentPlugin):
    """Pages the critical events of this node's agent (see the module docstring)."""

    name = "pager"

    def __init__(
        self, cfg: AlertsConfig, run_dir: Path, events: EventLog, *, pager: Pager | None = None
    ) -> None:
        self.cfg = cfg
        self.node = events.node
        self.run_id = run_dir.name
        self.job_id = self._job_id(run_dir)
        self.pager = pager or Pager(cfg, secret=read_secret(cfg))
        self._events = events
        events.subscribe(self.on_event)

    @staticmethod
    def _job_id(run_dir: Path) -> str:
        try:
            cfg = json.loads(RunDir(run_dir).config.read_text())
            return str(cfg.get("torchrun", {}).get("rdzv_id") or run_dir.name)
        except (OSError, ValueError):
            return run_dir.name

    def _labels(self, component: str) -> dict[str, str]:
        return {"severity": "critical", "component": component, "node": self.node,
                "job_id": self.job_id, "run_id": self.run_id}  # fmt: skip

    def _key(self, what: str) -> str:
        return f"trainguard/{self.job_id}/{self.node}/{what}"

    def on_event(self, ev: dict[str, Any]) -> None:
        """EventLog listener: map one event to a page or a resolve (never raises)."""
        kind = ev.get("kind")
        t = float(ev.get("time") or time.time())
        want = set(self.cfg.events)
        if kind == HANG_DETECTED and "hang" in want:
            self.pager.submit(Page(
                self._key("hang"), "TrainGuardJobHung", "firing",
                str(ev.get("message") or f"training hung on node {self.node}"),
                self._labels("job"),
                {"ranks": ev.get("ranks"), "hang_kind": ev.get("hang_kind"),
                 "attempt": ev.get("attempt")},
                starts_at=t,
            ))  # fmt: skip
        elif kind in (WORKERS_STARTED, JOB_FINISHED) and self.pager.is_firing(self._key("hang")):
            self.pager.submit(Page(
                self._key("hang"), "TrainGuardJobHung", "resolved",
                f"training on node {self.node} recovered from the hang "
                f"({'workers restarted' if kind == WORKERS_STARTED else 'job ended'})",
                self._labels("job"), starts_at=t, ends_at=t,
            ))  # fmt: skip
        if kind == NODE_EXCLUDED and "node_evicted" in want:
            reasons = ev.get("reasons") or []
            self.pager.submit(Page(
                self._key("evicted"), "TrainGuardNodeEvicted", "firing",
                f"node {self.node} evicted from job {self.job_id}: " + "; ".join(map(str, reasons)),
                self._labels("node"), {"reasons": reasons, "action": ev.get("action")},
                starts_at=t,
            ))  # fmt: skip
        if kind == JOB_FINISHED and ev.get("state") == JobState.FAILED and "job_stopped" in want:
            restarts = ev.get("restarts")
            self.pager.submit(Page(
                self._key("stopped"), "TrainGuardJobStopped", "firing",
                f"training job {self.job_id} stopped on node {self.node}: it failed with no "
                f"restarts left ({restarts} restart(s))",
                self._labels("job"), {"restarts": restarts}, starts_at=t,
            ))  # fmt: skip

    def close(self) -> None:
        self.pager.close()


def create_pager_plugin(cfg: AlertsConfig, run_dir: Path, events: EventLog) -> PagerPlugin | None:
    """The plugin when ``alerts.webhook_url`` is set; paging never stops a launch."""
    if not cfg.webhook_url:
        return None
    try:
        return PagerPlugin(cfg, run_dir, events)
    except Exception:
        logger.exception("direct paging disabled: the pager failed to start")
        return None
