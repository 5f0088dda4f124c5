"""Slurm's node state, both ways, on a real Slurm 22.05 (2 nodes on this machine):

- a node an administrator drained is left out at its agent's next rendezvous (``node_refused``
  with the Slurm state, exit 94 through NodeEvictedError); a fit node joins;
- a drain trainguard set with its cause (the evicted node's own, ``XID 79``) is kept when a
  survivor notices the node left (never overwritten by the generic "node left job");
- ``trainguard fleet release NODE --slurm`` runs the node's health check, then resumes a node
  trainguard drained; a node drained by someone else is left alone unless ``--force``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_utils import base_env
from tests.services.slurm_cluster import SlurmCluster, start_cluster
from trainguard.core.config import TrainGuardConfig
from trainguard.core.events import EventLog
from trainguard.core.fencing import RecordOnlyFencer
from trainguard.core.plugin import AgentContext, NodeEvictedError
from trainguard.slurm.cli import CommandSlurm
from trainguard.slurm.fencer import SlurmFencer
from trainguard.slurm.plugin import SlurmDrainPlugin

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    yield from start_cluster(2)


def state(cluster: SlurmCluster, node: str) -> tuple[str, str]:
    out = cluster.run("scontrol", "show", "node", "-o", node)
    fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
    reason = out.split("Reason=", 1)[1].rsplit(" [", 1)[0] if "Reason=" in out else ""
    return fields.get("State", ""), reason


def test_drained_node_left_out_cause_kept_release_resumes(
    cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("SLURM_CONF", "PATH"):
        monkeypatch.setenv(k, cluster.env[k])
    slurm = CommandSlurm()
    n1, n2 = cluster.nodes[:2]
    try:
        # an administrator drains n2 mid-job
        cluster.run("scontrol", "update", f"nodename={n2}", "state=drain", "reason=maintenance")
        refused = {}
        for node in (n1, n2):
            events = EventLog(tmp_path / "run", node=node)
            ctx = AgentContext(config=TrainGuardConfig(), run_dir=tmp_path / "run", events=events)
            plugin = SlurmDrainPlugin(RecordOnlyFencer(), events, "42", slurm=slurm)
            try:
                plugin.before_rendezvous(ctx)
                refused[node] = None
            except NodeEvictedError as e:
                refused[node] = str(e)
        assert refused[n1] is None
        assert refused[n2] is not None and "DRAIN" in refused[n2] and "maintenance" in refused[n2]
        evs = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
        (ev,) = [e for e in evs if e["kind"] == "node_refused"]
        assert ev["node"] == n2 and "drain" in ev["slurm_state"]

        # n1 evicted for a health cause drains itself with it; a survivor keeps that reason
        res = SlurmFencer(slurm).fence(n1, "health: XID 79 on GPU 3 (fallen off the bus)")
        assert res.fenced, res.detail
        survivor = SlurmDrainPlugin(
            SlurmFencer(slurm), EventLog(tmp_path / "run", node=n2), "42", slurm=slurm
        )
        survivor._drain(n1, 3)
        st, reason = state(cluster, n1)
        assert "DRAIN" in st and reason.startswith("trainguard: health: XID 79 on GPU 3"), reason

        # release: the health check, then resume (trainguard's drain only, unless --force)
        env = base_env(
            SLURM_CONF=cluster.env["SLURM_CONF"],
            TRAINGUARD_RUNTIME_RUNS_ROOT=str(tmp_path / "runs"),
            TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
            TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
        )
        env["PATH"] = cluster.env["PATH"]

        def release(node: str, *extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "trainguard", "fleet", "release", node, "--slurm", *extra],
                env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
            )  # fmt: skip

        r = release(n1)
        assert r.returncode == 0 and f"resumed node {n1} in Slurm" in r.stdout, r.stderr
        assert "DRAIN" not in state(cluster, n1)[0]
        r = release(n2)
        assert r.returncode == 1 and "not drained by trainguard (reason: maintenance)" in r.stderr
        assert r.stderr.count("\n") == 1 and "DRAIN" in state(cluster, n2)[0]
        r = release(n2, "--force")
        assert r.returncode == 0 and "DRAIN" not in state(cluster, n2)[0], r.stderr
    finally:
        for node in (n1, n2):
            cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
