"""The planner's answer for one job: recommendation, badput, sensitivity, curves, reference
scenarios; as a dict (``--json``), a text summary, or one self-contained HTML page."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from html import escape
from typing import Any

import numpy as np

from trainguard.core.svg import bar_breakdown, line_chart
from trainguard.plan.defaults import DEFAULTS, reference_scenarios, torchrun_like
from trainguard.plan.formulas import availability_interval, daly_interval, young_interval
from trainguard.plan.model import (
    CAUSES,
    JobSpec,
    evaluate,
    optimize,
    recommend_spares,
    sensitivity,
)

__all__ = ["build_plan", "render_html", "render_text"]

COLORS = {
    "productive": "#2ca02c",
    "checkpoint_stall": "#1f77b4",
    "lost_work": "#ff7f0e",
    "restart": "#d62728",
    "detection": "#9467bd",
    "requeue": "#8c564b",
    "startup": "#7f7f7f",
    "other": "#bcbd22",
}


def _curves(spec: JobSpec) -> dict[str, Any]:
    d0 = spec.disk.interval_s
    lo = max(
        spec.disk.stall_s, spec.disk.commit_s, 1e-3, (spec.memory.interval_s if spec.memory else 0)
    )
    xs = np.geomspace(lo, max(d0 * 20, lo * 2), 60)
    if spec.memory is not None:
        xs = np.maximum(1, np.round(xs / spec.memory.interval_s)) * spec.memory.interval_s
    curves: dict[str, Any] = {
        "ettr_vs_disk_interval": [
            [float(x), float(y)] for x, y in zip(xs, evaluate(spec, disk_s=xs), strict=True)
        ]
    }
    if spec.memory is not None:
        m0 = spec.memory.interval_s
        ms = np.geomspace(max(spec.memory.stall_s, 1e-3), max(m0 * 30, spec.memory.stall_s * 2), 60)
        if spec.step_s:
            ms = np.unique(np.maximum(1, np.round(ms / spec.step_s)) * spec.step_s)
        ys = evaluate(
            spec, memory_s=ms, disk_s=np.maximum(1, np.round(spec.disk.interval_s / ms)) * ms
        )
        curves["ettr_vs_memory_interval"] = [
            [float(x), float(y)] for x, y in zip(ms, ys, strict=True)
        ]
    per_node = spec.mtti * spec.nodes  # hold the node MTBF, grow the job
    sizes = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
    by_size: dict[str, list[list[float]]] = {"this job": [], "torchrun-like": []}
    for g in sizes:
        base = replace(spec, gpus=g, mtti_s=None, node_mtbf_s=per_node)
        for label, s in (("this job", base), ("torchrun-like", torchrun_like(base))):
            by_size[label].append([float(g), evaluate(optimize(s)).ettr])
    curves["ettr_vs_gpus"] = by_size
    curves["node_mtbf_s"] = per_node
    return curves


def build_plan(
    spec: JobSpec,
    *,
    fixed_intervals: bool = False,
    recommend: bool = True,
    scenarios: bool = True,
    curves: bool = True,
) -> dict[str, Any]:
    """Everything the planner says about ``spec``. Intervals are optimised unless
    ``fixed_intervals``; spares are recommended when ``recommend``."""
    given = evaluate(spec)
    best = spec if fixed_intervals else optimize(spec)
    if evaluate(best).ettr <= 0:
        raise ValueError(
            f"with an interruption every {_dur(spec.mtti)} this job never finishes at "
            f"{'these intervals' if fixed_intervals else 'any interval'}: recoveries and lost "
            "work outpace progress; use fewer GPUs, a longer MTBF or cheaper recovery"
        )
    spares = recommend_spares(best) if recommend else None
    if spares is not None and spares["spares"] != best.spares:
        best = replace(best, spares=spares["spares"])
        if not fixed_intervals:
            best = optimize(best)
    est = evaluate(best)
    delta = spec.disk.stall_s
    mtti = spec.mtti
    out: dict[str, Any] = {
        "inputs": {
            **{k: v for k, v in asdict(spec).items() if k not in ("memory", "disk")},
            "memory": asdict(spec.memory) if spec.memory else None,
            "disk": asdict(spec.disk),
            "nodes": spec.nodes,
            "mtti_s": mtti,
        },
        "defaults": DEFAULTS,
        "given": given.to_dict(),
        "recommendation": {
            "memory_interval_s": est.memory_interval_s,
            "memory_interval_steps": (
                round(est.memory_interval_s / spec.step_s)
                if spec.step_s and est.memory_interval_s
                else None
            ),
            "disk_interval_s": est.disk_interval_s,
            "disk_interval_steps": round(est.disk_interval_s / spec.step_s)
            if spec.step_s
            else None,
            "disk_every_memory_saves": best.disk_every() if best.memory else None,
            "spares": best.spares,
            "ettr": est.ettr,
            "goodput_per_allocated_node": est.ettr * best.nodes / (best.nodes + best.spares),
        },
        "estimate": est.to_dict(),
        "spares": spares,
        "formulas": {
            "disk_stall_s": delta,
            "young_s": young_interval(delta, mtti) if delta > 0 else None,
            "daly_s": daly_interval(delta, mtti) if delta > 0 else None,
            "availability_period_s": (
                availability_interval(delta, mtti, spec.restart_s) if delta > 0 else None
            ),
        },
        "sensitivity": sensitivity(best),
    }
    if curves:
        out["curves"] = _curves(best)
    if scenarios:
        out["scenarios"] = reference_scenarios()
    return out


def _dur(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 86400 * 2:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"


def render_text(plan: dict[str, Any]) -> str:
    rec, est, inp = plan["recommendation"], plan["estimate"], plan["inputs"]
    lines = [
        f"job: {inp['gpus']} GPUs ({inp['nodes']} nodes), MTTI {_dur(inp['mtti_s'])}, "
        f"{_dur(inp['work_s'])} of training",
        f"given intervals: ETTR {100 * plan['given']['ettr']:.2f} %",
        "recommended:",
        f"  memory tier every {_dur(rec['memory_interval_s'])}"
        + (f" ({rec['memory_interval_steps']} steps)" if rec["memory_interval_steps"] else ""),
        f"  disk tier every {_dur(rec['disk_interval_s'])}"
        + (f" ({rec['disk_interval_steps']} steps)" if rec["disk_interval_steps"] else ""),
        f"  spares {rec['spares']}",
        f"  ETTR {100 * rec['ettr']:.2f} %  (per allocated node "
        f"{100 * rec['goodput_per_allocated_node']:.2f} %), {est['expected_failures']:.1f} "
        "interruptions expected",
        "badput by cause (% of wall time):",
    ]
    for c in CAUSES:
        lines.append(f"  {c:<17} {100 * est['badput_fraction'][c]:7.3f} %")
    f = plan["formulas"]
    if f["young_s"]:
        lines.append(
            f"single-tier formulas (disk stall {_dur(f['disk_stall_s'])}): Young "
            f"{_dur(f['young_s'])}, Daly {_dur(f['daly_s'])}, availability period "
            f"{_dur(f['availability_period_s'])}"
        )
    lines.append("sensitivity (ETTR % with the input halved / as is / doubled):")
    for r in plan["sensitivity"]:
        lines.append(
            f"  {r['input']:<16} {100 * r['ettr_half']:7.2f} {100 * r['ettr']:7.2f} "
            f"{100 * r['ettr_double']:7.2f}"
        )
    for sc in plan.get("scenarios", []):
        lines.append(f"{sc['name']}: published {sc['published']}")
        for label, p in sc["profiles"].items():
            lines.append(f"  {label:<14} ETTR {100 * p['ettr']:6.2f} %")
        for a in sc["assumptions"]:
            lines.append(f"    assumes: {a}")
    if "run" in plan:
        r = plan["run"]
        lines.append(
            f"run {r['run_dir']}: measured ETTR {100 * r['measured_ettr']:.2f} %, model "
            f"{100 * r['model_ettr']:.2f} % with its costs and {r['failures']} interruption(s)"
            + (
                f"; {100 * r['model_expected_failures_ettr']:.2f} % at the fitted rate"
                if r.get("model_expected_failures_ettr") is not None
                else ""
            )
        )
    return "\n".join(lines)


CSS = """body{font-family:sans-serif;margin:24px;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;
text-align:right}th{background:#f3f3f3}td.l,th.l{text-align:left}
.tg-title{font-size:13px;font-weight:bold}.tg-xtick,.tg-ytick,.tg-legend,.tg-xlabel,.tg-ylabel
{font-size:10px}.tg-ytick{text-anchor:end}.tg-xtick,.tg-xlabel{text-anchor:middle}
.tg-plot{fill:none;stroke:#999}.tg-grid{stroke:#eee}.tg-seglabel{font-size:10px;fill:#fff}
.note{color:#555;font-size:90%}"""


def _table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f'<th class="{"l" if i == 0 else ""}">{escape(c)}</th>' for i, c in enumerate(head))
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"l" if i == 0 else ""}">{escape(str(c))}</td>' for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{h}</tr>{body}</table>"


def render_html(plan: dict[str, Any]) -> str:
    """One page, inline SVG and CSS, no script, nothing fetched."""
    rec, est, inp = plan["recommendation"], plan["estimate"], plan["inputs"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>trainguard plan</title>",
        f"<style>{CSS}</style></head><body><h1>trainguard plan</h1>",
        f"<p>{inp['gpus']} GPUs ({inp['nodes']} nodes of {inp['gpus_per_node']}), MTTI "
        f"{escape(_dur(inp['mtti_s']))}, {escape(_dur(inp['work_s']))} of training.</p>",
        "<h2>Recommendation</h2>",
        _table(
            ["", "value"],
            [
                ["memory tier interval", _dur(rec["memory_interval_s"])],
                ["disk tier interval", _dur(rec["disk_interval_s"])],
                ["spares", rec["spares"]],
                ["expected ETTR", f"{100 * rec['ettr']:.2f} %"],
                ["ETTR at the given intervals", f"{100 * plan['given']['ettr']:.2f} %"],
                ["expected interruptions", f"{est['expected_failures']:.1f}"],
            ],
        ),
        bar_breakdown(
            {"productive": est["wall_s"] * est["ettr"], **est["badput_s"]},
            title="wall time: productive and badput by cause",
            colors=COLORS,
        ),
        _table(
            ["cause", "% of wall time"],
            [[c, f"{100 * est['badput_fraction'][c]:.3f}"] for c in CAUSES],
        ),
        "<h2>Sensitivity</h2><p class='note'>ETTR with one input halved or doubled, the "
        "recommended intervals held.</p>",
        _table(
            ["input", "× 0.5", "as is", "× 2"],
            [
                [
                    r["input"],
                    f"{100 * r['ettr_half']:.2f} %",
                    f"{100 * r['ettr']:.2f} %",
                    f"{100 * r['ettr_double']:.2f} %",
                ]  # fmt: skip
                for r in plan["sensitivity"]
            ],
        ),
    ]
    cv = plan.get("curves")
    if cv:
        parts.append("<h2>Curves</h2>")
        pts = [(x / 60, 100 * y) for x, y in cv["ettr_vs_disk_interval"]]
        parts.append(
            line_chart(
                {"ETTR": pts},
                title="ETTR vs disk interval",
                xlabel="disk interval (min)",
                ylabel="ETTR %",
            )  # fmt: skip
        )
        if "ettr_vs_memory_interval" in cv:
            pts = [(x, 100 * y) for x, y in cv["ettr_vs_memory_interval"]]
            parts.append(
                line_chart(
                    {"ETTR": pts},
                    title="ETTR vs memory interval",
                    xlabel="memory interval (s)",
                    ylabel="ETTR %",
                )  # fmt: skip
            )
        series = {k: [(math.log2(g), 100 * y) for g, y in v] for k, v in cv["ettr_vs_gpus"].items()}
        parts.append(
            line_chart(
                series,
                title=f"ETTR vs cluster size (node MTBF {_dur(cv['node_mtbf_s'])}, "
                "intervals optimal at each size)",
                xlabel="log2(GPUs)",
                ylabel="ETTR %",
            )  # fmt: skip
        )
    for sc in plan.get("scenarios", []):
        parts.append(f"<h2>{escape(sc['name'])}</h2><p>Published: {escape(sc['published'])}</p>")
        parts.append(
            _table(
                ["recovery", "ETTR", "memory interval", "disk interval", "spares"],
                [
                    [
                        k,
                        f"{100 * p['ettr']:.2f} %",
                        _dur(p["memory_interval_s"]),
                        _dur(p["disk_interval_s"]),
                        p["spares"],
                    ]  # fmt: skip
                    for k, p in sc["profiles"].items()
                ],
            )
        )
        parts.append(
            "<p class='note'>Assumptions:</p><ul class='note'>"
            + "".join(f"<li>{escape(a)}</li>" for a in sc["assumptions"])
            + "</ul>"
        )
    if "run" in plan:
        r = plan["run"]
        parts.append(
            f"<h2>Run {escape(str(r['run_dir']))}</h2><p>measured ETTR "
            f"{100 * r['measured_ettr']:.2f} %, model {100 * r['model_ettr']:.2f} % with the "
            f"run's costs and its {r['failures']} interruption(s).</p>"
        )
        parts.append(_table(["cost", "value"], [[k, v] for k, v in r["costs"].items()]))
    parts.append("<h2>Inputs and defaults</h2>")
    parts.append(
        _table(
            ["default", "value", "source"],
            [[k, v["value"], v["source"]] for k, v in plan["defaults"].items()],
        )  # fmt: skip
    )
    parts.append("</body></html>")
    return "\n".join(parts)
