"""A dcgm-exporter stand-in for fault drills: the exposition text of an H100 node (8 GPUs
unless told), with faults, and the endpoint ``trainguard chaos dcgm`` serves.

A fault is injected per GPU: ``h100_node(faults={3: {"DCGM_FI_DEV_XID_ERRORS": 79}})``; a
``missing`` set drops GPUs entirely. :class:`DcgmExporter` turns faulty after a delay or on a
trigger file (the test suite's endpoint serving any text is
``trainguard.testing.dcgm.ExporterServer``).
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from pathlib import Path

__all__ = ["FIELDS", "DcgmExporter", "h100_node"]

# (name, type, help, healthy value) in dcgm-exporter's default + health-suite field set.
FIELDS: list[tuple[str, str, str, float]] = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", 1980),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", 2619),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", 41),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", 38),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", 312.5),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        9.1e10,
    ),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", 0),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", 97),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", 41),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", 0),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", 0),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", 0),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Frame buffer memory free (in MB).", 2100),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Frame buffer memory used (in MB).", 79000),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Frame buffer memory reserved (in MB).", 550),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes.",
        0,
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        0,
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        0,
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed", 0),
    (
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        0.93,
    ),
    (
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        0.41,
    ),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        0.52,
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "counter",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        1.2e8,
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "counter",
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        3.4e8,
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        0,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        0,
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Total number of single-bit persistent ECC errors.",
        0,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Total number of double-bit persistent ECC errors.",
        0,
    ),
    ("DCGM_FI_DEV_RETIRED_PENDING", "counter", "Total number of retired pages pending.", 0),
    (
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink flow-control CRC errors.",
        0,
    ),
    (
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink retries.",
        0,
    ),
    (
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "counter",
        "Total number of NVLink recovery errors.",
        0,
    ),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event reasons (bitmask).", 0),
    (
        "DCGM_FI_DEV_THERMAL_VIOLATION",
        "counter",
        "Throttling duration due to thermal constraints (in us).",
        0,
    ),
]

UUIDS = [
    "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52",
    "GPU-1b2f0c7e-6a41-4f0e-9d4b-2f8d3c1a7e90",
    "GPU-7d3e9a12-5c8b-4e21-b7f6-0a9c2d4e6f13",
    "GPU-c4a8e2f1-93d7-4b6a-8e5c-1f2a3b4c5d6e",
    "GPU-2e9f7a3b-8c1d-4f5e-a6b7-c8d9e0f1a2b3",
    "GPU-9a8b7c6d-5e4f-4a3b-9c2d-1e0f9a8b7c6d",
    "GPU-3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e6f",
    "GPU-e1f2a3b4-c5d6-4e7f-8a9b-0c1d2e3f4a5b",
]
PCI = ["04", "0A", "41", "47", "84", "8A", "C1", "C7"]


def _uuid(gpu: int) -> str:
    return UUIDS[gpu] if gpu < len(UUIDS) else f"GPU-00000000-0000-4000-8000-{gpu:012d}"


def _pci(gpu: int) -> str:
    return PCI[gpu] if gpu < len(PCI) else f"{gpu + 1:02X}"


def h100_node(
    *,
    hostname: str = "node-12",
    host_label: str = "hostname",
    faults: dict[int, dict[str, float]] | None = None,
    xid_msgs: dict[int, str] | None = None,
    missing: set[int] | frozenset[int] = frozenset(),
    num_gpus: int = 8,
    xid_counts: dict[int, dict[int, int]] | None = None,
) -> str:
    """The node's ``/metrics`` text: every GPU healthy but for ``faults`` (GPU → field →
    value), ``xid_msgs`` (GPU → ``err_msg``), the GPUs in ``missing`` left out, and the
    optional ``DCGM_EXP_XID_ERRORS_COUNT`` series (GPU → XID → count)."""
    faults = faults or {}
    xid_msgs = xid_msgs or {}
    lines: list[str] = []
    for name, typ, help_, healthy in FIELDS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {typ}")
        for gpu in range(num_gpus):
            if gpu in missing:
                continue
            value = faults.get(gpu, {}).get(name, healthy)
            labels = (
                f'gpu="{gpu}",UUID="{_uuid(gpu)}",pci_bus_id="00000000:{_pci(gpu)}:00.0",'
                f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",'
                f'{host_label}="{hostname}",DCGM_FI_DRIVER_VERSION="570.86.15"'
            )
            if name == "DCGM_FI_DEV_XID_ERRORS":
                msg = xid_msgs.get(gpu, "")
                labels += f',err_code="{int(value)}",err_msg="{msg}"'
            v = int(value) if float(value).is_integer() else value
            lines.append(f"{name}{{{labels}}} {v}")
    if xid_counts:  # off by default in dcgm-exporter; a health suite asks for it
        lines.append(
            "# HELP DCGM_EXP_XID_ERRORS_COUNT Count of XID Errors within user-specified time window (see xid-count-window-size param)."
        )
        lines.append("# TYPE DCGM_EXP_XID_ERRORS_COUNT gauge")
        for gpu, per_xid in xid_counts.items():
            for xid, n in per_xid.items():
                lines.append(
                    f'DCGM_EXP_XID_ERRORS_COUNT{{gpu="{gpu}",UUID="{_uuid(gpu)}",'
                    f'device="nvidia{gpu}",modelName="NVIDIA H100 80GB HBM3",'
                    f'{host_label}="{hostname}",window_size_in_ms="300000",xid="{xid}"}} {n}'
                )
    return "\n".join(lines) + "\n"


class DcgmExporter:
    """A dcgm-exporter-compatible ``/metrics`` endpoint on ``host:port`` (0: a free port) that
    turns faulty (GPU ``gpu`` reports ``xid``) ``after_s`` seconds after it starts, or once
    ``trigger_file`` exists, whichever comes first (neither: faulty from the start)."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        xid: int = 79,
        gpu: int = 0,
        num_gpus: int = 8,
        hostname: str = "node",
        after_s: float | None = None,
        trigger_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.xid, self.gpu, self.num_gpus, self.hostname = xid, gpu, num_gpus, hostname
        self.after_s = after_s
        self.trigger_file = Path(trigger_file) if trigger_file else None
        self.t0 = time.monotonic()
        self.scrapes = 0
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                me.scrapes += 1
                body = me.text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread: threading.Thread | None = None

    def faulty(self) -> bool:
        if self.after_s is None and self.trigger_file is None:
            return True
        if self.after_s is not None and time.monotonic() - self.t0 >= self.after_s:
            return True
        return self.trigger_file is not None and self.trigger_file.exists()

    def text(self) -> str:
        faults: dict[int, dict[str, float]] = {}
        if self.faulty():
            faults[self.gpu] = {"DCGM_FI_DEV_XID_ERRORS": self.xid}
        return h100_node(
            hostname=self.hostname, host_label="Hostname", faults=faults, num_gpus=self.num_gpus
        )

    def start(self) -> DcgmExporter:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
