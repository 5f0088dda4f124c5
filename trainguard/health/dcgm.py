"""Source: the DCGM Python bindings (``pydcgm``, shipped with DCGM) when importable.

Sets health watches on all GPUs and reads ``health.Check()``; :func:`run_diag` runs a
``dcgmi diag`` level on demand. Neither DCGM nor its bindings can be installed on the machines
trainguard is developed on, so this module is exercised only where DCGM exists; on every other
node it reports "not present".
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from typing import Any

from trainguard.core.config.health import HealthConfig
from trainguard.health.policy import Policy
from trainguard.health.result import Finding, HealthAction, ProbeResult

__all__ = ["DcgmSource", "run_diag"]

logger = logging.getLogger(__name__)
NAME = "dcgm"
_HEALTH_WARN = 10
_HEALTH_FAIL = 20


class DcgmSource:
    name = NAME

    def __init__(self, cfg: HealthConfig, policy: Policy) -> None:
        self.cfg = cfg
        self.policy = policy
        self._group: Any = None
        self._handle: Any = None
        self._absent: str | None = None

    def _connect(self) -> ProbeResult | None:
        if self._group is not None:
            return None
        if self._absent is not None:
            return ProbeResult.unknown(NAME, self._absent, present=False)
        try:
            import dcgm_structs
            import pydcgm
        except ImportError:
            self._absent = "DCGM Python bindings not installed"
            return ProbeResult.unknown(NAME, self._absent, present=False)
        try:
            self._handle = pydcgm.DcgmHandle(
                ipAddress="127.0.0.1", opMode=dcgm_structs.DCGM_OPERATION_MODE_AUTO
            )
            group = pydcgm.DcgmGroup(
                self._handle, groupName="trainguard", groupType=dcgm_structs.DCGM_GROUP_DEFAULT
            )
            group.health.Set(dcgm_structs.DCGM_HEALTH_WATCH_ALL)
            self._group = group
        except Exception as e:
            return ProbeResult.unknown(NAME, f"no DCGM host engine: {e}", present=False)
        return None

    def probe(self) -> ProbeResult:
        t0 = time.monotonic()
        absent = self._connect()
        if absent is not None:
            return absent
        try:
            resp = self._group.health.Check()
            result = ProbeResult(source=NAME)
            overall = int(getattr(resp, "overallHealth", 0))
            result.details["overall_health"] = overall
            for inc in list(getattr(resp, "incidents", []))[
                : int(getattr(resp, "incidentCount", 0))
            ]:
                gpu = str(getattr(getattr(inc, "entityInfo", None), "entityId", "?"))
                msg = getattr(getattr(inc, "error", None), "msg", "") or "DCGM health incident"
                msg = msg.decode() if isinstance(msg, bytes) else str(msg)
                if int(getattr(inc, "health", 0)) >= _HEALTH_FAIL:
                    result.add(Finding("dcgm_health", HealthAction.DRAIN, f"GPU {gpu}: {msg}", gpu))
                else:
                    result.add(self.policy.finding("dcgm_health", msg, gpu=gpu))
            if overall >= _HEALTH_WARN and not result.findings:
                result.add(self.policy.finding("dcgm_health", f"DCGM overall health {overall}"))
        except Exception as e:
            result = ProbeResult.unknown(NAME, f"DCGM health check failed: {e}")
        result.duration_s = time.monotonic() - t0
        return result

    def close(self) -> None:
        self._group = None
        self._handle = None


def run_diag(level: int = 1, *, timeout_s: float = 600.0) -> ProbeResult:
    """Run ``dcgmi diag -r LEVEL -j`` (1: seconds, 2: ~2 min, 3: ~15 min)."""
    exe = shutil.which("dcgmi")
    if exe is None:
        return ProbeResult.unknown("dcgm_diag", "dcgmi not found", present=False)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [exe, "diag", "-r", str(level), "-j"], capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return ProbeResult.unknown("dcgm_diag", f"dcgmi diag -r {level} timed out")
    result = ProbeResult(source="dcgm_diag", duration_s=time.monotonic() - t0)
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return ProbeResult.unknown(
            "dcgm_diag", f"dcgmi diag output unreadable: {proc.stderr[:500]}"
        )
    result.details["diag"] = data
    if proc.returncode != 0 or '"Fail"' in proc.stdout:
        result.add(
            Finding("dcgm_diag", HealthAction.DRAIN, f"dcgmi diag -r {level} reported a failure")
        )
    return result
