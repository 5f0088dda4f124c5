"""Writes whether Python's cyclic garbage collector runs at each point of a worker's life (as
JSON to argv[1]): at the script's first line, after ``import torch``, after one ``tg.step()``."""

import gc
import json
import sys

state = {"first_line": gc.isenabled()}
import torch  # noqa: E402

import trainguard  # noqa: E402

state["after_import"] = gc.isenabled()
tg = trainguard.init()
with tg.step():
    torch.ones(2).sum()
state["after_first_step"] = gc.isenabled()
tg.close()
with open(sys.argv[1], "w") as f:
    json.dump(state, f)
