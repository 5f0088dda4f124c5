"""A real Slurm 22.05 cluster (Debian slurm-wlm) for the tests: munged + slurmctld + one
``slurmd -N nodeK`` per node on this machine, started by tests/services/slurm/slurm-up.sh in a
private directory with free ports, stopped by PID (slurm-down.sh), and every process a job left
behind (found by this cluster's SLURM_CONF in its environment) killed by PID."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.launch_utils import base_env
from tests.services.telemetry_services import apt_ensure, port_open

SCRIPTS = Path(__file__).resolve().parent / "slurm"


@dataclass
class SlurmCluster:
    dir: Path
    conf: Path
    nodes: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        p = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and p.returncode != 0:
            raise RuntimeError(f"{argv} failed: {p.stderr.strip()}")
        return p.stdout

    def node(self, action: str, node: str) -> None:
        """slurm-node.sh ACTION NODE (start, stop, kill, crash)."""
        self.run("bash", str(SCRIPTS / "slurm-node.sh"), action, node, timeout=60)

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job, check=False)
        for tok in out.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job: str, key: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job, check=False)
        for tok in out.split():
            if tok.startswith(key + "="):
                return tok.split("=", 1)[1]
        return ""

    def wait_job(self, job: str, states: set[str], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        st = ""
        while time.monotonic() < deadline:
            st = self.job_state(job)
            if st in states:
                return st
            time.sleep(1)
        raise TimeoutError(f"job {job} still {st} after {timeout:.0f} s, wanted {states}")

    def jobs(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i", check=False).split()

    def node_state(self, node: str) -> tuple[str, str]:
        out = self.run("scontrol", "show", "node", "-o", node)
        st = next(t.split("=", 1)[1] for t in out.split() if t.startswith("State="))
        reason = out.split(" Reason=", 1)[1].strip() if " Reason=" in out else ""
        return st, reason

    def restore_nodes(self) -> None:
        """Every node up and idle again (after crashes and drains of a test)."""
        for n in self.nodes:
            self.node("start", n)
        for n in self.nodes:
            st, _ = self.node_state(n)
            if "DRAIN" in st or "DOWN" in st:
                self.run("scontrol", "update", f"nodename={n}", "state=resume", check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%t").split()
            if states.count("idle") >= len(self.nodes):
                return
            time.sleep(0.5)
        raise TimeoutError(f"nodes not idle again: {self.run('sinfo', '-N')}")

    def kill_job_processes(self) -> list[int]:
        """SIGKILL, by PID, every process that runs with this cluster's SLURM_CONF and a job id
        (agents, workers, batch shells) that Slurm left behind."""
        killed = []
        needle = f"SLURM_CONF={self.conf}".encode()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit() or int(p.name) == os.getpid():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env and any(e.startswith(b"SLURM_JOB_ID=") for e in env):
                try:
                    os.kill(int(p.name), signal.SIGKILL)
                    killed.append(int(p.name))
                except ProcessLookupError:
                    pass
        return killed


def _free_base(n: int) -> int:
    for _ in range(50):
        base = random.randint(20000, 32000)  # below the ephemeral range (32768-60999)
        if all(not port_open(base + k) for k in range(n + 2)):
            return base
    raise RuntimeError("no free port range for slurmd")


def start_cluster(nodes: int = 4) -> Iterator[SlurmCluster]:
    """Generator for a module fixture: yields a running cluster, then tears it down."""
    apt_ensure("slurm-wlm", "munge", "iproute2")
    d = Path(tempfile.mkdtemp(prefix="tg-slurm-"))
    cluster = SlurmCluster(d, d / "etc" / "slurm.conf", [f"node{k}" for k in range(1, nodes + 1)])
    try:
        for _ in range(3):  # a port taken meanwhile, or a slurmd slow to start under load
            base = _free_base(nodes)
            cluster.env = base_env(
                SLURM_CI_DIR=str(d),
                SLURM_CI_NODES=str(nodes),
                SLURM_CI_CTLD_PORT=str(base),
                SLURM_CI_NODE_PORT_BASE=str(base + 1),
                SLURM_CI_LINK_ETC="0",
                SLURM_CI_SLURMD_TIMEOUT="10",
                SLURM_CI_CRED_EXPIRE="10",  # a requeued job may start again 11 s later (not 121)
                SLURM_CONF=str(cluster.conf),
            )
            p = subprocess.run(
                ["bash", str(SCRIPTS / "slurm-up.sh")],
                env=cluster.env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if p.returncode == 0:
                break
            subprocess.run(
                ["bash", str(SCRIPTS / "slurm-down.sh")],
                env=dict(cluster.env, SLURM_CI_KEEP="1"),
                capture_output=True,
                timeout=120,
            )
        else:
            raise RuntimeError(f"slurm-up.sh failed 3 times: {p.stderr.strip()[-1500:]}")
        yield cluster
    finally:
        try:
            jobs = cluster.jobs()
            if jobs:
                cluster.run("scancel", *jobs, check=False)
        except Exception:
            pass
        subprocess.run(
            ["bash", str(SCRIPTS / "slurm-down.sh")],
            env=cluster.env,
            capture_output=True,
            timeout=120,
        )
        cluster.kill_job_processes()
