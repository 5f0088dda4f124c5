"""NVML (fake module + the real library on a GPU-less machine), host checks, node verdicts."""

from __future__ import annotations

import socket
import types
from pathlib import Path
from typing import Any

import pytest

from trainguard.core.config.health import HealthConfig
from trainguard.health.host import HostSource, parse_endpoint
from trainguard.health.node import NodeProbe, build_sources
from trainguard.health.nvml import NvmlSource
from trainguard.health.policy import Policy
from trainguard.health.result import HealthAction, ProbeResult, Status


class NVMLError(Exception):
    pass


def fake_nvml(gpus: list[dict[str, Any]], *, xid_events: list[tuple[int, int]] = ()) -> Any:
    """A module-like NVML with the calls NvmlSource makes; ``gpus`` hold per-GPU values."""
    pending = list(xid_events)

    def unsupported(*_: Any) -> Any:
        raise NVMLError("Not Supported")

    class Event:
        def __init__(self, gpu: int, xid: int) -> None:
            self.device, self.eventData = gpu, xid

    def wait(_set: Any, _timeout: int) -> Event:
        if not pending:
            raise NVMLError("Timeout")
        return Event(*pending.pop(0))

    def get(key: str, default: Any = 0) -> Any:
        return lambda h, *a: gpus[h].get(key, default)

    m = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        NVML_AGGREGATE_ECC=1, nvmlEventTypeXidCriticalError=8,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2, NVML_NVLINK_ERROR_DL_CRC_DATA=3,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlSystemGetDriverVersion=lambda: "570.86.15",
        nvmlEventSetCreate=lambda: object(), nvmlDeviceRegisterEvents=lambda *a: None,
        nvmlEventSetWait_v2=wait, nvmlEventSetFree=lambda s: None,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetTemperature=get("temp", 40),
        nvmlDeviceGetTotalEccErrors=lambda h, typ, where: gpus[h].get("dbe" if where == 0 else "dbe_agg", 0),
        nvmlDeviceGetRemappedRows=lambda h: gpus[h].get("remap", (0, 0, 0, 0)),
        nvmlDeviceGetRetiredPagesPendingStatus=unsupported,
        nvmlDeviceGetCurrentClocksEventReasons=get("reasons"),
        nvmlDeviceGetCurrPcieLinkWidth=get("width", 16), nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 5, nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 5,
        nvmlDeviceGetPcieReplayCounter=get("replay"),
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 18 else unsupported(),
        nvmlDeviceGetNvLinkErrorCounter=lambda h, link, c: gpus[h].get("nvlink", 0) if link == 0 and c == 2 else 0,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1 << 30, free=140 << 30),
    )  # fmt: skip
    return m


def nvml_probe(
    gpus: list[dict[str, Any]], cfg: HealthConfig | None = None, **kw: Any
) -> ProbeResult:
    cfg = cfg or HealthConfig()
    return NvmlSource(cfg, Policy(), nvml_loader=lambda: fake_nvml(gpus, **kw)).probe()


def test_nvml_healthy() -> None:
    res = nvml_probe([{} for _ in range(8)], HealthConfig(expect_gpus=8))
    assert res.status is Status.OK, res.to_dict()
    assert res.gpus["0"]["model"] == "NVIDIA H200" and res.gpus["7"]["uuid"] == "GPU-7"
    assert res.details["driver_version"] == "570.86.15"


@pytest.mark.parametrize(
    ("gpu", "check", "action"),
    [
        ({"dbe": 1}, "ecc_dbe_volatile", HealthAction.DRAIN),
        ({"remap": (0, 2, 0, 1)}, "row_remap_failure", HealthAction.DRAIN),
        ({"remap": (0, 0, 1, 0)}, "row_remap_pending", HealthAction.WARN),
        ({"width": 8}, "pcie_link_degraded", HealthAction.WARN),
        ({"nvlink": 500}, "nvlink_errors", HealthAction.WARN),
        ({"replay": 1000}, "pcie_replay", HealthAction.WARN),
        ({"reasons": 0x40, "temp": 92}, "thermal_sustained", HealthAction.WARN),
    ],
)
def test_nvml_counters(gpu: dict[str, Any], check: str, action: HealthAction) -> None:
    res = nvml_probe([{}, gpu])
    assert res.action is action, res.to_dict()
    assert any(f.check == check and f.gpu == "1" for f in res.findings)


def test_nvml_xid_events_and_missing_gpu() -> None:
    res = nvml_probe([{}, {}, {}], HealthConfig(expect_gpus=4), xid_events=[(2, 79)])
    assert res.status is Status.FAIL
    checks = {f.check: f for f in res.findings}
    assert checks["xid.79"].gpu == "2" and checks["gpu_missing"].action is HealthAction.DRAIN


class GpuIsLost(NVMLError):
    value = 15  # NVML_ERROR_GPU_IS_LOST, as pynvml's NVMLError subclasses carry it


def _lost(*_: Any) -> Any:
    raise GpuIsLost("GPU is lost")


@pytest.mark.parametrize("where", ["temperature", "handle", "count"])
def test_nvml_gpu_is_lost_is_a_drain_not_unsupported(where: str) -> None:
    gpus: list[dict[str, Any]] = [{}, {}]
    nvml = fake_nvml(gpus)
    if where == "temperature":  # one GPU's queries start failing with "GPU is lost"
        nvml.nvmlDeviceGetTemperature = lambda h, *a: _lost() if h == 1 else 40
    elif where == "handle":
        nvml.nvmlDeviceGetHandleByIndex = lambda i: _lost() if i == 1 else i
    else:
        nvml.nvmlDeviceGetCount = _lost
    res = NvmlSource(HealthConfig(), Policy(), nvml_loader=lambda: nvml).probe()
    assert res.status is Status.FAIL and res.action is HealthAction.DRAIN, res.to_dict()
    lost = [f for f in res.findings if f.check == "gpu_lost"]
    assert lost and "GPU is lost" in lost[0].reason
    if where != "count":
        assert lost[0].gpu == "1" and res.gpus["0"].get("temp_c") == 40


def test_real_nvml_without_a_driver_is_not_present() -> None:
    import pynvml  # the test extra installs nvidia-ml-py

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; bench/gpu_health.py covers it")
    except pynvml.NVMLError:
        pass
    res = NvmlSource(HealthConfig(), Policy()).probe()
    assert not res.present and "NVML unavailable" in (res.error or "")


def test_nvml_not_installed_is_not_present() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    res = NvmlSource(HealthConfig(), Policy(), nvml_loader=missing).probe()
    assert not res.present


def test_host_checks(tmp_path: Path) -> None:
    ok = HostSource(
        HealthConfig(min_free_disk_gib=0, min_free_memory_gib=0),
        Policy(),
        checkpoint_dir=tmp_path / "not" / "yet",
    ).probe()
    assert ok.status is Status.OK and ok.details["disk_free_gib"] > 0
    low = HostSource(
        HealthConfig(min_free_disk_gib=1e9, min_free_memory_gib=1e9),
        Policy(),
        checkpoint_dir=tmp_path,
    ).probe()
    assert low.status is Status.WARN
    assert {f.check for f in low.findings} == {"host_disk_low", "host_memory_low"}


def test_rendezvous_reachability() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cfg = HealthConfig(min_free_disk_gib=0, min_free_memory_gib=0)
        up = HostSource(cfg, Policy(), rdzv_endpoint=f"127.0.0.1:{port}").probe()
    down = HostSource(cfg, Policy(), rdzv_endpoint=f"127.0.0.1:{port}").probe()
    assert up.details["rdzv_reachable"] is True and up.status is Status.OK
    assert down.details["rdzv_reachable"] is False
    assert down.findings[0].check == "rdzv_unreachable" and down.status is Status.WARN
    assert parse_endpoint("localhost:0") is None and parse_endpoint("[::1]:29400") == ("::1", 29400)


def test_cpu_node_runs_host_checks_and_says_so(tmp_path: Path) -> None:
    cfg = HealthConfig(min_free_disk_gib=0, min_free_memory_gib=0)
    sources = build_sources(cfg, checkpoint_dir=tmp_path)
    sources[2] = NvmlSource(cfg, Policy(), nvml_loader=lambda: (_ for _ in ()).throw(ImportError()))
    report = NodeProbe(sources).probe()
    assert report.status is Status.OK and report.exit_code == 0
    assert report.note().startswith("no GPU source present")


def test_a_raising_source_becomes_unknown() -> None:
    class Broken:
        name = "broken"

        def probe(self) -> ProbeResult:
            raise RuntimeError("boom")

    report = NodeProbe([Broken()]).probe()
    assert report.status is Status.UNKNOWN and report.exit_code == 1
    assert "boom" in report.reasons[0]


@pytest.mark.parametrize(
    ("verdict", "rc", "status"), [("Pass", 0, Status.OK), ("Fail", 1, Status.FAIL)]
)
def test_dcgm_diag_through_a_dcgmi_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verdict: str, rc: int, status: Status
) -> None:
    from trainguard.health.dcgm import run_diag

    exe = tmp_path / "dcgmi"
    result = {"name": "Memory", "results": [{"status": verdict}]}
    body = __import__("json").dumps(
        {"DCGM GPU Diagnostic": {"test_categories": [{"tests": [result]}]}}
    )
    exe.write_text(f"#!/bin/sh\necho '{body}'\nexit {rc}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    res = run_diag(1, timeout_s=30)
    assert res.status is status
    if status is Status.FAIL:
        assert res.action is HealthAction.DRAIN and "dcgmi diag -r 1" in res.reasons[0]


def test_dcgm_sources_absent_here() -> None:
    from trainguard.health.dcgm import DcgmSource, run_diag

    assert not DcgmSource(HealthConfig(), Policy()).probe().present
    if __import__("shutil").which("dcgmi") is None:
        assert not run_diag(1).present


def test_in_job_monitor_checks_the_rendezvous_endpoint_and_the_checkpoint_dir_in_use(
    tmp_path: Path,
) -> None:
    """Under the agent the host checks get the job's rendezvous endpoint and the checkpoint
    directory the job writes to (``[checkpoint] dir``), not ``[health] checkpoint_dir``."""
    import types as _types

    from trainguard.core.config import load_config
    from trainguard.core.events import EventLog
    from trainguard.core.plugin import AgentContext
    from trainguard.health.monitor import HealthMonitor
    from trainguard.health.plugins import health_plugins

    ckpt = tmp_path / "ckpt"
    cfg = load_config(env={"TRAINGUARD_CHECKPOINT_DIR": str(ckpt)})
    launch = _types.SimpleNamespace(rdzv_endpoint="127.0.0.1:29400", run_id="j")
    ctx = AgentContext(
        config=cfg, run_dir=tmp_path, events=EventLog(tmp_path), launch_config=launch
    )
    [monitor] = [p for p in health_plugins(ctx) if isinstance(p, HealthMonitor)]
    [host] = [s for s in monitor.probe.sources if isinstance(s, HostSource)]
    assert host.rdzv_endpoint == "127.0.0.1:29400"
    assert host.checkpoint_dir == ckpt
    # --standalone's endpoint has no port until run time: nothing to check
    ctx.launch_config = _types.SimpleNamespace(rdzv_endpoint="localhost:0", run_id="j")
    [monitor] = [p for p in health_plugins(ctx) if isinstance(p, HealthMonitor)]
    [host] = [s for s in monitor.probe.sources if isinstance(s, HostSource)]
    assert host.rdzv_endpoint is None
