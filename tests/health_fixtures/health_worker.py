"""Test worker for hang and straggler detection: a gloo all-reduce per step under tg.step().

--stop-rank R --stop-at-step N   rank R stops itself with SIGSTOP inside step N (attempt 0 only),
                                 after writing the time to <run_dir>/stopped_at
--spin-rank R --spin-at-step N   rank R busy-waits outside any step from step N on (attempt 0
                                 only): alive, fresh heartbeat, never reaching the collective
--slow-rank R --slow-factor F    rank R computes F times longer per step
--slow-node N                    the ranks on node N compute --slow-factor times longer (which
                                 global rank a node's worker gets is the rendezvous's choice)
Every step logs compute_time_s (the time before the all-reduce).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import trainguard


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compute-s", type=float, default=0.02)
    p.add_argument("--stop-rank", type=int, default=-1)
    p.add_argument("--stop-at-step", type=int, default=-1)
    p.add_argument("--spin-rank", type=int, default=-1)
    p.add_argument("--spin-at-step", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-node", default=None)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--sleep", action="store_true", help="sleep instead of busy compute")
    args = p.parse_args()

    tg = trainguard.init()
    dist.init_process_group("gloo")
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    t = torch.ones(1024)
    for step in range(args.steps):
        if first_attempt and tg.rank == args.spin_rank and step == args.spin_at_step:
            (tg.run_dir / "spinning_at").write_text(str(time.time()))
            while True:
                time.sleep(0.01)
        with tg.step():
            t0 = time.perf_counter()
            slow = tg.rank == args.slow_rank or (
                args.slow_node is not None and tg.node == args.slow_node
            )
            work = args.compute_s * (args.slow_factor if slow else 1.0)
            (time.sleep if args.sleep else busy)(work)
            if first_attempt and tg.rank == args.stop_rank and step == args.stop_at_step:
                (tg.run_dir / "stopped_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            compute = time.perf_counter() - t0
            dist.all_reduce(t)
        tg.log(step=step, compute_time_s=compute)
    dist.destroy_process_group()
    if tg.rank == 0:
        (tg.run_dir / "done").write_text(str(tg.attempt))
    tg.close()


if __name__ == "__main__":
    main()
