"""Runs a framework example (``python bench/hook_cost.py EXAMPLE.py ARGS...`` as the worker
script under ``trainguard run``) and measures on rank 0 what trainguard's framework callback
costs the training thread, by accounting instead of by comparing two runs (which this shared
2-core machine cannot do to 1 %: the same run varies by ±30 %):

- the CPU time (``time.thread_time``) and wall time spent inside the callback's per-step hooks
  (Lightning ``on_train_batch_start/end``; transformers ``on_step_begin/end``, ``on_log``,
  ``on_save``), after the first ``SKIP`` steps (``$HOOK_COST_SKIP``, default 5);
- the CPU time of trainguard's own threads in the worker (``tg-*``, ``trainguard-*``: the
  snapshot stager, the metrics flusher, the heartbeat and collectives watchers) over the same
  steps, read from ``/proc`` when they begin and every 0.5 s after;
- the training's steady wall time per step over the same steps.

At exit rank 0 writes them as JSON to ``$HOOK_COST_OUT`` (with ``HOOK_COST_DETAIL=1`` also the
time of the heartbeat, metrics, snapshot and agreement calls inside the hooks, under
``detail``). Every microsecond of both counts as
added to the step (an upper bound: on a GPU much of the hooks' CPU time overlaps with kernels
already queued).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import runpy
import sys
import threading
import time
from typing import Any

SKIP = int(os.environ.get("HOOK_COST_SKIP", "5"))
"""Steps left out first (``HOOK_COST_SKIP``; default 5)."""
HOOKS = {
    "lightning": ("on_train_batch_start", "on_train_batch_end"),
    "hf": ("on_step_begin", "on_step_end", "on_log", "on_save"),
}
STEP_END = {"lightning": "on_train_batch_end", "hf": "on_step_end"}

acc: dict[str, list[float]] = {}  # hook -> [calls, cpu s, wall s]
detail: dict[str, list[float]] = {}
steps = {"n": 0, "t0": 0.0, "t1": 0.0}
threads_cpu: dict[int, tuple[str, float]] = {}
threads_cpu0: dict[int, tuple[str, float]] = {}
"""The threads' CPU time when the accounted steps began (subtracted: the same window)."""


def _wrap(fw: str, cls: Any, name: str, label: str | None = None) -> None:
    fn = getattr(cls, name)
    end = label is None and name == STEP_END[fw]

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            c1, w1 = time.thread_time(), time.perf_counter()
            if steps["n"] >= SKIP:
                a = (detail if label else acc).setdefault(label or name, [0, 0.0, 0.0])
                a[0] += 1
                a[1] += c1 - c0
                a[2] += w1 - w0
            if end:
                steps["n"] += 1
                if steps["n"] == SKIP:
                    steps["t0"] = w1
                    _sample_once()
                    threads_cpu0.update(threads_cpu)
                steps["t1"] = w1

    setattr(cls, name, hook)


def _patch(fw: str) -> None:
    if fw == "lightning":
        from trainguard.integrations import lightning

        cls: Any = lightning._Mixin
    else:
        from trainguard.integrations import hf

        cls = hf.TrainGuardCallback
    for name in HOOKS[fw]:
        _wrap(fw, cls, name)
    if os.environ.get("HOOK_COST_DETAIL"):  # where the hooks' time goes (nested: not summed)
        from trainguard.checkpoint import manager, pipeline
        from trainguard.integrations import common

        for c, name in ((common.StepBeat, "begin"), (common.StepBeat, "end"),
                        (common.SafeTelemetry, "log"), (manager.CheckpointManager, "maybe_save"),
                        (pipeline.SavePipeline, "save"),
                        (manager.CheckpointManager, "_start_agreement"),
                        (manager.CheckpointManager, "_save_agreed")):  # fmt: skip
            _wrap(fw, c, name, f"{getattr(c, '__name__', c)}.{name}")


def _sample_once() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        if not t.name.startswith(("tg-", "trainguard")) or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat", encoding="ascii") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        threads_cpu[t.native_id] = (t.name, (int(fields[11]) + int(fields[12])) / tick)


def _sample() -> None:
    while True:
        _sample_once()
        time.sleep(0.5)


def _report() -> None:
    n = steps["n"] - SKIP
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in threads_cpu.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - threads_cpu0.get(tid, (name, 0.0))[1]
    out = {
        "steps": n,
        "step_s": (steps["t1"] - steps["t0"]) / n if n > 0 else None,
        "hooks": {k: {"calls": int(v[0]), "cpu_s": v[1], "wall_s": v[2]} for k, v in acc.items()},
        "hooks_cpu_per_step_s": sum(v[1] for v in acc.values()) / n if n > 0 else None,
        "hooks_wall_per_step_s": sum(v[2] for v in acc.values()) / n if n > 0 else None,
        "threads_cpu_s": by_name,
        "detail": {
            k: {"calls": int(v[0]), "cpu_s": v[1], "wall_s": v[2]} for k, v in detail.items()
        },
    }
    with open(os.environ["HOOK_COST_OUT"], "w", encoding="utf-8") as f:
        json.dump(out, f)


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    fw = os.environ["HOOK_COST_FW"]
    if os.environ.get("RANK", "0") == "0":
        if fw == "lightning":
            # the example's import order (Lightning before trainguard's callback): importing
            # the callback first changes which libraries load first, and the step's speed
            import lightning.pytorch  # noqa: F401
        _patch(fw)
        threading.Thread(target=_sample, name="bench-sampler", daemon=True).start()
        atexit.register(_report)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
