"""A plain torch.distributed script (no trainguard import) for hang diagnosis tests.

``--diverge-rank R --at-step S``: at step S (first attempt only) rank R calls an extra
``all_reduce`` while the others go on to the ``broadcast``. ``--stop-rank R --at-step S``: rank R
stops itself (SIGSTOP) inside step S, before its collectives; ``--kill-rank R``: it SIGKILLs
itself there (survivors that leave their collective with an error write ``released_rank_R``);
with ``--keep-sockets`` a forked child (pid in ``pids/holder_R``, gone after 120 s) keeps its
connections open, so its peers see no closed socket; ``--stop-node``: the stopped rank stops
its launcher (parent) first, a whole node frozen. Every rank writes its pid to
``pids/rank_R`` and the hang moment to ``hang_at`` in the working directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--diverge-rank", type=int, default=-1)
    p.add_argument("--stop-rank", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--at-step", type=int, default=30)
    p.add_argument("--keep-sockets", action="store_true")
    p.add_argument("--stop-node", action="store_true")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    Path("pids").mkdir(exist_ok=True)
    Path(f"pids/rank_{rank}").write_text(str(os.getpid()))
    t = torch.ones(16)
    for step in range(a.steps):
        time.sleep(a.step_s)
        if first and step == a.at_step and rank == a.stop_rank:
            Path("hang_at").write_text(str(time.time()))
            if a.stop_node:  # its launcher too: a node that froze or dropped off the network
                os.kill(os.getppid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        if first and step == a.at_step and rank == a.kill_rank:
            if a.keep_sockets:  # a child holds the connections open: a peer that vanished
                holder = os.fork()  # without closing them (lost node, partition)
                if holder == 0:
                    os.setsid()  # out of the worker's process group, which torch ends
                    time.sleep(120)
                    os._exit(0)
                Path(f"pids/holder_{rank}").write_text(str(holder))
            Path("hang_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(t)
        except Exception:  # a peer died: record when this survivor left the collective
            Path(f"released_rank_{rank}").write_text(str(time.time()))
            raise
        if first and step == a.at_step and rank == a.diverge_rank:
            Path("hang_at").write_text(str(time.time()))
            dist.all_reduce(t)  # the extra collective only this rank calls
        dist.broadcast(t, 0)
    dist.barrier()
    if rank == 0:
        Path("done").write_text(str(a.steps))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
