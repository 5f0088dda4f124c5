"""The after-rendezvous all-reduce bandwidth probe: one process per node, all nodes together.

Each agent starts ``python -m trainguard.health.allreduce`` with its group rank; the processes
meet in the attempt's worker store (``MASTER_ADDR:MASTER_PORT``, under a prefix of their own),
all-reduce a buffer a few times (NCCL on GPU nodes, gloo otherwise) and print the measured
bandwidth as one JSON line. The probe runs in a child process so the agent never holds a CUDA
context or a process group.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

__all__ = ["run_allreduce_probe"]


def run_allreduce_probe(
    *,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    prefix: str,
    size_mb: float = 64.0,
    iters: int = 5,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Run this node's part of the probe; returns the measurement or ``{"error": ...}``."""
    cmd = [
        sys.executable, "-m", "trainguard.health.allreduce",
        "--addr", master_addr, "--port", str(master_port), "--rank", str(rank),
        "--world", str(world_size), "--prefix", prefix, "--mb", str(size_mb),
        "--iters", str(iters), "--timeout", str(timeout_s),
    ]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        return {"error": f"all-reduce probe timed out after {timeout_s + 30:g}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"all-reduce probe failed (exit {p.returncode}): {p.stderr[-500:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--mb", type=float, default=64.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=a.timeout)
    store = dist.PrefixStore(
        a.prefix, dist.TCPStore(a.addr, a.port, is_master=False, timeout=timeout)
    )
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=store, rank=a.rank, world_size=a.world, timeout=timeout)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    n = max(1, int(a.mb * (1 << 20) / 4))
    buf = torch.ones(n, dtype=torch.float32, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    dist.all_reduce(buf)  # warm-up (connections)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(buf)
    sync()
    dt = (time.perf_counter() - t0) / a.iters
    nbytes = n * 4
    algbw = nbytes / dt
    busbw = algbw * 2 * (a.world - 1) / a.world
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "backend": backend,
                "bytes": nbytes,
                "iters": a.iters,
                "seconds_per_iter": dt,
                "algbw_gbps": algbw / 1e9,
                "busbw_gbps": busbw / 1e9,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    _main()
