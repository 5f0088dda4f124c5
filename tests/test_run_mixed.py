"""A torchrun agent and a trainguard agent in one c10d rendezvous (a cluster moved over node by
node) run the job together: the trainguard agent hosts its fresh worker store on the address
torch publishes for the round, so the torchrun agent's workers find it, and it records the
torchrun peer as a foreign member instead of waiting for its announcement forever."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.launch_utils import REPO, base_env, free_port, popen
from tests.procs import kill_tree

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


@pytest.mark.slow
@pytest.mark.parametrize("first", ["torchrun", "trainguard"])
def test_torchrun_and_trainguard_agents_finish_one_job(tmp_path: Path, first: str) -> None:
    second = "trainguard" if first == "torchrun" else "torchrun"
    port = free_port()
    run_dir = tmp_path / "run"
    env = base_env(TRAINGUARD_RUNTIME_RUN_DIR=str(run_dir))
    procs = {}
    try:
        for which in (first, second):  # the first one hosts the c10d store
            args = [
                "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mixed",
                EXAMPLE, "--steps", "20", "--ckpt-every", "0", "--out", str(tmp_path / "final.pt"),
            ]  # fmt: skip
            procs[which] = popen(which, args, cwd=tmp_path, env=env)
        try:
            outs = {w: p.communicate(timeout=120) for w, p in procs.items()}
        except subprocess.TimeoutExpired:  # both agents' words, not only the first's
            for p in procs.values():
                kill_tree(p)
            tails = {w: p.communicate(timeout=30)[1][-3000:] for w, p in procs.items()}
            raise AssertionError(f"the job did not end in 120 s: {tails}") from None
    finally:
        for p in procs.values():
            kill_tree(p)
    for which, p in procs.items():
        assert p.returncode == 0, f"{which}:\n{outs[which][1][-3000:]}"
    assert torch.load(tmp_path / "final.pt")  # rank 0 (on either launcher) finished training
    rdzv = [
        json.loads(line)
        for line in (run_dir / "events.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "rendezvous"
    ]
    [members] = [e["members"] for e in rdzv]
    assert sum(1 for m in members if m.get("foreign")) == 1, members
