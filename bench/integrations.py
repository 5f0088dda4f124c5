"""The framework integrations, per framework (HF Trainer, TRL GRPO, Lightning; the examples'
tiny models, 2 processes, gloo on CPU):

- overhead, by accounting (``bench/hook_cost.py`` runs the example under ``trainguard run``
  and times, on rank 0, the callback's per-step hooks and the CPU of trainguard's threads in
  the worker, after the first ``SETTLE_STEPS``): that time as a fraction of the rest of the
  step.
  ``<fw>_overhead``: with trainguard's default memory-tier cadence (its snapshots share a
  budget of 1 % of a step with the hooks' fixed cost), at batch sizes that make a step last
  70-140 ms here (``OVERHEAD_RUNS``: about a small model's step on a GPU);
  ``<fw>_overhead_small_steps``: the same at the examples' own batch sizes (steps of
  5-20 ms, where the hooks' fixed ~100-300 us alone is 1-3 %); ``<fw>_overhead_every_step``:
  a snapshot every step (the setting the kill runs use); ``<fw>_hook_us_per_step``: the
  first in microseconds. Counting every microsecond of the hooks as added to the step makes
  these upper bounds;
- the same as a comparison of whole runs, for reference (``<fw>_overhead_ab``): the steady
  time per step (the examples' ``steady:`` line: from the end of step 5 to the end of the
  last) with the callback vs the same script without it (``--no-trainguard``,
  ``[integrations] auto`` off), run in turn ``--repeats`` times, medians. On a shared
  2-core machine one such run varies by ±30 %, far more than 1 %;
- a kill -9 of rank 1 some steps after the framework's first checkpoint, under ``trainguard run``
  with the callback and under ``torchrun`` (same script, same callback: its step records give
  both launchers' step times): steps redone and time from the kill to the next completed step.

    python bench/integrations.py [--frameworks hf,trl,lightning] [--repeats 3] [--no-kills]

Prints a table, then one JSON line: ``<fw>_steps_redone``, ``<fw>_kill_to_next_step_s``,
``<fw>_torchrun_kill_to_next_step_s`` (null where torchrun's job failed or hung),
``<fw>_overhead`` (fraction of a step; ``<fw>_overhead_small_steps``,
``<fw>_overhead_every_step``, ``<fw>_hook_us_per_step``, ``<fw>_step_ms_with`` and
``<fw>_overhead_ab`` after them) for ``<fw>`` in hf, trl, lightning.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.core.events import read_events  # noqa: E402

SCRIPTS = {
    "hf": ("hf_trainer.py", 40, 10, 15),  # script, steps, save every, kill at
    "trl": ("trl_grpo.py", 14, 4, 7),
    "lightning": ("lightning_trainer.py", 60, 20, 30),
}
OVERHEAD_RUNS = {
    "hf": (200, ["--batch", "128"]),
    "trl": (100, []),
    "lightning": (300, ["--batch", "4096"]),
}
"""Steps and arguments of the overhead runs: batches that make a step last 70-140 ms on
this CPU, about as long as a small model's training step on a GPU (the kill runs use
``SCRIPTS``' counts, at the examples' own batch sizes)."""
SMALL_STEPS = {"hf": 400, "lightning": 1000}
"""Steps of the one overhead run at the examples' own batch sizes (steps of 5-20 ms), for
``<fw>_overhead_small_steps`` (TRL's own steps are the overhead runs' already)."""
TIMEOUT_S = 420
KILL_TIMEOUT_S = 150
"""A kill run still going after this is reported as hung (they take 30-90 s when they end)."""
SETTLE_STEPS = 40
"""Steps left out of the accounting: the memory tier's cadence measures a window of 32 steps
before it settles on an interval."""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
    )
    env.update(extra)
    return env


def _launch(
    launcher: str,
    work: Path,
    script: str,
    args: list[str],
    env: dict[str, str],
    account: bool = False,
    timeout_s: float = TIMEOUT_S,
) -> Any:
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3"]
    if launcher == "trainguard":
        cmd = [
            sys.executable,
            "-m",
            "trainguard",
            "run",
            *common,
            "--tg-run-dir",
            str(work / "run"),
        ]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *common]
    if account:  # the example run by bench/hook_cost.py, which times the callback's hooks
        cmd.append(str(REPO / "bench" / "hook_cost.py"))
        env = {**env, "HOOK_COST_OUT": str(work / "hook_cost.json"),
               "HOOK_COST_SKIP": str(SETTLE_STEPS),
               "HOOK_COST_FW": "lightning" if script.startswith("lightning") else "hf"}  # fmt: skip
    cmd += [str(REPO / "examples" / script), "--output-dir", str(work / "out"), *args]
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # the launcher and its workers (torchrun starts them in sessions of their own; a hung
        # job's workers outlive a killed launcher and hold its output open), by PID
        _kill_tree(proc.pid)
        proc.communicate()
        return None
    finally:
        _kill_tree(proc.pid)  # nothing of it outlives the run
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant of ``pid`` (found through
    ``/proc`` before any is killed: an orphan is re-parented and lost)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="ascii", errors="replace") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def _steady_s(p: Any) -> float | None:
    """Seconds per step after the first five (the example's ``steady:`` line)."""
    m = (
        re.search(r"steady: (\d+) steps in ([\d.]+) s", (p.stdout or "") + (p.stderr or ""))
        if p
        else None
    )
    return float(m.group(2)) / int(m.group(1)) if m else None


INTEGRATION_THREADS = ("tg-ckpt-stage", "tg-metrics-flush")
"""Worker threads that run for the callback (the heartbeat and collectives watchers run in
every worker under ``trainguard run``, with or without it)."""


def _hook_cost(work: Path) -> tuple[float, float, float] | None:
    """(fraction of a step, microseconds per step, seconds per step) the callback took on
    rank 0: its hooks' wall time plus its threads' CPU time, against the step without them."""
    try:
        d = json.loads((work / "hook_cost.json").read_text())
    except (OSError, ValueError):
        return None
    n, step_s, hooks = d.get("steps"), d.get("step_s"), d.get("hooks_wall_per_step_s")
    if not n or not step_s or hooks is None:
        return None
    threads = sum(
        cpu for name, cpu in d.get("threads_cpu_s", {}).items()
        if name.startswith(INTEGRATION_THREADS)
    ) / n  # fmt: skip
    spent = hooks + threads
    return spent / (step_s - spent), spent * 1e6, step_s


def _steps(run: Path, rank: int) -> list[dict[str, Any]]:
    path = run / "metrics" / f"rank_{rank}.jsonl"
    if not path.exists():
        return []
    recs = (json.loads(x) for x in path.read_text().splitlines() if x.strip())
    return [r for r in recs if r.get("kind") == "step"]


def _kill_to_next(run: Path, kill_at: int) -> float | None:
    """The killed rank's last step record of attempt 0 (its kill comes at the next step's
    begin) → the first step completed by any rank in a later attempt."""
    before = [r["time"] for r in _steps(run, 1) if r.get("attempt") == 0]
    after = [r["time"] for rank in (0, 1) for r in _steps(run, rank) if r.get("attempt", 0) > 0]
    if not before or not after:
        return None
    return round(min(after) - max(before), 2)


def _redone(run: Path, kill_at: int) -> int | None:
    """Steps run again: the kill came at ``kill_at`` steps done; the first step of the restarted
    attempt is the step it resumed from."""
    after = [r["step"] for rank in (0, 1) for r in _steps(run, rank) if r.get("attempt", 0) > 0]
    return kill_at - min(after) if after else None


EVERY_STEP = {"TRAINGUARD_CHECKPOINT_MEMORY_MAX_STALL_FRACTION": "0"}
"""A memory-tier snapshot every step, whatever it stalls (the kill runs: ≤ 1 step redone)."""


def bench(fw: str, root: Path, repeats: int = 3, kills: bool = True) -> dict[str, Any]:
    script, steps, save, kill_at = SCRIPTS[fw]
    out: dict[str, Any] = {}
    n, size = OVERHEAD_RUNS[fw]
    base = ["--steps", str(n), "--save-steps", str(n * 10), *size]
    variants = (
        ("without", ["--no-trainguard"], _env(TRAINGUARD_INTEGRATIONS_AUTO="false")),
        ("with", [], _env()),
        ("with_every_step", [], _env(**EVERY_STEP)),
    )
    t: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    cost: dict[str, list[tuple[float, float, float]]] = {"with": [], "with_every_step": []}
    for i in range(repeats):  # in turn, so that a slow phase of the machine hits all three
        for name, extra, env in variants:
            work = root / f"{fw}-{name}-{i}"
            work.mkdir()
            p = _launch("trainguard", work, script, base + extra, env, account=name != "without")
            s = _steady_s(p)
            if s is not None:
                t[name].append(s)
            if name in cost and (c := _hook_cost(work)) is not None:
                cost[name].append(c)
    med = {name: statistics.median(xs) if xs else None for name, xs in t.items()}
    out["step_ms"] = {name: [round(x * 1000, 2) for x in xs] for name, xs in t.items()}
    a, b = med["with"], med["without"]
    out["overhead_ab"] = round((a - b) / b, 4) if a and b else None
    for name, key in (("with", "overhead"), ("with_every_step", "overhead_every_step")):
        out[key] = round(statistics.median(c[0] for c in cost[name]), 4) if cost[name] else None
    out["hook_us_per_step"] = (
        round(statistics.median(c[1] for c in cost["with"]), 1) if cost["with"] else None
    )
    out["hook_cost_runs"] = {k: [(round(f, 4), round(us, 1)) for f, us, _ in v]
                             for k, v in cost.items()}  # fmt: skip
    small = SMALL_STEPS.get(fw)
    if small is None:
        out["overhead_small_steps"] = out["overhead"]
    else:
        work = root / f"{fw}-small"
        work.mkdir()
        args = ["--steps", str(small), "--save-steps", str(small * 10)]
        _launch("trainguard", work, script, args, _env(), account=True)
        c = _hook_cost(work)
        out["overhead_small_steps"] = round(c[0], 4) if c else None
        out["small_step_ms"] = round(c[2] * 1000, 2) if c else None
    out["step_ms_with"] = round(med["with"] * 1000, 2) if med["with"] else None
    if not kills:
        return out
    kill = ["--steps", str(steps), "--save-steps", str(save), "--fail-at-step", str(kill_at)]
    for launcher in ("trainguard", "torchrun"):
        work = root / f"{fw}-kill-{launcher}"
        work.mkdir()
        env = _env(TRAINGUARD_RUNTIME_RUN_DIR=str(work / "run"), **EVERY_STEP)
        p = _launch(launcher, work, script, kill, env, timeout_s=KILL_TIMEOUT_S)
        ok = p is not None and p.returncode == 0
        run = work / "run"
        key = "" if launcher == "trainguard" else "torchrun_"
        out[f"{key}rc"] = "hung" if p is None else p.returncode
        out[f"{key}kill_to_next_step_s"] = _kill_to_next(run, kill_at) if ok else None
        out[f"{key}steps_redone"] = _redone(run, kill_at) if ok else None
        if launcher == "trainguard" and ok:
            restored = [e for e in read_events(run) if e.get("kind") == "checkpoint_restored"]
            out["restored"] = [(e.get("source"), e.get("step")) for e in restored]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frameworks", default="hf,trl,lightning")
    ap.add_argument("--repeats", type=int, default=3, help="overhead runs per variant")
    ap.add_argument("--no-kills", action="store_true", help="the overhead runs only")
    args = ap.parse_args()
    summary: dict[str, Any] = {}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tg-bench-integrations-") as tmp:
        for fw in args.frameworks.split(","):
            r = results[fw] = bench(fw, Path(tmp), args.repeats, not args.no_kills)
            print(f"{fw}: {json.dumps(r)}", flush=True)
            summary[f"{fw}_steps_redone"] = r.get("steps_redone")
            summary[f"{fw}_kill_to_next_step_s"] = r.get("kill_to_next_step_s")
            summary[f"{fw}_torchrun_kill_to_next_step_s"] = r.get("torchrun_kill_to_next_step_s")
            summary[f"{fw}_torchrun_steps_redone"] = r.get("torchrun_steps_redone")
            summary[f"{fw}_overhead"] = r.get("overhead")
        for fw in args.frameworks.split(","):
            for key in ("overhead_small_steps", "overhead_every_step", "hook_us_per_step",
                        "step_ms_with", "overhead_ab"):  # fmt: skip
                summary[f"{fw}_{key}"] = results[fw].get(key)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
