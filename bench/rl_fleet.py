"""RL with a rollout fleet under faults: examples/rl_fleet.py (2 trainer ranks under gloo)
with 2 embedded engines, each fault kind in its own run, all kinds in one run, and an ETTR run
with faults arriving at random against the same run without faults.

    python bench/rl_fleet.py                 # the scenarios + two 300 s ETTR runs (~20 min)
    python bench/rl_fleet.py --ettr-s 120    # shorter ETTR runs

Faults (real): ``engine_kill`` (kill -9 an engine mid-generation), ``engine_freeze``
(SIGSTOP), ``engine_500`` (the engine answers HTTP 500 to its next requests),
``trainer_rank_kill`` (kill -9 one trainer rank), ``trainer_group_kill`` (kill -9 every rank).
The job is one ``trainguard run`` with a ``rollout`` role (``--tg-role
rollout=2,standby=1:python -m trainguard.rl.engine``): the node agent's role supervisor
restarts a dead engine (exited, refusing connections, or without a good health answer for
``[roles] dead_after_s``) by promoting the role's warm standby (loaded, out of routing,
started at low CPU priority) and starts a new standby behind it.

Figures: ``fabricated_samples`` (samples trained minus real generations, from the trainer's
logs), ``prompts_skipped``/``prompts_duplicated`` (the consumed-prompt audit of every run),
``engine_kill_step_delay_s`` (the step an engine died in minus the run's median step),
``engine_rejoin_s`` (kill → replacement serving the current weight version),
``engine_restarts_on_trainer_kill``, ``trainer_kill_to_next_update_s`` (kill → the next
completed step), ``weight_sync_s`` (median push time, fault-free run), ``rl_ettr_failures`` /
``rl_ettr_fault_free`` (steps kept at the end of the window × the fault-free median step /
``--ettr-s``, the window counted from the run's first completed step),
``replay_bitwise_equal`` (a run of ``--replay-steps`` with ``--replay-faults`` random faults,
every kind at least once, ends with the final weights of the fault-free run with the same
seed, compared tensor by tensor; ``replay_tensors_differing`` counts the others). The
trainer's warm processes preload transformers (``[warm] preload``). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.core.config.warm import WarmConfig  # noqa: E402
from trainguard.core.rundir import RunDir  # noqa: E402
from trainguard.rl import ConsumedLog, PromptLedger, audit  # noqa: E402
from trainguard.rl.local import engine_health  # noqa: E402

KINDS = ("engine_kill", "engine_freeze", "engine_500", "trainer_rank_kill", "trainer_group_kill")
PROMPTS, BATCH = 64, 16
WARM_PRELOAD = [
    *WarmConfig().preload,
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.tokenization_utils_fast",
    "trainguard.rl",
]
"""A restarted trainer rank starts from a warm process that already imported what the example
uses (``[warm] preload``): transformers' GPT-2 is most of a cold worker's start-up."""


ENGINE = [sys.executable, "-m", "trainguard.rl.engine", "--enable-fault-injection",
          "--poll-interval-s", "0.3"]  # fmt: skip


class Fleet:
    """The job's ``rollout`` role as the launcher runs it (2 replicas and ``standby`` warm
    standbys), seen from the run directory: the replicas' state files and the supervisor's
    events. Measures fault → replacement serving (an engine reports ``serving`` only once it
    holds the weight store's current version)."""

    def __init__(self, run_dir: Path) -> None:
        self.rundir = RunDir(run_dir)
        self.run_dir = run_dir
        self.faults: list[tuple[int, int, float, str]] = []
        """(replica, its pid at the fault, time, kind) of each engine death injected"""

    def states(self) -> list[dict[str, Any]]:
        return self.rundir.role_states().get("rollout", [])

    def port(self, i: int) -> int:
        return int(self.states()[i]["port"])

    def pid(self, i: int) -> int:
        return int(self.states()[i]["pid"])

    def died(self, i: int, kind: str) -> None:
        self.faults.append((i, self.pid(i), time.time(), kind))

    def rejoin_s(self) -> list[tuple[str, float]]:
        """(fault kind, seconds from the fault to the replacement's first ``serving``)"""
        serving = [
            e
            for e in _events(self.run_dir, "role_replica_state")
            if e.get("role") == "rollout" and e.get("state") == "serving"
        ]
        out = []
        for i, pid, t, kind in self.faults:
            later = [
                e["time"]
                for e in serving
                if e["replica"] == i and e["pid"] != pid and e["time"] > t
            ]
            if later:
                out.append((kind, min(later) - t))
        return out

    def pending(self) -> bool:
        return len(self.rejoin_s()) < len(self.faults)

    @property
    def restarts(self) -> int:
        return len(_events(self.run_dir, "role_replica_failed"))


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # already replaced
        pass


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    path = run_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("kind") == kind:
                out.append(ev)
    return out


def _records(run_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = run_dir / "metrics" / f"rank_{rank}.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


class Run:
    def __init__(
        self,
        root: Path,
        name: str,
        *,
        steps: int,
        engines: int = 2,
        standby: int = 1,
        seed: int = 0,
    ) -> None:
        self.name = name
        self.seed = seed
        self.run_dir = root / name
        self.run_dir.mkdir(parents=True)
        self.sup = Fleet(self.run_dir)
        self.log = ConsumedLog(self.run_dir / "rl" / "consumed.jsonl")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_", "PET_"))
        }
        env.update(
            TRAINGUARD_ROLES_PROBE_INTERVAL_S="0.5",
            TRAINGUARD_WARM_PRELOAD=",".join(WARM_PRELOAD),
            TRAINGUARD_CHECKPOINT_MEMORY_MAX_STALL_FRACTION="0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        self.t_launch = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "100", "--tg-run-dir", str(self.run_dir), "--tg-role",
             f"rollout={engines},standby={standby},budget=1000:{shlex.join(ENGINE)}",
             str(REPO / "examples" / "rl_fleet.py"), "--steps", str(steps), "--prompts",
             str(PROMPTS), "--batch", str(BATCH), "--group", "8", "--max-tokens", "16",
             "--request-timeout", "20", "--seed", str(seed)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.run_dir / "launcher.err", "wb"),  # noqa: SIM115
        )  # fmt: skip
        self.faults: list[tuple[str, float, int]] = []  # kind, time, attempt at the fault
        self.window_steps = 0

    def step(self) -> int:
        return max(self.log.effective(), default=-1)

    def wait_step(self, step: int, timeout: float = 600) -> bool:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def inject(self, kind: str, rng: random.Random) -> None:
        started = _events(self.run_dir, "workers_started")
        attempt = started[-1]["attempt"] if started else 0
        states = self.sup.states()
        serving = [s["replica"] for s in states if s["state"] == "serving"]
        i = rng.choice(serving) if serving else rng.randrange(len(states))
        now = time.time()
        if kind == "engine_kill":  # mid-generation: once it has a request in flight
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                h = engine_health(self.sup.port(i), timeout=1.0)
                if h is not None and h.get("inflight"):
                    break
                time.sleep(0.02)
            now = time.time()
            self.sup.died(i, kind)
            _signal(self.sup.pid(i), signal.SIGKILL)
        elif kind == "engine_freeze":
            self.sup.died(i, kind)
            _signal(self.sup.pid(i), signal.SIGSTOP)
        elif kind == "engine_500":
            import http.client

            c = http.client.HTTPConnection("127.0.0.1", self.sup.port(i), timeout=5)
            try:
                c.request("POST", "/v1/faults", body=json.dumps({"kind": "http_500", "count": 4}))
                c.getresponse().read()
            except OSError:
                pass
            finally:
                c.close()
        else:
            workers = started[-1]["workers"] if started else []
            if kind == "trainer_rank_kill":
                rank = rng.randrange(2)
                workers = [w for w in workers if w["rank"] == rank]
            for w in workers:
                try:
                    os.kill(w["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.faults.append((kind, now, attempt))
        print(f"  [{self.name}] {kind} at step {self.step()}", flush=True)

    def finish(self, timeout: float = 900) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # -- figures -------------------------------------------------------------------------------
    def steps(self) -> list[dict[str, Any]]:
        return [
            r for r in _records(self.run_dir) if r.get("kind") == "step" and not r.get("failed")
        ]

    def median_step(self) -> float:
        times = [r["step_time_s"] for r in self.steps()[1:]]
        return statistics.median(times) if times else float("nan")

    def audit(self) -> dict[str, Any]:
        a = audit(self.log, PROMPTS)
        fault_free = [PromptLedger(PROMPTS, seed=self.seed).prompt_id(g) for g in range(a.trained)]
        logs = [
            r
            for r in _records(self.run_dir) + _records(self.run_dir, 1)
            if r.get("kind") == "log" and "samples_trained" in r
        ]
        trained = sum(r["samples_trained"] for r in logs)
        real = sum(r["samples_real"] for r in logs)
        return {"steps": a.steps, "skipped": a.skipped, "duplicated": a.duplicated,
                "same_order": a.sequence == fault_free, "fabricated": trained - real}  # fmt: skip

    def step_delay(self, kind: str) -> list[float]:
        med = self.median_step()
        out = []
        for k, t, _ in self.faults:
            if k != kind:
                continue
            for r in self.steps():
                if r["time"] - r["step_time_s"] <= t <= r["time"]:
                    out.append(r["step_time_s"] - med)
        return out

    def kill_to_update(self) -> list[float]:
        out = []
        for k, t, attempt in self.faults:
            if k.startswith("trainer"):
                nxt = [
                    r["time"]
                    for r in self.steps()
                    if r["time"] > t and r.get("attempt", 0) > attempt
                ]
                if nxt:
                    out.append(min(nxt) - t)
        return out


def scenario(root: Path, kinds: list[str], *, steps: int, seed: int) -> Run:
    """One run with ``kinds`` injected in turn, each once the previous one has been recovered
    from (an engine back and serving, four more steps); stopped ``steps`` steps after the last."""
    run = Run(root, "+".join(kinds) or "fault_free", steps=100000)
    rng = random.Random(seed)
    at = 4
    for kind in kinds:
        if not run.wait_step(at):
            break
        run.inject(kind, rng)
        deadline = time.monotonic() + 180
        while run.sup.pending() and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.2)  # the engine fault is recovered (replacement serving)
        at = run.step() + 4
    run.wait_step(max(at, steps))
    run.stop()
    print(f"  [{run.name}] {run.audit()}", flush=True)
    return run


def ettr_run(root: Path, name: str, duration_s: float, mtbf_s: float | None, seed: int) -> Run:
    """A run of ``duration_s`` counted from its first completed step (the start-up, the same
    with or without faults, is left out), faults every ``mtbf_s`` on average (exponential),
    the kinds in an even shuffled mix. ``run.window_steps``: steps kept in the window."""
    run = Run(root, name, steps=100000)
    rng = random.Random(seed)
    kinds: list[str] = []  # evenly mixed: each round of five has every kind once, shuffled
    for _ in range(100):
        block = list(KINDS)
        rng.shuffle(block)
        kinds.extend(block)
    kinds.reverse()  # popped from the end
    run.wait_step(0)
    start_steps = run.step() + 1
    t0 = time.time()
    t_end = t0 + duration_s
    nxt = t0 + rng.expovariate(1 / mtbf_s) if mtbf_s else t_end * 2
    while time.time() < t_end and run.proc.poll() is None:
        if time.time() >= nxt:
            run.inject(kinds.pop(), rng)
            nxt = time.time() + rng.expovariate(1 / mtbf_s) if mtbf_s else t_end * 2
        time.sleep(0.2)
    run.window_steps = run.step() + 1 - start_steps  # kept at the end of the window
    run.stop()
    return run


def replay_runs(root: Path, *, steps: int, faults: int, seed: int) -> dict[str, Any]:
    """The fault-free run and a run with ``faults`` random faults (every kind at least once,
    in a shuffled order, at random steps), both ``--steps steps`` with the same run seed,
    each to its end; their final weights (the weight store's version ``steps``) compared
    tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    rng = random.Random(seed)
    kinds = list(KINDS) * (faults // len(KINDS) + 1)
    rng.shuffle(kinds)
    kinds = kinds[: max(faults, len(KINDS))]
    if set(kinds) != set(KINDS):
        kinds = [*KINDS, *kinds[len(KINDS) :]]
        rng.shuffle(kinds)
    at = sorted(rng.sample(range(2, steps - 2), len(kinds)))
    finals = {}
    for name, plan in (
        ("replay_fault_free", []),
        ("replay_faults", list(zip(at, kinds, strict=True))),
    ):
        run = Run(root, name, steps=steps, seed=seed)
        for step, kind in plan:
            if not run.wait_step(max(step, run.step() + 1)):
                break
            run.inject(kind, rng)
        rc = run.finish(timeout=1800)
        path = run.run_dir / "rl" / "weights" / f"v{steps:08d}.safetensors"
        finals[name] = load_file(str(path)) if rc == 0 and path.exists() else None
        print(f"  [{name}] rc {rc}, {len(run.faults)} faults, {run.audit()}", flush=True)
    a, b = finals["replay_fault_free"], finals["replay_faults"]
    differ = (
        None
        if a is None or b is None
        else [
            k
            for k in sorted(set(a) | set(b))
            if k not in a or k not in b or not torch.equal(a[k], b[k])
        ]
    )
    return {
        "replay_bitwise_equal": differ == [],
        "replay_tensors_differing": None if differ is None else len(differ),
        "replay_faults": len(kinds),
        "replay_steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="steps of each scenario run")
    p.add_argument("--ettr-s", type=float, default=300.0)
    p.add_argument("--mtbf-s", type=float, default=30.0)
    p.add_argument("--only", default=None, help="comma-separated scenarios (debugging)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay-steps", type=int, default=40, help="0: no replay runs")
    p.add_argument("--replay-faults", type=int, default=6)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-fleet-bench-"))
    print(f"runs in {root}", flush=True)
    plan = [[], *[[k] for k in KINDS], list(KINDS)]
    if args.only:
        wanted = args.only.split(",")
        plan = [k for k in plan if "+".join(k) in wanted or (not k and "fault_free" in wanted)]
    runs = [
        scenario(root, kinds, steps=args.steps, seed=args.seed + i) for i, kinds in enumerate(plan)
    ]
    ettr: dict[str, Run] = {}
    if args.ettr_s > 0:
        ettr["fault_free"] = ettr_run(root, "ettr_fault_free", args.ettr_s, None, args.seed)
        ettr["failures"] = ettr_run(root, "ettr_failures", args.ettr_s, args.mtbf_s, args.seed)
    audits = {r.name: r.audit() for r in [*runs, *ettr.values()]}
    by = {r.name: r for r in runs}
    free = by.get("fault_free")
    kill_runs = [r for r in runs if any(k.startswith("trainer") for k, _, _ in r.faults)]
    engine_kill = [d for r in runs for d in r.step_delay("engine_kill")]
    rejoin = [s for r in runs for k, s in r.sup.rejoin_s() if k == "engine_kill"]
    freeze_rejoin = [s for r in runs for k, s in r.sup.rejoin_s() if k == "engine_freeze"]
    freeze_delay = [d for r in runs for d in r.step_delay("engine_freeze")]
    to_update = [s for r in kill_runs for s in r.kill_to_update()]
    pure_trainer = [r for r in kill_runs if all(k.startswith("trainer") for k, _, _ in r.faults)]
    syncs = (
        [
            x["weight_sync_s"]
            for x in _records(free.run_dir)
            if x.get("kind") == "log" and "weight_sync_s" in x
        ]
        if free
        else []
    )
    out: dict[str, Any] = {
        "fabricated_samples": sum(a["fabricated"] for a in audits.values()),
        "prompts_skipped": sum(a["skipped"] for a in audits.values()),
        "prompts_duplicated": sum(a["duplicated"] for a in audits.values()),
        "sync_order_equal_fault_free": all(a["same_order"] for a in audits.values()),
        "median_step_s": round(free.median_step(), 4) if free else None,
        "engine_kill_step_delay_s": round(statistics.median(engine_kill), 3)
        if engine_kill
        else None,
        "engine_rejoin_s": round(statistics.median(rejoin), 3) if rejoin else None,
        "engine_freeze_rejoin_s": round(statistics.median(freeze_rejoin), 3)
        if freeze_rejoin
        else None,
        "engine_freeze_step_delay_s": round(statistics.median(freeze_delay), 3)
        if freeze_delay
        else None,
        "engine_restarts_on_trainer_kill": sum(r.sup.restarts for r in pure_trainer),
        "trainer_kill_to_next_update_s": round(statistics.median(to_update), 3)
        if to_update
        else None,
        "weight_sync_s": round(statistics.median(syncs), 4) if syncs else None,
    }
    print(
        "\nrun                             steps  skipped  dup  same-order  fabricated  faults",
        flush=True,
    )
    for r in [*runs, *ettr.values()]:
        a = audits[r.name]
        print(
            f"{r.name[:30]:30s} {a['steps']:6d} {a['skipped']:8d} {a['duplicated']:4d} {a['same_order']!s:>11s} {a['fabricated']:11d}  {len(r.faults)}"
        )
    if ettr:
        med = ettr["fault_free"].median_step()
        for key, r in (
            ("rl_ettr_fault_free", ettr["fault_free"]),
            ("rl_ettr_failures", ettr["failures"]),
        ):
            out[key] = round(r.window_steps * med / args.ettr_s, 4)
        out["rl_ettr_ratio"] = (
            round(out["rl_ettr_failures"] / out["rl_ettr_fault_free"], 4)
            if out["rl_ettr_fault_free"]
            else None
        )
        out["ettr_run_s"] = args.ettr_s
        out["ettr_faults"] = len(ettr["failures"].faults)
    if args.replay_steps > 0:
        out.update(
            replay_runs(root, steps=args.replay_steps, faults=args.replay_faults, seed=args.seed)
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
