"""The Alertmanager configuration template for trainguard's alert rules.

Routes: every alert goes to a generic webhook; ``critical`` pages through PagerDuty Events v2,
``warning`` goes to a Slack channel. Alerts are grouped by job and node. A node that is down
inhibits its GPU and exporter alerts; a critical alert inhibits the warnings of the same node.
Secrets are read from files (``routing_key_file``, ``api_url_file``), never written in.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AlertmanagerParams", "alertmanager_document"]


@dataclass(frozen=True, slots=True)
class AlertmanagerParams:
    webhook_url: str = "http://127.0.0.1:9095/trainguard/alerts"
    """The generic webhook every alert goes to (Alertmanager webhook format)."""
    pagerduty_url: str = "https://events.pagerduty.com/v2/enqueue"
    pagerduty_routing_key_file: str = "/etc/alertmanager/secrets/pagerduty_routing_key"
    slack_api_url_file: str = "/etc/alertmanager/secrets/slack_webhook_url"
    slack_channel: str = "#training-alerts"
    group_wait: str = "30s"
    group_interval: str = "5m"
    repeat_interval: str = "4h"


def alertmanager_document(params: AlertmanagerParams | None = None) -> dict[str, object]:
    p = params or AlertmanagerParams()
    return {
        "route": {
            "receiver": "trainguard-webhook",
            "group_by": ["alertname", "job_id", "node"],
            "group_wait": p.group_wait,
            "group_interval": p.group_interval,
            "repeat_interval": p.repeat_interval,
            "routes": [
                {
                    "receiver": "trainguard-webhook",
                    "matchers": ['severity=~"critical|warning"'],
                    "continue": True,
                },
                {"receiver": "pagerduty", "matchers": ['severity="critical"']},
                {"receiver": "slack", "matchers": ['severity="warning"']},
            ],
        },
        "inhibit_rules": [
            {
                "source_matchers": ['alertname="TrainGuardNodeDown"'],
                "target_matchers": ['component=~"gpu|telemetry"'],
                "equal": ["node"],
            },
            {
                "source_matchers": ['severity="critical"'],
                "target_matchers": ['severity="warning"'],
                "equal": ["node", "job_id"],
            },
        ],
        "receivers": [
            {
                "name": "trainguard-webhook",
                "webhook_configs": [{"url": p.webhook_url, "send_resolved": True}],
            },
            {
                "name": "pagerduty",
                "pagerduty_configs": [
                    {
                        "url": p.pagerduty_url,
                        "routing_key_file": p.pagerduty_routing_key_file,
                        "send_resolved": True,
                        "severity": "critical",
                        "description": "{{ .CommonAnnotations.summary }}",
                        "details": {
                            "runbook": "{{ .CommonAnnotations.runbook }}",
                            "runbook_url": "{{ .CommonAnnotations.runbook_url }}",
                            "node": "{{ .CommonLabels.node }}",
                            "job_id": "{{ .CommonLabels.job_id }}",
                            "firing": '{{ template "pagerduty.default.instances" .Alerts.Firing }}',
                        },
                    }
                ],
            },
            {
                "name": "slack",
                "slack_configs": [
                    {
                        "api_url_file": p.slack_api_url_file,
                        "channel": p.slack_channel,
                        "send_resolved": True,
                        "title": "[{{ .Status | toUpper }}] {{ .CommonAnnotations.summary }}",
                        "text": "{{ range .Alerts }}{{ .Annotations.description }}\n"
                        "Runbook: {{ .Annotations.runbook }}\n{{ end }}",
                    }
                ],
            },
        ],
    }
