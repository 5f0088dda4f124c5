"""PromQL building blocks: every metric name a dashboard or rule uses comes from here.

trainguard metrics are looked up in the metric contract (:mod:`trainguard.core.contracts.metrics`), so a
renamed or removed metric fails generation instead of producing an empty panel; GPU metrics
must be in :data:`DCGM_METRICS` (dcgm-exporter's names, its default-counters.csv).
"""

from __future__ import annotations

import re

from trainguard.core.contracts.metrics import by_name

__all__ = [
    "DCGM_METRICS",
    "OTHER_METRICS",
    "dcgm",
    "job_filter",
    "metric_names",
    "tg",
    "tg_suffix",
]

DCGM_METRICS: frozenset[str] = frozenset(
    {
        # on by default in dcgm-exporter
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "DCGM_FI_DEV_ENC_UTIL",
        "DCGM_FI_DEV_DEC_UTIL",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_RESERVED",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        # off by default: a health field set asks for them
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "DCGM_FI_DEV_RETIRED_SBE",
        "DCGM_FI_DEV_RETIRED_DBE",
        "DCGM_FI_DEV_RETIRED_PENDING",
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "DCGM_FI_DEV_POWER_VIOLATION",
        "DCGM_EXP_XID_ERRORS_COUNT",
        "DCGM_EXP_GPU_HEALTH_STATUS",
    }
)
"""dcgm-exporter metric names the dashboards and rules may use."""

OTHER_METRICS: frozenset[str] = frozenset({"up", "ALERTS"})
"""Prometheus' own series the rules may use."""

_HOST = ("hostname", "Hostname")  # dcgm-exporter's host label, before and after May 2026


def tg(name: str, selector: str = "") -> str:
    """The Prometheus series of contract metric ``name`` (``_bucket``-less), with ``selector``.

    ``tg("trainguard.train.loss", 'node=~"$node"')`` → ``trainguard_train_loss{node=~"$node"}``.
    A name missing from the contract raises ``KeyError``.
    """
    prom = by_name(name).prometheus
    return f"{prom}{{{selector}}}" if selector else prom


def tg_suffix(name: str, suffix: str, selector: str = "") -> str:
    """A histogram's ``_bucket``/``_sum``/``_count`` series (``suffix`` without underscore)."""
    spec = by_name(name)
    if spec.kind != "histogram":
        raise ValueError(f"{name} is a {spec.kind}, not a histogram")
    prom = f"{spec.prometheus}_{suffix}"
    return f"{prom}{{{selector}}}" if selector else prom


def job_filter(expr: str, job_var: str = "$job") -> str:
    """Keep the series of ``expr`` scraped from endpoints of the selected trainguard job(s):
    every series of a node agent's endpoint shares its ``instance`` with ``trainguard_run_info``."""
    info = tg("trainguard.run.info", f'job_id=~"{job_var}"')
    return f"({expr}) and on(instance) {info}"


def dcgm(metric: str, selector: str = "", *, fn: str = "", window: str = "") -> str:
    """A dcgm-exporter series with its host under ``hostname`` whichever label it came with.

    ``selector`` may use ``{host}`` for the host label, e.g. ``'{host}=~"$node"'``; it is
    applied to both spellings and the two are merged with ``or``. ``fn``/``window`` apply a
    range function to the raw selectors first, e.g. ``fn="rate", window="5m"``.
    """
    if metric not in DCGM_METRICS:
        raise KeyError(f"{metric} is not a known dcgm-exporter metric")
    if "{host}" in selector:
        sels = [f"{metric}{{{selector.format(host=h)}}}" for h in _HOST]
    else:
        sels = [f"{metric}{{{selector}}}" if selector else metric]
    if fn:
        sels = [f"{fn}({s}[{window}])" for s in sels]
    return f'label_replace({" or ".join(sels)}, "hostname", "$1", "Hostname", "(.+)")'


_KEYWORDS = frozenset(
    {
        # functions, aggregations, operators and modifiers: never metric names
        "abs", "absent", "absent_over_time", "and", "avg", "avg_over_time", "bool", "by",
        "ceil", "changes", "clamp", "clamp_max", "clamp_min", "count", "count_over_time",
        "delta", "deriv", "floor", "group", "group_left", "group_right", "histogram_quantile",
        "idelta", "ignoring", "increase", "inf", "irate", "label_replace", "last_over_time",
        "max", "max_over_time", "min", "min_over_time", "nan", "offset", "on", "or",
        "quantile", "quantile_over_time", "rate", "resets", "round", "scalar", "sort",
        "sort_desc", "stddev", "stddev_over_time", "sum", "sum_over_time", "time", "timestamp",
        "topk", "unless", "vector", "without",
    }
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """Metric names referenced by a PromQL expression (a lexical scan, for tests and guards):
    identifiers outside strings and label matchers that are not functions or keywords."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr, re.S)
    m = m or re.fullmatch(r"\s*query_result\((.*)\)\s*", expr, re.S)
    if m:  # a Grafana variable query around a PromQL expression
        expr = m.group(1)
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    no_matchers = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_by = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", no_matchers
    )
    no_ranges = re.sub(r"\[[^\]]*\]", "[]", no_by)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", no_ranges):
        word = m.group(0)
        start = m.start()
        if start > 0 and (no_ranges[start - 1].isdigit() or no_ranges[start - 1] in "$."):
            continue  # part of a number (1e6) or a Grafana variable ($__rate_interval)
        if word.lower() in _KEYWORDS or re.fullmatch(r"e\d*", word):
            continue
        names.add(word)
    return names
