"""``trainguard report RUN_DIR``: one self-contained HTML file describing a run.

Reads ``events.jsonl`` and ``metrics/rank_*.jsonl`` (and nothing from the network); plots are
inline SVG and the page has no script. Sections: summary, loss/reward/KL, throughput and MFU,
goodput breakdown, a timeline of attempts, failures, recoveries, checkpoints and health
incidents, the engine fleet (each role replica's states beside the trainer's attempts, the
rollout client's per-step figures, failed rollout requests by reason), a per-rank step-time
heatmap, failure and incident tables.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from trainguard.core import svg
from trainguard.core.atomicfile import write_atomic
from trainguard.core.contracts.engine import ReplicaStatus
from trainguard.core.contracts.event_kinds import (
    FAILURE_ATTRIBUTED,
    HANG_DIAGNOSIS,
    HEALTH_PROBE,
    JOB_FINISHED,
    LOSS_ROLLBACK,
    PREFLIGHT,
    RENDEZVOUS,
    RESTART,
    ROLE_REPLICA_FAILED,
    ROLE_REPLICA_STATE,
    ROLE_RESTART_BUDGET_EXHAUSTED,
    ROLLBACK_EXHAUSTED,
    ROLLOUT_ENGINE_QUARANTINED,
    ROLLOUT_FAILED,
    ROLLOUT_REFIT_VERIFIED,
    SLURM_SCHEDULE,
    WORKER_FAILED,
    WORKER_GROUP_UNHEALTHY,
    WORKERS_STARTED,
)
from trainguard.core.contracts.metrics import LOSS_CAUSES
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import read_events
from trainguard.core.goodput import Goodput, compute_goodput
from trainguard.telemetry.mfu import peak_flops
from trainguard.telemetry.report_rl import samples_section

__all__ = ["RunData", "load_run", "render_report", "write_report"]

logger = logging.getLogger(__name__)
Progress = Callable[[str], None]

GOODPUT_COLORS = {
    "productive": "#2ca02c",
    "startup": "#9edae5",
    "rendezvous": "#c7c7c7",
    "checkpoint_stall": "#1f77b4",
    "recomputed_steps": "#ff9896",
    "hang": "#9467bd",
    "restart": "#d62728",
    "rollback": "#e377c2",
    "other": "#dbdb8d",
}
HEALTH_WORDS = ("health", "hang", "unhealthy", "straggler", "xid", "node_", "drain", "evict")


def _is_health_incident(e: dict[str, Any]) -> bool:
    kind = str(e.get("kind"))
    if any(w in kind for w in HEALTH_WORDS) or e.get("cause") == "hang":
        return True
    return kind in (PREFLIGHT, HEALTH_PROBE) and e.get("status") not in (None, "ok")


@dataclass
class RunData:
    run_dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def t0(self) -> float:
        times = [float(e["time"]) for e in self.events if "time" in e]
        for recs in self.records.values():
            times += [
                float(r["time"]) - float(r.get("step_time_s", 0.0)) for r in recs[:1] if "time" in r
            ]
        return min(times) if times else 0.0


def load_run(run_dir: str | Path, progress: Progress | None = None) -> RunData:
    """Read a run directory; a torn or malformed line is skipped."""
    run_dir = Path(run_dir)
    say = progress or (lambda s: None)
    data = RunData(run_dir=run_dir)
    data.events = list(read_events(run_dir))
    say(f"read {len(data.events)} events")
    try:
        data.config = json.loads(RunDir(run_dir).config.read_text())
    except (OSError, ValueError):
        data.config = {}
    for path in RunDir(run_dir).metrics_files():
        rank = RunDir.metrics_rank(path)
        if rank is None:
            continue
        recs = []
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    recs.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        data.records[rank] = recs
        say(f"read {len(recs)} records of rank {rank}")
    return data


def _series(recs: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    out = []
    for r in recs:
        v = r.get(key)
        if r.get("kind") == "log" and isinstance(v, int | float) and not isinstance(v, bool):
            out.append((float(r.get("step", 0)), float(v)))
    return out


def _gapped(pts: list[tuple[dict[str, Any], float]], t0: float) -> list[tuple[float, float]]:
    """(time since launch, value) with a NaN gap wherever the attempt changes."""
    out: list[tuple[float, float]] = []
    attempt = None
    for rec, v in pts:
        a = rec.get("attempt", 0)
        if attempt is not None and a != attempt:
            out.append((float("nan"), float("nan")))
        attempt = a
        out.append((float(rec["time"]) - t0, v))
    return out


def _steps(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r for r in recs if r.get("kind") == "step" and "step_time_s" in r and not r.get("failed")
    ]


def _peak(data: RunData, override: float | None) -> float | None:
    if override:
        return override
    tcfg = data.config.get("trainguard", {}).get("telemetry", {})
    if tcfg.get("peak_flops"):
        return float(tcfg["peak_flops"])
    for recs in data.records.values():
        for r in recs:
            if isinstance(r.get("device"), str):
                return peak_flops(tcfg.get("device_name") or r["device"])
    return None


def _restart_markers(data: RunData, t0: float, by: str) -> list[svg.Marker]:
    """Vertical markers where a new attempt starts, on a step axis (by="step") or time axis."""
    out: list[svg.Marker] = []
    ref = min(data.records) if data.records else None
    if ref is None:
        return out
    seen: set[int] = set()
    for r in _steps(data.records[ref]):
        a = int(r.get("attempt", 0))
        if a not in seen:
            seen.add(a)
            if a > 0:
                x = float(r["step"]) if by == "step" else float(r["time"]) - t0
                out.append((x, f"attempt {a} starts", "tg-restart"))
    return out


def _root_causes(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The failures that caused a recovery: per attempt, the ranks flagged as the root cause
    (all of the attempt's failures where none is flagged)."""
    by_attempt: dict[Any, list[dict[str, Any]]] = {}
    for f in failures:
        by_attempt.setdefault(f.get("attempt"), []).append(f)
    out: list[dict[str, Any]] = []
    for group in by_attempt.values():
        roots = [f for f in group if f.get("root_cause")]
        out.extend(roots or group)
    return out


def _failure_rows(data: RunData, t0: float) -> list[dict[str, Any]]:
    return [e for e in data.events if e.get("kind") in (WORKER_FAILED, WORKER_GROUP_UNHEALTHY)]


def _timeline(data: RunData, t0: float, t_end: float) -> str:
    bars = []
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for e in data.events:
        a = int(e.get("attempt", 0))
        t = float(e["time"]) - t0
        if e.get("kind") == WORKERS_STARTED:
            starts.setdefault(a, t)
        if e.get("kind") in (WORKER_FAILED, WORKER_GROUP_UNHEALTHY, JOB_FINISHED):
            ends[a] = min(ends.get(a, t), t)
    for a, s in sorted(starts.items()):
        failed = any(
            e.get("kind") in (WORKER_FAILED, WORKER_GROUP_UNHEALTHY) and e.get("attempt") == a
            for e in data.events
        )
        cls = "tg-attempt tg-attempt-failed" if failed else "tg-attempt"
        bars.append((s, ends.get(a, t_end), f"attempt {a}", cls))
    markers = []
    for e in data.events:
        kind = str(e.get("kind"))
        t = float(e["time"]) - t0
        desc = f"{kind} at {t:.2f} s: " + ", ".join(
            f"{k}={v}" for k, v in e.items() if k not in ("time", "kind", "node") and v is not None
        )
        if kind == WORKER_FAILED:
            markers.append((t, desc, "tg-failure", "✖"))
        elif "hang" in kind:
            markers.append((t, desc, "tg-hang", "⌛"))
        elif kind == RESTART:
            markers.append((t, desc, "tg-restart", "↻"))
        elif kind in (LOSS_ROLLBACK, ROLLBACK_EXHAUSTED):
            markers.append((t, desc, "tg-rollback", "↶"))
        elif kind == RENDEZVOUS:
            markers.append((t, desc, "tg-rendezvous", "◆"))
        elif kind.startswith("checkpoint"):
            cls = "tg-restore" if "restor" in kind else "tg-checkpoint"
            markers.append((t, desc, cls, "▼" if cls == "tg-checkpoint" else "▲"))
        elif _is_health_incident(e):
            markers.append((t, desc, "tg-health", "!"))
    return svg.timeline(
        bars, markers, title="Timeline: attempts, failures, recoveries, checkpoints", t_end=t_end
    )


def _fleet(data: RunData, t0: float, t_end: float) -> str:
    """The engine fleet beside the trainer: one lane for the trainer's attempts, one per role
    replica coloured by its lifecycle state (starting, loading, serving, suspect, dead,
    restarting, failed), from the ``role_replica_state`` events; empty without roles."""
    changes: dict[tuple[str, int], list[tuple[float, str, str]]] = {}
    for e in data.events:
        if e.get("kind") != ROLE_REPLICA_STATE:
            continue
        key = (str(e.get("role")), int(e.get("replica", 0)))
        label = f"{key[0]} {key[1]}: {e.get('state')} at {float(e['time']) - t0:.2f} s"
        extra = {
            k: e.get(k) for k in ("pid", "weight_version", "reason") if e.get(k) not in (None, "")
        }
        if extra:
            label += " (" + ", ".join(f"{k}={v}" for k, v in extra.items()) + ")"
        changes.setdefault(key, []).append((float(e["time"]) - t0, str(e.get("state")), label))
    if not changes:
        return '<p class="tg-empty">No engine fleet (the job declared no roles).</p>'
    trainer: list[tuple[float, float, str, str]] = []
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for e in data.events:
        a, t = int(e.get("attempt", 0)), float(e["time"]) - t0
        if e.get("kind") == WORKERS_STARTED:
            starts.setdefault(a, t)
        if e.get("kind") in (WORKER_FAILED, WORKER_GROUP_UNHEALTHY, JOB_FINISHED):
            ends[a] = min(ends.get(a, t), t)
    for a, s in sorted(starts.items()):
        trainer.append((s, ends.get(a, t_end), "tg-attempt", f"trainer attempt {a}"))
    lanes: list[tuple[str, list[tuple[float, float, str, str]]]] = [("trainer", trainer)]
    for (role, idx), seq in sorted(changes.items()):
        spans = []
        for i, (t, state, label) in enumerate(seq):
            end = seq[i + 1][0] if i + 1 < len(seq) else t_end
            if state != ReplicaStatus.STOPPED:
                spans.append((t, end, f"tg-role-{state}", label))
        lanes.append((f"{role} {idx}", spans))
    return svg.state_lanes(
        lanes, title="Engine fleet: trainer attempts and replica states", t_end=t_end
    )


_ROLLOUT_CHARTS = (
    ("Rollout tokens/s", (("rollout_tokens_per_s", ""),)),
    ("Rollout latency p50 / p99 (s)",
     (("rollout_latency_p50_s", "p50 "), ("rollout_latency_p99_s", "p99 "))),
    ("Engines routable / total", (("engines_serving", "routable "), ("engines_total", "total "))),
    ("Weight sync (s)", (("weight_sync_s", "duration "), ("weight_sync_timeout_s", "timeout "))),
    ("Staleness (versions)", (("staleness_max", "max "), ("staleness_mean", "mean "))),
)  # fmt: skip
"""The rollout client's per-step figures (``RolloutClient.take_metrics`` and the weight sync,
logged with ``tg.log``): title, then (logged key, series prefix) pairs, one series per rank."""


def _rollout_charts(data: RunData) -> list[str]:
    """Per-step charts of the rollout fleet as the trainer saw it, and the failed and retried
    requests by reason (summed over ranks); none for a run whose ranks log no rollout figure."""
    markers = _restart_markers(data, data.t0, "step")
    charts = []
    for title, keys in _ROLLOUT_CHARTS:
        series = {}
        for rank, recs in sorted(data.records.items()):
            for key, prefix in keys:
                pts = _series(recs, key)
                if pts:
                    series[f"{prefix}rank {rank}"] = pts
        if series:
            charts.append(
                svg.line_chart(series, title=title, xlabel="step", markers=markers, width=460)
            )
    by_reason: dict[str, dict[float, float]] = {}
    for recs in data.records.values():
        for r in recs:
            if r.get("kind") != "log":
                continue
            step = float(r.get("step", 0))
            for k, v in r.items():
                if not isinstance(v, int | float) or isinstance(v, bool):
                    continue
                if k == "rollout_retries":
                    name = "retried"
                elif k.startswith("rollout_failed_"):
                    name = "failed: " + k.removeprefix("rollout_failed_")
                else:
                    continue
                per_step = by_reason.setdefault(name, {})
                per_step[step] = per_step.get(step, 0.0) + float(v)
    if any(v for d in by_reason.values() for v in d.values()):
        series = {name: sorted(d.items()) for name, d in sorted(by_reason.items())}
        charts.append(
            svg.line_chart(series, title="Rollout requests failed (by reason) and retried",
                           xlabel="step", markers=markers, width=460)
        )  # fmt: skip
    return charts


def _rollout_failures(data: RunData) -> str:
    """The ``rollout_failed`` events (one per failed request, from every rank's client)
    counted by reason and engine, and how many of them were retried on another engine; empty
    without any."""
    counts: dict[tuple[str, str], list[int]] = {}
    for e in data.events:
        if e.get("kind") == ROLLOUT_FAILED:
            key = (str(e.get("reason") or "?"), str(e.get("engine") or "?"))
            n = counts.setdefault(key, [0, 0])
            n[0] += 1
            n[1] += e.get("retried") is not False
    if not counts:
        return ""
    rows = "".join(
        f"<tr><td>{escape(reason)}</td><td>{escape(engine)}</td><td>{n}</td><td>{r}</td></tr>"
        for (reason, engine), (n, r) in sorted(counts.items())
    )
    return (
        '<table class="tg-rollout-failures"><tr><th>rollout failure reason</th><th>engine</th>'
        f"<th>failed requests</th><th>retried elsewhere</th></tr>{rows}</table>"
    )


def _refit_checks(data: RunData) -> str:
    """Refit checks per engine (``rollout_refit_verified`` / ``rollout_engine_quarantined``
    events of every rank's client) and the last reason an engine was quarantined; empty
    without any."""
    counts: dict[str, list[Any]] = {}
    for e in data.events:
        kind = e.get("kind")
        if kind in (ROLLOUT_REFIT_VERIFIED, ROLLOUT_ENGINE_QUARANTINED):
            n = counts.setdefault(str(e.get("engine") or "?"), [0, 0, ""])
            if kind == ROLLOUT_REFIT_VERIFIED:
                n[0] += 1
            else:
                n[1] += 1
                n[2] = f"version {e.get('version')}: {e.get('reason')}"
    if not counts:
        return ""
    rows = "".join(
        f"<tr><td>{escape(engine)}</td><td>{v}</td><td>{q}</td><td>{escape(why)}</td></tr>"
        for engine, (v, q, why) in sorted(counts.items())
    )
    return (
        '<table class="tg-refit-checks"><tr><th>engine</th><th>refits verified</th>'
        f"<th>quarantined</th><th>last quarantine</th></tr>{rows}</table>"
    )


def _heatmap(data: RunData) -> str:
    rows_raw = {r: {int(s["step"]): float(s["step_time_s"]) for s in _steps(recs)}
                for r, recs in sorted(data.records.items())}  # fmt: skip
    all_steps = [s for d in rows_raw.values() for s in d]
    if not all_steps:
        return svg.heatmap({}, title="Step time per rank", col_label="step")
    lo, hi = min(all_steps), max(all_steps)
    ncols = min(120, hi - lo + 1)
    width = (hi - lo + 1) / ncols
    rows: dict[str, list[float | None]] = {}
    for rank, d in rows_raw.items():
        cells: list[list[float]] = [[] for _ in range(ncols)]
        for s, v in d.items():
            cells[min(ncols - 1, int((s - lo) / width))].append(v)
        rows[f"rank {rank}"] = [sum(c) / len(c) if c else None for c in cells]
    return svg.heatmap(
        rows, title="Step time per rank (mean per step bin)", col_label="step",
        col_start=lo, col_step=width,
    )  # fmt: skip


def _table(rows: list[dict[str, Any]], cols: list[str], t0: float, cls: str) -> str:
    if not rows:
        return '<p class="tg-none">none recorded</p>'
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if c == "time" and isinstance(v, int | float):
                v = f"+{float(v) - t0:.2f} s"
            cells.append(f"<td>{escape('' if v is None else str(v))}</td>")
        body.append(f'<tr class="{cls}">' + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _hangs(data: RunData, t0: float) -> str:
    """Each hang diagnosis: the verdict, the rank groups and the aggregated stacks."""
    diags = [e for e in data.events if e.get("kind") == HANG_DIAGNOSIS]
    if not diags:
        return '<p class="tg-none">none recorded</p>'
    out = []
    for e in diags:
        out.append(
            _table(
                [
                    {
                        **e,
                        "suspects": ", ".join(
                            f"{r}@{h}"
                            for r, h in zip(
                                e.get("suspect_ranks") or [],
                                e.get("suspect_hosts") or [],
                                strict=False,
                            )
                        )
                        or ", ".join(str(r) for r in e.get("suspect_ranks") or []),
                    }
                ],
                ["time", "node", "attempt", "diagnosis", "op", "seq", "suspects", "message"],
                t0,
                "tg-hang-row",
            )  # fmt: skip
        )
        groups = [
            {
                "ranks": _ranks(g.get("ranks")),
                "hosts": ", ".join(g.get("hosts") or []),
                "collective": f"{g.get('op') or '-'} #{g.get('entered')}"
                if g.get("in_flight")
                else "between collectives",
                "last completed": g.get("completed"),
            }
            for g in e.get("groups") or []
        ]
        out.append(
            _table(groups, ["ranks", "hosts", "collective", "last completed"], t0, "tg-hang-group")
        )
        for g in e.get("stack_groups") or []:
            out.append(
                f"<details><summary>stack of ranks {escape(_ranks(g.get('ranks')))}</summary>"
                f"<pre>{escape(str(g.get('stack', '')))}</pre></details>"
            )
    return "".join(out)


def _ranks(ranks: Any) -> str:
    return ",".join(str(r) for r in ranks or [])


def _timeouts(data: RunData) -> str:
    """The effective timeout chain the run was launched with (config.json)."""
    chain = data.config.get("timeouts") or []
    rows = [
        {**c, "value": "automatic" if c.get("value_s") is None else f"{c['value_s']:g} s"}
        for c in chain
        if isinstance(c, dict)
    ]
    return _table(rows, ["name", "setting", "value", "source"], 0.0, "tg-timeout-row")


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1000px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
.tg-grid{stroke:#eee}.tg-plot{fill:#fcfcfc;stroke:#ccc}
.tg-title{font-weight:600;font-size:13px}.tg-ytick{font-size:10px;text-anchor:end}
.tg-xtick{font-size:10px;text-anchor:middle}.tg-xlabel{font-size:11px;text-anchor:middle}
.tg-xlabel-left,.tg-legend,.tg-ylabel{font-size:11px}.tg-ylabel{text-anchor:middle}
.tg-marker{stroke-dasharray:4 3;stroke-width:1.2}.tg-marker.tg-restart{stroke:#d62728}
.tg-attempt{fill:#98df8a}.tg-attempt-failed{fill:#ff9896}
.tg-role-starting{fill:#c7c7c7}.tg-role-loading{fill:#aec7e8}.tg-role-serving{fill:#2ca02c}
.tg-role-suspect{fill:#ffbb78}.tg-role-dead{fill:#d62728}.tg-role-restarting{fill:#ff7f0e}
.tg-role-failed{fill:#7f0000}.tg-role-quarantined{fill:#9467bd}
.tg-glyph{font-size:14px;text-anchor:middle}.tg-failure{fill:#d62728}.tg-hang{fill:#9467bd}
.tg-restart{fill:#ff7f0e}.tg-rendezvous{fill:#7f7f7f}.tg-checkpoint,.tg-restore{fill:#1f77b4}
.tg-health{fill:#9467bd}.tg-rollback{fill:#e377c2}.tg-seglabel{font-size:11px;fill:#fff}.tg-empty{fill:#999}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px}
.kv td:first-child{color:#666}.charts{display:flex;flex-wrap:wrap;gap:8px}
"""


_CURVES = (
    ("Loss", ("loss",)),
    ("Reward", ("reward", "reward_mean")),
    ("KL to reference", ("kl",)),
    ("Entropy", ("entropy",)),
    ("Reward std", ("reward_std",)),
    ("Response length", ("response_length", "response_length_mean")),
)
"""Training curves: title, the metric keys that feed it (the first a rank logs)."""
_ALWAYS_SHOWN = ("Loss", "Reward", "KL to reference")
"""Curves drawn (as "no data") even when no rank logs them."""


def _training_curves(data: RunData, t0: float) -> list[str]:
    step_markers = _restart_markers(data, t0, "step")
    curves = []
    for title, keys in _CURVES:
        series = {}
        for rank, recs in sorted(data.records.items()):
            for k in keys:
                pts = _series(recs, k)
                if pts:
                    series[f"rank {rank}"] = pts
                    break
        if series or title in _ALWAYS_SHOWN:
            curves.append(
                svg.line_chart(series, title=title, xlabel="step", markers=step_markers, width=460)
            )
    return curves


def _speed_charts(data: RunData, t0: float, peak: float | None) -> list[str]:
    """Throughput per device and MFU (with a known peak) over time, per rank."""
    time_markers = _restart_markers(data, t0, "time")
    tput: dict[str, list[tuple[float, float]]] = {}
    mfu: dict[str, list[tuple[float, float]]] = {}
    unit = "tokens/s"
    for rank, recs in sorted(data.records.items()):
        steps = _steps(recs)
        key = "tokens" if any("tokens" in s for s in steps) else "samples"
        unit = f"{key}/s"
        pts = _gapped([(s, float(s[key]) / float(s["step_time_s"]))
                       for s in steps if key in s and s["step_time_s"] > 0], t0)  # fmt: skip
        if pts:
            tput[f"rank {rank}"] = pts
        if peak:
            m = _gapped([(s, 100 * float(s["flops"]) / float(s["step_time_s"]) / peak)
                         for s in steps if s.get("flops") and s["step_time_s"] > 0], t0)  # fmt: skip
            if m:
                mfu[f"rank {rank}"] = m
    return [
        svg.line_chart(tput, title=f"Throughput ({unit} per device)", xlabel="seconds since launch",
                       markers=time_markers, width=460),
        svg.line_chart(mfu, title="MFU (%)" if peak else "MFU (peak FLOP/s unknown: omitted)",
                       xlabel="seconds since launch", markers=time_markers, width=460),
    ]  # fmt: skip


def _goodput_section(g: Goodput, ettr: str) -> str:
    """The wall-time bar (productive and lost by cause) and its table."""
    parts = {"productive": g.productive_s, **{c: g.lost_s.get(c, 0.0) for c in LOSS_CAUSES}}
    rows = "".join(
        f"<tr><td>{escape(k)}</td><td>{v:.2f} s</td><td>{100 * v / g.total_s:.1f} %</td></tr>"
        if g.total_s
        else ""
        for k, v in parts.items()
    )
    bar = svg.bar_breakdown(
        parts, title=f"Wall time {g.total_s:.1f} s, ETTR {ettr}", colors=GOODPUT_COLORS
    )
    return f"{bar}\n<table>{rows}</table>"


def _summary(
    data: RunData,
    *,
    t_end: float,
    failures: list[dict[str, Any]],
    rollbacks: list[dict[str, Any]],
    ettr: str,
    peak: float | None,
) -> dict[str, Any]:
    """The key-value table at the top of the report."""
    t0 = data.t0
    finished = [e for e in data.events if e.get("kind") == JOB_FINISHED]
    attempts = sorted({int(e.get("attempt", 0)) for e in data.events} | {0})
    ref = min(data.records) if data.records else None
    ref_recs = data.records.get(ref, []) if ref is not None else []
    roots = _root_causes(failures)
    return {
        "run": data.run_dir.name,
        "state": finished[-1].get("state", "?") if finished else "running or crashed",
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)) if t0 else "?",
        "wall time": f"{t_end:.1f} s",
        "attempts": len(attempts),
        # a failure is its root cause; the ranks torch's teardown stopped are the recovery
        "worker failures": len(roots),
        "loss rollbacks": len(rollbacks),
        "ranks stopped by the recovery": len(
            [f for f in failures if f.get("kind") == WORKER_FAILED]
        )
        - len([f for f in roots if f.get("kind") == WORKER_FAILED]),
        "ranks": len(data.records),
        "steps (lowest rank)": len(_steps(ref_recs)),
        "ETTR": ettr,
        "peak FLOP/s": f"{peak:.3g}" if peak else "unknown",
    }


def render_report(
    data: RunData, *, peak_override: float | None = None, progress: Progress | None = None
) -> str:
    """The self-contained HTML report of ``data`` (``progress`` hears each stage)."""
    say = progress or (lambda s: None)
    t0 = data.t0
    last_t = max(
        [float(e["time"]) for e in data.events]
        + [float(r["time"]) for recs in data.records.values() for r in recs[-1:] if "time" in r]
        + [t0]
    )
    t_end = last_t - t0
    say("computing goodput")
    all_recs = [r for recs in data.records.values() for r in recs]
    g: Goodput = compute_goodput(data.events, all_recs)
    failures = _failure_rows(data, t0)
    rollbacks = [e for e in data.events if e.get("kind") in (LOSS_ROLLBACK, ROLLBACK_EXHAUSTED)]
    health = [e for e in data.events if _is_health_incident(e)]
    verdicts = [e for e in data.events if e.get("kind") == FAILURE_ATTRIBUTED]
    fleet_failures = [
        e
        for e in data.events
        if e.get("kind") in (ROLE_REPLICA_FAILED, ROLE_RESTART_BUDGET_EXHAUSTED)
    ]
    # the scheduler's share of each allocation (trainguard sbatch), once per allocation
    sched = list({(e.get("job_id"), e.get("restart")): e for e in data.events
                  if e.get("kind") == SLURM_SCHEDULE}.values())  # fmt: skip
    run_id = data.run_dir.name

    say("plotting training curves")
    curves = _training_curves(data, t0)
    say("plotting throughput and MFU")
    peak = _peak(data, peak_override)
    speed = _speed_charts(data, t0, peak)

    say("plotting the rollout fleet's figures")
    rollout = _rollout_charts(data)

    say("building timeline and heatmap")
    ettr = f"{100 * g.ettr:.1f} %" if g.ettr is not None else "n/a"
    summary = _summary(
        data, t_end=t_end, failures=failures, rollbacks=rollbacks, ettr=ettr, peak=peak
    )
    kv = "".join(
        f"<tr><td>{escape(k)}</td><td>{escape(str(v))}</td></tr>" for k, v in summary.items()
    )
    html = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>trainguard report: {escape(run_id)}</title><style>{CSS}</style></head>
<body>
<h1>trainguard run report: {escape(run_id)}</h1>
<table class="kv" id="summary">{kv}</table>
<h2>Training</h2><div class="charts" id="training">{"".join(curves)}</div>
<h2>Throughput and MFU</h2><div class="charts" id="speed">{"".join(speed)}</div>
<h2>Goodput</h2><div id="goodput">
{_goodput_section(g, ettr)}{_table(sched, ["time", "job_id", "restart", "queue_wait_s", "prolog_s", "requeue_gap_s", "source", "warnings"], t0, "tg-schedule-row") if sched else ""}</div>
<h2>Timeline</h2><div id="timeline">{_timeline(data, t0, t_end)}</div>
<h2>Engine fleet</h2><div id="fleet">{_fleet(data, t0, t_end)}
{_table(fleet_failures, ["time", "kind", "role", "replica", "pid", "exitcode", "reason", "message"], t0, "tg-failure-row") if fleet_failures else ""}
<div class="charts" id="rollout">{"".join(rollout)}</div>{_rollout_failures(data)}{_refit_checks(data)}{samples_section(data.events)}</div>
<h2>Step time per rank</h2><div id="heatmap">{_heatmap(data)}</div>
<h2>Failures</h2><div id="failures">{_table(failures, ["time", "kind", "attempt", "rank", "cause", "exitcode", "signal", "place", "message"], t0, "tg-failure-row")}</div>
<h2>Failure verdicts</h2><div id="verdicts">{_table(verdicts, ["time", "node", "failed_attempt", "cause", "verdict", "deterministic", "ranks", "summary"], t0, "tg-verdict-row")}</div>
<h2>Loss rollbacks</h2><div id="rollbacks">{_table(rollbacks, ["time", "kind", "bad_step", "reason", "restored_step", "skip", "rollbacks_here", "duration_s"], t0, "tg-rollback-row")}</div>
<h2>Health incidents</h2><div id="health">{_table(health, ["time", "kind", "node", "rank", "cause", "message"], t0, "tg-health-row")}</div>
<h2>Hangs</h2><div id="hangs">{_hangs(data, t0)}</div>
<h2>Timeouts</h2><div id="timeouts">{_timeouts(data)}</div>
<p class="tg-foot">Generated by trainguard from {escape(str(data.run_dir))}; self-contained, no network.</p>
</body></html>
"""
    return html


def write_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    peak_override: float | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the report (default ``<run_dir>/report.html``) and return its path."""
    data = load_run(run_dir, progress)
    html = render_report(data, peak_override=peak_override, progress=progress)
    path = Path(out) if out else RunDir(run_dir).report
    # the run directory may be another user's: never a fixed temporary name, never a symlink
    return write_atomic(path, html)
