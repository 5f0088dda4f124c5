"""Helpers to run torchrun and trainguard run side by side on the same worker scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trainguard.testing.net import wait_listening as wait_listening  # re-exported for the tests
from trainguard.testing.ports import free_port as free_port  # re-exported for the tests

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

LAUNCHERS: dict[str, list[str]] = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
}

# The worker env contract of torchrun.
CONTRACT = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def base_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
    }
    env.pop("OMP_NUM_THREADS", None)
    # set in this process while an in-process rendezvous test's handler is inside torch's
    # next_rendezvous (a thread of it may still be): never a launched job's setting
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    # The memory tier snapshots every step in tests, whatever it stalls: its adaptive cadence
    # (trainguard's default stretches it beyond 1 % of a step) follows wall-clock measurements,
    # and the tests assert which step a restart or rollback resumes from. The cadence itself
    # is tested in test_inprocess_units (MemoryCadence and its defaults).
    env["TRAINGUARD_CHECKPOINT_MEMORY_MAX_STALL_FRACTION"] = "0"
    # ... and so the replica checks are off: with them the memory tier keeps only checked
    # state (a snapshot waits for the next check, at a cadence from a time budget). Their tests
    # (test_sdc) switch them on.
    env["TRAINGUARD_SDC_ENABLED"] = "false"
    # Warm starts stay on, but the zygotes for the next restart are not started unless a test
    # asks for them (``TRAINGUARD_WARM_PRESTART_DELAY_S``): each is a torch import plus its
    # preload (~4 s of CPU), wasted in every job that ends without another restart, and the
    # suite is CPU-bound. A restart before they exist is cold, the product's path for an early
    # failure. The warm path is tested where a test sets the delay (test_run_warm, test_spares,
    # test_warm_pool, test_run_restarts).
    env["TRAINGUARD_WARM_PRESTART_DELAY_S"] = "3600"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def launch(
    which: str,
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> Result:
    p = subprocess.run(
        LAUNCHERS[which] + args,
        cwd=cwd,
        env=env if env is not None else base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return Result(p.returncode, p.stdout, p.stderr)


def popen(which: str, args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        LAUNCHERS[which] + args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def read_dumps(dump_dir: Path) -> dict[tuple[int, int], dict]:
    out = {}
    for p in sorted(dump_dir.glob("env_*_*.json")):
        _, restart, rank = p.stem.split("_")
        out[(int(restart), int(rank))] = json.loads(p.read_text())
    return out


def steps_done(run_dir: Path) -> int:
    """The highest step any rank of a run recorded in its metrics file (-1 if none)."""
    best = -1
    for f in (run_dir / "metrics").glob("rank_*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "step":
                best = max(best, int(rec["step"]))
    return best


_TRACEBACK = "Traceback (most recent call last):"
_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
_NOTABLE = ("[W", "[E", "WARNING", "ERROR", "Error", "error", "failed", "[c10d]")


def log_excerpt(path: Path, limit: int = 8000) -> str:
    """How a launched agent's log says it ended, for an assertion message: its last exception
    chain from the chain's first traceback on (a plain tail cuts off the cause under a wrapper,
    e.g. the store error under torch's RendezvousConnectionError, which comes first), after the
    log's last warning and error lines before it; the log's tail when it has no traceback."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"({path}: {e})"
    start = text.rfind(_TRACEBACK)
    if start == -1:
        return text[-limit:]
    while True:  # back to the first traceback of the chain
        prev = text.rfind(_TRACEBACK, 0, start)
        if prev == -1 or not any(c in text[max(prev, start - 300) : start] for c in _CHAINED):
            break
        start = prev
    chain = text[start:]
    if len(chain) > limit:  # the cause (first) and the end (last), the middle left out
        chain = (
            f"{chain[: limit // 2]}\n[... {len(chain) - limit} chars ...]\n{chain[-limit // 2 :]}"
        )
    before = [
        line[:300]
        for line in text[:start].splitlines()
        if any(n in line for n in _NOTABLE) and not line.lstrip().startswith("frame #")
    ]
    return "\n".join([f"{path.name}:", *before[-20:], chain])
