"""Source: NVML through ``nvidia-ml-py`` (imported lazily; absent → source not present).

XID events are only delivered after registration, so the source keeps one event set across
probes: a one-shot check sees XIDs that happen while it runs, in-job probing sees all of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from trainguard.core.config.health import HealthConfig
from trainguard.health.gpu_eval import ThermalTracker, evaluate_gpus
from trainguard.health.policy import Policy
from trainguard.health.result import ProbeResult

__all__ = ["NvmlSource"]

logger = logging.getLogger(__name__)
NAME = "nvml"
_MAX_NVLINKS = 18


def _import_pynvml() -> Any:
    import pynvml

    return pynvml


class NvmlSource:
    """Reads every visible GPU through NVML. ``nvml`` (a module-like object) is injectable."""

    name = NAME

    def __init__(
        self,
        cfg: HealthConfig,
        policy: Policy,
        *,
        nvml_loader: Callable[[], Any] = _import_pynvml,
    ) -> None:
        self.cfg = cfg
        self.policy = policy
        self._loader = nvml_loader
        self._nvml: Any = None
        self._events: Any = None
        self._xids: dict[str, list[int]] = {}
        self._absent: ProbeResult | None = None
        self.thermal = ThermalTracker()

    def _init(self) -> ProbeResult | None:
        if self._nvml is not None:
            return None
        if self._absent is not None:  # decided once: no driver appears while we run
            return ProbeResult.unknown(NAME, str(self._absent.error), present=False)
        try:
            nvml = self._loader()
        except ImportError:
            self._absent = ProbeResult.unknown(NAME, "nvidia-ml-py is not installed", present=False)
            return self._absent
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU nodes
            self._absent = ProbeResult.unknown(NAME, f"NVML unavailable: {e}", present=False)
            return self._absent
        self._nvml = nvml
        return None

    def probe(self) -> ProbeResult:
        t0 = time.monotonic()
        absent = self._init()
        if absent is not None:
            return absent
        try:
            result = self._probe()
        except GpuLost as e:  # e.g. nvmlDeviceGetCount itself: the whole node's GPUs
            result = ProbeResult(source=NAME)
            result.add(self.policy.finding("gpu_lost", f"NVML: {e}"))
        except Exception as e:
            logger.debug("NVML probe failed", exc_info=True)
            result = ProbeResult.unknown(NAME, f"NVML query failed: {e}")
        result.duration_s = time.monotonic() - t0
        return result

    def _probe(self) -> ProbeResult:
        nvml = self._nvml
        count = _call(nvml.nvmlDeviceGetCount)
        handles: dict[str, Any] = {}
        readings: dict[str, dict[str, Any]] = {}
        for i in range(count):
            try:
                handles[str(i)] = _call(nvml.nvmlDeviceGetHandleByIndex, i)
            except GpuLost as e:
                readings[str(i)] = {"lost": str(e)}
        self._poll_xids(list(handles.values()))
        for gpu, h in handles.items():
            try:
                readings[gpu] = self._read(h, gpu)
            except GpuLost as e:
                readings[gpu] = {"lost": str(e)}
        result = ProbeResult(source=NAME)
        result.details["driver_version"] = _text(_try(nvml.nvmlSystemGetDriverVersion))
        evaluate_gpus(result, readings, policy=self.policy, cfg=self.cfg, thermal=self.thermal)
        return result

    def _poll_xids(self, handles: list[Any]) -> None:
        nvml = self._nvml
        if self._events is None:
            try:
                self._events = nvml.nvmlEventSetCreate()
                for h in handles:
                    _try(
                        nvml.nvmlDeviceRegisterEvents,
                        h,
                        nvml.nvmlEventTypeXidCriticalError,
                        self._events,
                    )
            except Exception as e:
                logger.debug("NVML XID events unavailable: %s", e)
                self._events = False
                return
        if not self._events:
            return
        uuids = {_text(_safe(nvml.nvmlDeviceGetUUID, h)): str(i) for i, h in enumerate(handles)}
        for _ in range(64):
            try:
                ev = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no pending event
                break
            gpu = uuids.get(_text(_safe(nvml.nvmlDeviceGetUUID, ev.device)), "?")
            self._xids.setdefault(gpu, []).append(int(ev.eventData))

    def _read(self, h: Any, gpu: str) -> dict[str, Any]:
        nvml = self._nvml
        r: dict[str, Any] = {
            "uuid": _text(_try(nvml.nvmlDeviceGetUUID, h)),
            "model": _text(_try(nvml.nvmlDeviceGetName, h)),
            "temp_c": _try(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
        }
        xids = self._xids.get(gpu)
        if xids:
            r["xid"] = xids[-1]
            r["xid_counts"] = {x: xids.count(x) for x in set(xids)}
        r["ecc_dbe_volatile"] = _try(
            nvml.nvmlDeviceGetTotalEccErrors,
            h,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_VOLATILE_ECC,
        )
        r["ecc_dbe_aggregate"] = _try(
            nvml.nvmlDeviceGetTotalEccErrors,
            h,
            nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nvml.NVML_AGGREGATE_ECC,
        )
        remap = _try(nvml.nvmlDeviceGetRemappedRows, h)
        if remap is not None:
            corr, unc, pending, failure = remap
            r.update(
                row_remap_correctable=corr,
                row_remap_uncorrectable=unc,
                row_remap_pending=int(bool(pending)),
                row_remap_failure=int(bool(failure)),
            )
        pending_pages = _try(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        if pending_pages is not None:
            r["retired_pages_pending"] = int(bool(pending_pages))
        reasons = _try(nvml.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:
            reasons = _try(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        r["clocks_event_reasons"] = reasons
        r["pcie_width"] = _try(nvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        r["pcie_width_max"] = _try(nvml.nvmlDeviceGetMaxPcieLinkWidth, h)
        r["pcie_gen"] = _try(nvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        r["pcie_gen_max"] = _try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        r["pcie_replay"] = _try(nvml.nvmlDeviceGetPcieReplayCounter, h)
        r["nvlink_errors"] = self._nvlink_errors(h)
        mem = _try(nvml.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            r["fb_used_mib"] = int(mem.used) >> 20
            r["fb_free_mib"] = int(mem.free) >> 20
        return {k: v for k, v in r.items() if v is not None}

    def _nvlink_errors(self, h: Any) -> int | None:
        nvml = self._nvml
        counters = [
            getattr(nvml, n, None)
            for n in (
                "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                "NVML_NVLINK_ERROR_DL_CRC_DATA",
                "NVML_NVLINK_ERROR_DL_REPLAY",
                "NVML_NVLINK_ERROR_DL_RECOVERY",
            )
        ]
        total, seen = 0, False
        for link in range(_MAX_NVLINKS):
            if _try(nvml.nvmlDeviceGetNvLinkState, h, link) is None:
                continue
            for c in counters:
                if c is None:
                    continue
                v = _try(nvml.nvmlDeviceGetNvLinkErrorCounter, h, link, c)
                if v is not None:
                    total += int(v)
                    seen = True
        return total if seen else None

    def close(self) -> None:
        if self._nvml is not None:
            if self._events:
                _safe(self._nvml.nvmlEventSetFree, self._events)
            _safe(self._nvml.nvmlShutdown)
            self._nvml = None
            self._events = None


class GpuLost(RuntimeError):
    """NVML says the GPU is lost or needs a reset: a drain verdict, never "unsupported"."""


# NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED (pynvml's values; stable across releases).
_LOST_CODES = frozenset({15, 16})


def _lost(e: Exception) -> bool:
    code = getattr(e, "value", None)
    return code in _LOST_CODES or "gpu is lost" in str(e).lower()


def _call(fn: Callable[..., object], *args: object) -> Any:
    """Call an NVML function that must work; a lost GPU raises :class:`GpuLost`."""
    try:
        return fn(*args)
    except Exception as e:
        if _lost(e):
            raise GpuLost(str(e) or "GPU is lost") from e
        raise


def _try(fn: Callable[..., object], *args: object) -> Any:
    """Call an NVML query; None where the GPU or driver does not support it, but a lost GPU
    raises :class:`GpuLost` (an unreachable GPU is a failure, not a missing feature)."""
    try:
        return fn(*args)
    except Exception as e:
        if _lost(e):
            raise GpuLost(str(e) or "GPU is lost") from e
        return None


def _safe(fn: Callable[..., object], *args: object) -> Any:
    """Like :func:`_try`, but a lost GPU is None too (the per-GPU read reports it)."""
    try:
        return fn(*args)
    except Exception:
        return None


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
