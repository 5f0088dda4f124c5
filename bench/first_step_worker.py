"""Worker for bench/launch.py: init the process group, run one step, record when it ended."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1024)
dist.all_reduce(t)
if dist.get_rank() == 0:
    with open(os.environ["FIRST_STEP_FILE"], "w") as f:
        f.write(repr(time.time()))
dist.destroy_process_group()
