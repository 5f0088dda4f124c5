"""Preflight gate, in-job probing and cross-node comparison inside real `trainguard run` jobs."""

from __future__ import annotations

import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from tests.health_fixtures.jobs import events, job_cmd, job_env, run_job, wait_for_event
from tests.procs import kill_tree
from trainguard.core.failures import EVICTED_EXIT_CODE
from trainguard.health.compute import gemm_probe, peak_bf16_flops
from trainguard.health.monitor import compare_nodes, exchange_node_values
from trainguard.testing.dcgm import ExporterServer, h100_node

HOST_OK = dict(min_free_disk_gib=0, min_free_memory_gib=0)


def test_preflight_exclude_keeps_a_failing_node_out(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    text = h100_node(faults={5: {"DCGM_FI_DEV_XID_ERRORS": 48}})
    with ExporterServer(text) as srv:
        env = job_env(dcgm_url=srv.url, preflight_policy="exclude", probe_interval_s=0, **HOST_OK)
        p = run_job(run_dir, ["--steps", "3"], env=env)
    assert p.returncode != 0
    [pre] = events(run_dir, "preflight")
    assert pre["status"] == "fail" and pre["action"] == "drain"
    [excl] = events(run_dir, "node_excluded")
    assert any("XID 48" in r for r in excl["reasons"])
    assert not events(run_dir, "workers_started")
    assert "failed its preflight" in p.stderr


def test_in_job_probe_finding_restarts_the_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with ExporterServer(h100_node()) as srv:
        env = job_env(dcgm_url=srv.url, probe_interval_s=0.3, **HOST_OK)
        proc = subprocess.Popen(
            job_cmd(run_dir, ["--steps", "120", "--compute-s", "0.05", "--sleep"], max_restarts=1),
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for_event(run_dir, "workers_started")
            srv.text = h100_node(faults={2: {"DCGM_FI_DEV_XID_ERRORS": 13}})
            [bad] = wait_for_event(run_dir, "health_unhealthy", timeout=30)
            srv.text = h100_node()
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert bad["action"] == "restart" and "XID 13" in bad["reasons"][0]
    probes = events(run_dir, "health_probe")
    assert any(e["status"] == "warn" for e in probes)
    assert bad["ranks"] == [0, 1]
    assert {e["signal"] for e in events(run_dir, "worker_failed")} == {"SIGKILL"}
    assert len(events(run_dir, "restart")) == 1
    assert len(events(run_dir, "preflight")) == 2  # probes before every rendezvous
    assert (run_dir / "done").read_text() == "1"


def test_in_job_drain_takes_the_node_out_even_with_restarts_left(tmp_path: Path) -> None:
    """A drain verdict never restarts the job on the same node: the node is evicted (one
    line, exit 94, recovery's policy), with restarts to spare."""
    run_dir = tmp_path / "run"
    with ExporterServer(h100_node()) as srv:
        env = job_env(dcgm_url=srv.url, probe_interval_s=0.3, **HOST_OK)
        proc = subprocess.Popen(
            job_cmd(run_dir, ["--steps", "300", "--compute-s", "0.05", "--sleep"], max_restarts=3),
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for_event(run_dir, "workers_started")
            srv.text = h100_node(faults={2: {"DCGM_FI_DEV_XID_ERRORS": 79}})
            _, err = proc.communicate(timeout=120)
        finally:
            kill_tree(proc)
    assert proc.returncode == EVICTED_EXIT_CODE, err[-3000:]
    [bad] = events(run_dir, "health_unhealthy")
    assert bad["action"] == "drain" and "XID 79" in bad["reasons"][0]
    [excl] = events(run_dir, "node_excluded")
    assert excl["reason"] == "health" and excl["action"] == "drain"
    assert not events(run_dir, "restart")  # not restarted on the node to drain
    assert events(run_dir, "job_finished")[-1]["state"] == "evicted"
    assert "must be drained" in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not (run_dir / "done").exists()


def test_exchange_and_compare_across_nodes_over_a_real_store() -> None:
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    port = server.port
    results: dict[int, dict] = {}

    def node(rank: int, flops: float) -> None:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        results[rank] = exchange_node_values(
            store, prefix="t/0", group_rank=rank, world_size=3, value={"flops_per_s": flops}
        )

    threads = [
        threading.Thread(target=node, args=(r, f)) for r, f in enumerate([100.0, 98.0, 30.0])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [0, 1, 2] and results[0] == results[2]
    cmp = compare_nodes(results[0], min_fraction=0.5, max_skew_s=2.0)
    assert cmp["slow_nodes"] == [2] and cmp["median_flops_per_s"] == 98.0
    assert cmp["skewed_nodes"] == [] and all(abs(s) < 1.0 for s in cmp["clock_skew_s"].values())
    skewed = dict(results[0])
    skewed[1] = dict(skewed[1], wall_time=skewed[1]["wall_time"] + 30)
    assert compare_nodes(skewed, min_fraction=0.5, max_skew_s=2.0)["skewed_nodes"] == [1]


def test_gemm_probe_on_cpu() -> None:
    r = gemm_probe(0.1, size=128)
    assert r.device == "cpu" and r.flops_per_s > 0 and r.iterations >= 1
    assert r.fraction_of_peak is None


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_peaks(name: str, peak: float | None) -> None:
    assert peak_bf16_flops(name) == peak


def test_two_agents_compare_compute_and_clocks_after_rendezvous(tmp_path: Path) -> None:
    """Each node's preflight reports its sources (a healthy dcgm-exporter each, 8 GPUs
    expected) and a CPU compute measurement; after the rendezvous the nodes compare compute
    and clocks, and an all-reduce probe measures the link."""
    from tests.health_fixtures.jobs import WORKER
    from tests.launch_utils import free_port

    run_dir = tmp_path / "run"
    port = free_port()
    procs = []
    servers = [ExporterServer(h100_node(hostname=f"node{n}")) for n in range(2)]
    for srv in servers:
        srv.__enter__()
    for n in range(2):
        env = job_env(**HOST_OK, probe_interval_s=0, allreduce_probe="true", allreduce_probe_mb=4,
                      dcgm_url=servers[n].url, expect_gpus=8)  # fmt: skip
        env.update(
            TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0.2",
            TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_CPU="true",
            SLURMD_NODENAME=f"node{n}",
        )
        cmd = [
            "-m", "trainguard", "run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hc",
            "--tg-run-dir", str(run_dir), str(WORKER), "--steps", "3",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                [__import__("sys").executable, *cmd],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        )
    try:
        errs = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
        for srv in servers:
            srv.__exit__(None, None, None)
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    pres = events(run_dir, "preflight")
    assert sorted(e["node"] for e in pres) == ["node0", "node1"]
    for pre in pres:
        assert pre["status"] == "ok" and pre["sources"]["dcgm_exporter"] == "ok"
        assert pre["sources"]["host"] == "ok"
        assert pre["compute"]["device"] == "cpu" and pre["compute"]["tflops"] > 0
        assert pre["compute"]["peak_tflops"] is None  # no made-up peak for a CPU
    cmps = events(run_dir, "preflight_compare")
    assert sorted(e["node"] for e in cmps) == ["node0", "node1"]
    a, b = cmps
    assert a["nodes"] == b["nodes"] == {"0": "node0", "1": "node1"}
    assert a["flops_per_s"] == b["flops_per_s"] and len(a["flops_per_s"]) == 2
    assert all(abs(s) < 2.0 for s in a["clock_skew_s"].values()) and a["skewed_nodes"] == []
    probes = events(run_dir, "allreduce_probe")
    assert len(probes) == 2 and all(p["backend"] == "gloo" and p["busbw_gbps"] > 0 for p in probes)
    assert all(p["bytes"] == 4 << 20 and p["status"] == "ok" for p in probes)
