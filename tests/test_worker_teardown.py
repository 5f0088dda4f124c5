"""``trainguard.destroy_process_group()``: every rank leaves through one barrier, the group is
destroyed, and the barrier's work outlives the group's threads (freed by the main thread at
exit, not by gloo's worker thread: see trainguard/worker/teardown.py). The deadlock it avoids
needs a loaded machine to show; tests/test_run_mixed.py runs the example that uses it."""

from __future__ import annotations

import subprocess
import sys

from tests.launch_utils import REPO, base_env, free_port

SCRIPT = """
import os, sys, torch, torch.distributed as dist
import trainguard
from trainguard.worker import teardown
trainguard.destroy_process_group()  # no group yet: nothing
assert not teardown._held
dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 3))
model(torch.ones(2, 3)).sum().backward()
trainguard.destroy_process_group()
assert not dist.is_initialized()
assert len(teardown._held) == 1 and teardown._held[0].is_completed()
del model  # the group's last reference: its threads joined while the work is still held
print("left", flush=True)
"""


def test_destroy_process_group_leaves_and_holds_the_barriers_work_until_exit() -> None:
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "left"
