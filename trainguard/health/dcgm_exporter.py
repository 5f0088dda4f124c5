"""Source: a dcgm-exporter endpoint (Prometheus exposition text, parsed by prometheus_client)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

from trainguard.core.config.health import HealthConfig
from trainguard.health.gpu_eval import ThermalTracker, evaluate_gpus
from trainguard.health.policy import Policy
from trainguard.health.result import ProbeResult

__all__ = ["DcgmExporterSource", "parse_exposition"]

NAME = "dcgm_exporter"
DEFAULT_URL = "http://127.0.0.1:9400/metrics"

# dcgm-exporter metric → reading key (see trainguard.health.gpu_eval); summed where repeated.
_FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_GPU_TEMP": "temp_c",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe_volatile",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_dbe_aggregate",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe_volatile",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "row_remap_failure",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "row_remap_pending",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "row_remap_uncorrectable",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "row_remap_correctable",
    "DCGM_FI_DEV_RETIRED_PENDING": "retired_pages_pending",
    "DCGM_FI_DEV_RETIRED_DBE": "retired_pages_dbe",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "nvlink_errors",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": "nvlink_errors",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "nvlink_errors",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "nvlink_errors",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay",
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": "pcie_width",
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": "pcie_width_max",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "clocks_event_reasons",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "clocks_event_reasons",
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_FB_USED": "fb_used_mib",
    "DCGM_FI_DEV_FB_FREE": "fb_free_mib",
    "DCGM_FI_DEV_GPU_UTIL": "util_pct",
}
_SUMMED = {"nvlink_errors"}


def parse_exposition(text: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Exposition text → (GPU index → reading, node details). Raises ValueError on bad text."""
    from prometheus_client.parser import text_string_to_metric_families

    gpus: dict[str, dict[str, Any]] = {}
    details: dict[str, Any] = {}
    num_samples = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            num_samples += 1
            # The parser appends "_total" to counter samples (DCGM's names are upper case).
            name = family.name if s.name == family.name + "_total" else s.name
            labels = s.labels
            host = labels.get("hostname") or labels.get("Hostname")
            if host and "hostname" not in details:
                details["hostname"] = host
            if "DCGM_FI_DRIVER_VERSION" in labels:
                details.setdefault("driver_version", labels["DCGM_FI_DRIVER_VERSION"])
            gpu = labels.get("gpu")
            if gpu is None:
                continue
            r = gpus.setdefault(gpu, {})
            for key, label in (
                ("uuid", "UUID"),
                ("model", "modelName"),
                ("pci_bus_id", "pci_bus_id"),
            ):
                if label in labels:
                    r.setdefault(key, labels[label])
            value = float(s.value)
            if name == "DCGM_FI_DEV_XID_ERRORS":
                r["xid"] = int(value)
                code = labels.get("err_code")
                if code and code.isdigit() and int(code) and not int(value):
                    r["xid"] = int(code)
                if labels.get("err_msg"):
                    r["xid_msg"] = labels["err_msg"]
            elif name == "DCGM_EXP_XID_ERRORS_COUNT":
                code = labels.get("xid")
                if code and code.isdigit():
                    r.setdefault("xid_counts", {})[int(code)] = int(value)
            elif name in _FIELDS:
                key = _FIELDS[name]
                if key in _SUMMED:
                    r[key] = r.get(key, 0.0) + value
                else:
                    r[key] = value
    if num_samples == 0:
        raise ValueError("no samples in the exposition text")
    if not gpus:
        raise ValueError(f"{num_samples} samples but none with a gpu label (not dcgm-exporter?)")
    return gpus, details


class DcgmExporterSource:
    """Scrapes ``url`` and judges it. Keeps per-GPU thermal history across probes."""

    name = NAME

    def __init__(
        self,
        cfg: HealthConfig,
        policy: Policy,
        *,
        url: str | None = None,
        explicit: bool | None = None,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self.url = url or cfg.dcgm_url
        self.explicit = explicit if explicit is not None else self.url != DEFAULT_URL
        self.thermal = ThermalTracker()

    def probe(self) -> ProbeResult:
        t0 = time.monotonic()
        result = self._probe()
        result.duration_s = time.monotonic() - t0
        result.details.setdefault("url", self.url)
        return result

    def _probe(self) -> ProbeResult:
        try:
            with urllib.request.urlopen(self.url, timeout=self.cfg.dcgm_timeout_s) as resp:
                text = resp.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            refused = isinstance(reason, ConnectionRefusedError)
            if refused and not self.explicit:
                return ProbeResult.unknown(
                    NAME, f"no dcgm-exporter at {self.url} (connection refused)", present=False
                )
            return ProbeResult.unknown(NAME, f"cannot scrape {self.url}: {reason}")
        try:
            gpus, details = parse_exposition(text)
        except Exception as e:  # the parser raises ValueError, but never crash on bad input
            return ProbeResult.unknown(NAME, f"cannot parse the exposition text: {e}")
        result = ProbeResult(source=NAME, details=details)
        evaluate_gpus(result, gpus, policy=self.policy, cfg=self.cfg, thermal=self.thermal)
        return result
