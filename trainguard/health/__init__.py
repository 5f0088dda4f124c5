"""trainguard.health: node probes (dcgm-exporter, DCGM, NVML, host), the XID/counter policy,
the preflight gate, in-job probing, hang and straggler detection.

Importing this package is cheap: GPU libraries load only when a source is probed.
"""

from trainguard.core.config.health import HealthConfig
from trainguard.health.result import Finding, HealthAction, ProbeResult, Status

__all__ = ["HealthAction", "Finding", "HealthConfig", "ProbeResult", "Status"]
