"""A role node lost under a running RL job (a mode of bench/rl_fleet.py; runs alone too).

    python bench/role_nodes.py --runs 3      # 2 node losses per run (~3 min a run)

Without Slurm, the shape of a ``trainguard sbatch`` job with roles on nodes of their own, on
loopback: one ``trainguard run`` (examples/rl_fleet.py, 2 trainer ranks) whose ``rollout`` role
has ``nodes = 2, spares = 2``, and four role "nodes", each its own ``trainguard slurm roles``
agent process (the node name given as ``SLURMD_NODENAME``; every node's address 127.0.0.1).
The trainer's agent watches the role nodes' beacons (``[roles] node_dead_after_s``, its
default); each run kills -9 the agent of the first role node mid-run (its engine dies with
it), waits until its replica serves from a spare, then does the same to the second.

Figures (medians over every loss of every run): ``role_node_loss_step_delay_s`` (the trainer
step the loss fell in minus the run's median step; the target: at most 2 median steps,
``role_node_loss_step_delay_steps``), ``role_node_replaced_s`` (kill → the replica serving on
the spare, its state file saying so; target <= 30), ``role_node_trainer_restarts`` (trainer
restarts after a loss: 0).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.core.contracts.rundir import RunDir  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402

PROMPTS, BATCH = 64, 16
ENGINE = [sys.executable, "-m", "trainguard.rl.engine", "--poll-interval-s", "0.3"]
NODES = ["rn1", "rn2", "rn3", "rn4"]


def _port_pair() -> int:
    while True:
        p = free_port()
        if _free(p + 1):
            return p


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / "rank_0.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "step" and not r.get("failed"):
                out.append(r)
    return out


def one_run(root: Path, name: str, seed: int) -> dict[str, Any]:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    port = _port_pair()
    role = f"rollout=2,nodes=2,spares=2,port={port},budget=100:{' '.join(ENGINE)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "SLURM"))}
    env.update(
        TRAINGUARD_SBATCH_ROLE_NODES=",".join(f"{n}=127.0.0.1" for n in NODES),
        TRAINGUARD_SBATCH_ROLES_STOP=str(run_dir / "roles.stop"),
        TRAINGUARD_ROLES_PROBE_INTERVAL_S="0.5",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    err = open(run_dir / "trainer.err", "wb")  # noqa: SIM115
    trainer = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "100", "--no-tg-warm", "--tg-run-dir", str(run_dir), "--tg-role", role,
         str(REPO / "examples" / "rl_fleet.py"), "--steps", "100000", "--prompts", str(PROMPTS),
         "--batch", str(BATCH), "--group", "8", "--max-tokens", "16", "--request-timeout", "20",
         "--seed", str(seed)],
        env=env, stdout=subprocess.DEVNULL, stderr=err,
    )  # fmt: skip
    agents: dict[str, subprocess.Popen[bytes]] = {}
    time.sleep(1.0)  # the trainer's agent writes the job secret first
    for n in NODES:
        agents[n] = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "slurm", "roles", "--tg-run-dir", str(run_dir),
             "--tg-role", role, str(REPO / "examples" / "rl_fleet.py")],
            env={**env, "SLURM_JOB_ID": "bench", "SLURMD_NODENAME": n},
            stdout=subprocess.DEVNULL, stderr=open(run_dir / f"{n}.err", "wb"),  # noqa: SIM115
        )  # fmt: skip
    rundir = RunDir(run_dir)
    kills: list[tuple[float, float | None]] = []
    try:
        _wait(lambda: len(_steps(run_dir)) >= 6, 600, trainer)
        for victim, replica in (("rn1", 0), ("rn2", 1)):
            t_kill = time.time()
            os.kill(agents[victim].pid, signal.SIGKILL)
            agents[victim].wait()

            def replaced(replica: int = replica, victim: str = victim) -> bool:
                states = rundir.role_states().get("rollout", [])
                s = states[replica] if len(states) > replica else {}
                return s.get("node") not in (None, victim) and s.get("state") == "serving"

            ok = _wait(replaced, 120, trainer)
            kills.append((t_kill, time.time() - t_kill if ok else None))
            n = len(_steps(run_dir))
            _wait(lambda n=n: len(_steps(run_dir)) >= n + 4, 300, trainer)
    finally:
        for p in (trainer, *agents.values()):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (trainer, *agents.values()):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        err.close()
    steps = _steps(run_dir)
    med = statistics.median(r["step_time_s"] for r in steps[1:]) if len(steps) > 1 else 0.0
    delays = []
    for t, _ in kills:
        for r in steps:
            if r["time"] - r["step_time_s"] <= t <= r["time"]:
                delays.append(r["step_time_s"] - med)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]
    return {
        "replaced_s": [s for _, s in kills if s is not None],
        "losses": len(kills),
        "delays": delays,
        "median_step_s": med,
        # restarts after the first loss (a starved machine may restart the trainer before)
        "trainer_restarts": sum(
            e["kind"] == "restart" and bool(kills) and e["time"] > kills[0][0] for e in events
        ),
        "lost_events": sum(e["kind"] == "role_node_lost" for e in events),
    }


def _wait(cond: Any, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def role_node_loss(root: Path, runs: int) -> dict[str, Any]:
    """The figures over ``runs`` runs (see the module docstring)."""
    results = []
    for k in range(runs):
        r = one_run(root / "role-nodes", f"run{k}", seed=k)
        print(f"  [role nodes run {k}] {r}", flush=True)
        results.append(r)
    replaced = [s for r in results for s in r["replaced_s"]]
    delays = [d for r in results for d in r["delays"]]
    med_step = statistics.median(r["median_step_s"] for r in results) if results else 0.0
    delay = statistics.median(delays) if delays else None
    return {
        "role_node_loss_step_delay_s": round(delay, 3) if delay is not None else None,
        "role_node_loss_step_delay_steps": round(delay / med_step, 2)
        if delay is not None and med_step
        else None,
        "role_node_replaced_s": round(statistics.median(replaced), 3) if replaced else None,
        "role_node_replaced_max_s": round(max(replaced), 3) if replaced else None,
        "role_node_losses": sum(r["losses"] for r in results),
        "role_node_replaced": len(replaced),
        "role_node_trainer_restarts": sum(r["trainer_restarts"] for r in results),
        "role_node_median_step_s": round(med_step, 4),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3, help="runs (2 role node losses each)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-role-nodes-"))
    print(f"runs in {root}", flush=True)
    print(json.dumps(role_node_loss(root, args.runs)), flush=True)


if __name__ == "__main__":
    main()
