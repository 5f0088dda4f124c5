"""Configuration of direct paging (section [alerts] of trainguard.toml, env TRAINGUARD_ALERTS_*).

With no Prometheus/Alertmanager (the embedded default), the node agent itself sends critical
events (job stopped, node evicted, hang) to a webhook. Secrets (the PagerDuty routing key, a
bearer token) come from an environment variable or a file, never from the config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True, slots=True)
class AlertsConfig:
    webhook_url: str | None = None
    """Where to send pages; unset: no direct paging. E.g. an Alertmanager-webhook receiver or
    ``https://events.pagerduty.com/v2/enqueue``."""
    format: Literal["alertmanager", "pagerduty", "alertmanager_api"] = "alertmanager"
    """Payload format: Alertmanager's webhook JSON (version 4), PagerDuty Events API v2, or
    ``alertmanager_api``: ``webhook_url`` is an Alertmanager (``http://am:9093``) and pages are
    posted to its ``/api/v2/alerts`` as alerts, routed by its own configuration (the generated
    ``alertmanager.yml``)."""
    routing_key_env: str = "TRAINGUARD_PAGER_ROUTING_KEY"
    """Environment variable holding the PagerDuty routing key (or the webhook bearer token);
    not TRAINGUARD_ALERTS_*, which the config loader reads as settings."""
    routing_key_file: str | None = None
    """File holding the routing key / token (read when the env variable is unset)."""
    events: list[str] = field(default_factory=lambda: ["job_stopped", "node_evicted", "hang"])
    """Which critical events page: job_stopped, node_evicted, hang."""
    timeout_s: float = 5.0
    """Timeout of one HTTP request."""
    max_retries: int = 4
    """Retries of a failed send (with exponential backoff from ``retry_backoff_s``, at most
    30 s apart). A redirect is never followed (the token would go with it): it fails the page."""
    retry_backoff_s: float = 0.5
    rate_limit_per_min: int = 10
    """At most this many pages a minute from one agent; the rest are dropped (logged, counted)."""
    dedup_window_s: float = 300.0
    """A page with the same dedup key as one sent within this window is not sent again."""
    heartbeat_s: float = 5.0
    """Every agent writes ``heartbeats/<node>.json`` in the run directory this often, for
    ``trainguard watch`` (a watcher outside the job); 0 turns the heartbeat off."""
    silence_s: float | None = None
    """``trainguard watch`` pages when no agent wrote a heartbeat or an event for this long;
    default: three heartbeats plus 5 s."""

    def __post_init__(self) -> None:
        if self.webhook_url is not None and not self.webhook_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError(f"webhook_url {self.webhook_url!r} must start with http(s)://")
        unknown = set(self.events) - {"job_stopped", "node_evicted", "hang"}
        if unknown:
            raise ValueError(
                f"unknown events {sorted(unknown)}; known: job_stopped, node_evicted, hang"
            )
        if self.timeout_s <= 0 or self.retry_backoff_s < 0 or self.max_retries < 0:
            raise ValueError("timeout_s must be > 0, retry_backoff_s and max_retries >= 0")
        if self.heartbeat_s < 0:
            raise ValueError(f"heartbeat_s {self.heartbeat_s} must be >= 0 (0: no heartbeat)")
        if self.silence_s is not None and self.silence_s <= max(self.heartbeat_s, 0.0):
            raise ValueError(
                f"silence_s {self.silence_s} must be longer than heartbeat_s {self.heartbeat_s}"
                " (the watcher would page between two heartbeats)"
            )
        if self.rate_limit_per_min < 1:
            raise ValueError("rate_limit_per_min must be >= 1")
