"""dcgm-exporter probing over a real HTTP server, and `trainguard health` exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.cli import cmd_health
from trainguard.core.config.health import HealthConfig
from trainguard.health.dcgm_exporter import DcgmExporterSource, parse_exposition
from trainguard.health.policy import Policy
from trainguard.health.result import HealthAction, Status
from trainguard.testing.dcgm import ExporterServer, h100_node

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cfg_file(tmp_path: Path) -> Path:
    # Host thresholds at 0 so the verdict depends on the GPU text only, whatever the CI disk.
    p = tmp_path / "tg.toml"
    p.write_text("[health]\nmin_free_disk_gib = 0.0\nmin_free_memory_gib = 0.0\n")
    return p


def probe(text: str, **cfg_kw: object):
    cfg = HealthConfig(**cfg_kw)  # type: ignore[arg-type]
    with ExporterServer(text) as srv:
        src = DcgmExporterSource(
            cfg, Policy.from_overrides(cfg.xid_policy, cfg.counter_policy), url=srv.url
        )
        return src.probe()


def run_cli(text: str, cfg_file: Path, capsys: pytest.CaptureFixture[str], *extra: str):
    with ExporterServer(text) as srv:
        code = cmd_health.main(["--json", "--dcgm-url", srv.url, "--config", str(cfg_file), *extra])
    out = json.loads(capsys.readouterr().out)
    return code, out


def test_healthy_h100_node(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(h100_node(), cfg_file, capsys, "--expect-gpus", "8")
    assert code == 0, out
    assert out["status"] == "ok" and out["action"] == "ignore"
    dcgm = next(s for s in out["sources"] if s["source"] == "dcgm_exporter")
    assert dcgm["status"] == "ok"
    assert sorted(dcgm["gpus"]) == [str(i) for i in range(8)]
    assert dcgm["gpus"]["0"]["model"] == "NVIDIA H100 80GB HBM3"
    assert dcgm["gpus"]["0"]["uuid"].startswith("GPU-604ac76c")
    assert dcgm["details"]["hostname"] == "node-12"
    assert "dcgm_exporter" in out["note"]


@pytest.mark.parametrize("label", ["Hostname", "hostname"])
def test_both_host_labels(label: str) -> None:
    gpus, details = parse_exposition(h100_node(host_label=label, hostname="gpu-a7"))
    assert details["hostname"] == "gpu-a7"
    assert len(gpus) == 8


@pytest.mark.parametrize(
    ("faults", "check", "action", "status", "code"),
    [
        ({3: {"DCGM_FI_DEV_XID_ERRORS": 79}}, "xid.79", HealthAction.DRAIN, Status.FAIL, 2),
        ({5: {"DCGM_FI_DEV_XID_ERRORS": 48}}, "xid.48", HealthAction.DRAIN, Status.FAIL, 2),
        (
            {1: {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2}},
            "ecc_dbe_volatile",
            HealthAction.DRAIN,
            Status.FAIL,
            2,
        ),
        (
            {6: {"DCGM_FI_DEV_ROW_REMAP_FAILURE": 1}},
            "row_remap_failure",
            HealthAction.DRAIN,
            Status.FAIL,
            2,
        ),
        ({2: {"DCGM_FI_DEV_XID_ERRORS": 13}}, "xid.13", HealthAction.RESTART, Status.WARN, 1),
        ({2: {"DCGM_FI_DEV_XID_ERRORS": 94}}, "xid.94", HealthAction.RESTART, Status.WARN, 1),
        (
            {4: {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x40, "DCGM_FI_DEV_GPU_TEMP": 91}},
            "thermal_sustained",
            HealthAction.WARN,
            Status.WARN,
            1,
        ),
    ],
)
def test_faults(
    faults: dict[int, dict[str, float]],
    check: str,
    action: HealthAction,
    status: Status,
    code: int,
    cfg_file: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpu = str(next(iter(faults)))
    res = probe(h100_node(faults=faults))
    assert res.status is status, res.to_dict()
    assert res.action is action
    [finding] = [f for f in res.findings if f.action is not HealthAction.IGNORE]
    assert finding.check == check and finding.gpu == gpu
    assert f"GPU {gpu}" in finding.reason

    rc, out = run_cli(h100_node(faults=faults), cfg_file, capsys, "--expect-gpus", "8")
    assert rc == code
    assert out["status"] == status.value and out["action"] == action.value
    assert any(check.split(".")[-1] in json.dumps(r) for r in out["reasons"]) or out["reasons"]


def test_xid_message_is_reported() -> None:
    res = probe(
        h100_node(
            faults={3: {"DCGM_FI_DEV_XID_ERRORS": 79}}, xid_msgs={3: "GPU has fallen off the bus"}
        )
    )
    assert "fallen off the bus" in res.reasons[0]
    assert "XID 79" in res.reasons[0]


def test_missing_gpu(cfg_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = probe(h100_node(missing={7}), expect_gpus=8)
    assert res.status is Status.FAIL and res.action is HealthAction.DRAIN
    assert res.findings[0].check == "gpu_missing"
    assert "7 GPUs visible, 8 expected" in res.reasons[0]
    rc, out = run_cli(h100_node(missing={7}), cfg_file, capsys, "--expect-gpus", "8")
    assert rc == 2 and out["action"] == "drain"
    # Without an expectation a 7-GPU node is just a 7-GPU node.
    assert probe(h100_node(missing={7})).status is Status.OK


def test_thermal_throttling_must_be_sustained() -> None:
    cfg = HealthConfig(thermal_sustain_samples=3)
    text = h100_node(
        faults={4: {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x20, "DCGM_FI_DEV_GPU_TEMP": 80}}
    )
    with ExporterServer(text) as srv:
        src = DcgmExporterSource(cfg, Policy(), url=srv.url)
        first, second, third = src.probe(), src.probe(), src.probe()
        srv.text = h100_node()
        cooled = src.probe()
    assert first.status is Status.OK and first.findings[0].check == "thermal_throttle"
    assert second.status is Status.OK
    assert third.status is Status.WARN and third.findings[0].check == "thermal_sustained"
    assert "3 consecutive samples" in third.reasons[0]
    assert cooled.status is Status.OK and not cooled.findings


@pytest.mark.parametrize(
    "text",
    [
        'DCGM_FI_DEV_GPU_TEMP{gpu="0" 41\n',
        'DCGM_FI_DEV_GPU_TEMP{gpu="0"} forty-one\n',
        "",
        "# just a comment\nup 1\n",
    ],
)
def test_malformed_text_is_unknown(
    text: str, cfg_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = probe(text)
    assert res.status is Status.UNKNOWN
    assert res.error and "cannot parse the exposition text" in res.error
    rc, out = run_cli(text, cfg_file, capsys)
    assert rc == 1 and out["status"] == "unknown"
    assert any("cannot parse" in r for r in out["reasons"])


def test_policy_override() -> None:
    text = h100_node(faults={3: {"DCGM_FI_DEV_XID_ERRORS": 79}})
    res = probe(text, xid_policy={"79": "warn"})
    assert res.status is Status.WARN and res.action is HealthAction.WARN
    res = probe(
        h100_node(faults={1: {"DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": 1}}),
        counter_policy={"ecc_dbe_aggregate": "drain"},
    )
    assert res.action is HealthAction.DRAIN


def test_bad_policy_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not an action"):
        HealthConfig(xid_policy={"79": "explode"})
    with pytest.raises(ValueError, match="unknown check"):
        HealthConfig(counter_policy={"nope": "warn"})


def test_unreachable_endpoint() -> None:
    from tests.launch_utils import free_port

    url = f"http://127.0.0.1:{free_port()}/metrics"
    cfg = HealthConfig()
    explicit = DcgmExporterSource(cfg, Policy(), url=url).probe()
    assert explicit.present and explicit.status is Status.UNKNOWN
    default = DcgmExporterSource(cfg, Policy(), url=url, explicit=False).probe()
    assert not default.present


def test_cli_subprocess_table_and_exit_code(cfg_file: Path) -> None:
    text = h100_node(faults={0: {"DCGM_FI_DEV_XID_ERRORS": 48}})
    with ExporterServer(text) as srv:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainguard",
                "health",
                "--dcgm-url",
                srv.url,
                "--config",
                str(cfg_file),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    assert p.returncode == 2, p.stderr
    assert "FAIL" in p.stdout and "XID 48" in p.stdout
    assert "NVIDIA H100 80GB HBM3" in p.stdout


def test_repeated_application_xids_escalate_to_drain() -> None:
    once = probe(h100_node(xid_counts={2: {13: 1}}))
    assert once.action is HealthAction.RESTART and "1 occurrence" in once.reasons[0]
    many = probe(h100_node(xid_counts={2: {13: 4, 31: 1}}))
    assert many.action is HealthAction.DRAIN and many.status is Status.FAIL
    [x13] = [f for f in many.findings if f.check == "xid.13"]
    assert x13.action is HealthAction.DRAIN and "escalated: 4 >= 3" in x13.reason
    [x31] = [f for f in many.findings if f.check == "xid.31"]
    assert x31.action is HealthAction.RESTART
    assert (
        probe(h100_node(xid_counts={2: {13: 4}}), xid_escalate_after=0).action
        is HealthAction.RESTART
    )
