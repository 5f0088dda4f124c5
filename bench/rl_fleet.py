"""RL with a rollout fleet under faults: examples/rl_fleet.py (2 trainer ranks under gloo)
with 2 embedded engines, each fault kind in its own run, all kinds in one run, and an ETTR run
with faults arriving at random against the same run without faults.

    python bench/rl_fleet.py                 # the scenarios + two 300 s ETTR runs (~20 min)
    python bench/rl_fleet.py --ettr-s 120    # shorter ETTR runs
    TRAINGUARD_VLLM_PYTHON=.venv-vllm/bin/python python bench/rl_fleet.py --engine vllm

``--engine vllm`` measures the same keys on vLLM engines (``python -m
trainguard.rl.engines.vllm``, the tiny Llama, ``make engines``) first, then the embedded
engine's, and prints vLLM's figures with the embedded engine's beside them (``embedded``) in
its one JSON line. A vLLM engine takes minutes to start on 2 cores, so vLLM's scenarios share
two jobs of 2 engines and a warm standby each (:func:`vllm_run`): a fault-free one (the
``fault_free`` scenario and ``rl_ettr_fault_free``) and one with faults of every kind at random
(``--vllm-mtbf-s``; the per-kind scenarios and ``rl_ettr_failures``; an engine kill or freeze
waits for the standby to be loaded). Both have the same run seed: ``replay_samples_equal``
says whether every step both trained had the same samples (prompt ids and token ids, per
rank; ``replay_samples_differing`` lists the (rank, step) that did not). Then the refit drill
of ``bench/vllm_refits.py`` (``--refits`` refits under kill -9, SIGSTOP, HTTP 500 mid-update
and truncated files: ``refit_s``, ``stale_served``, ``engine_ready_s`` cold and from a
standby).

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
seed, compared tensor by tensor; ``replay_tensors_differing`` counts the others), ``auth_overhead``
(a rollout request of the runs' size, 4 prompts x 8 completions x 16 tokens, to the same
engine process through a server that checks the job's signature and one that does not, in
pairs: the median over rounds of the pairs' median CPU-time difference over the CPU time;
``auth_overhead_wall`` the same with wall times;
``auth_cpu_fraction`` the CPU time of signing and checking one request and its answer over
that latency). The trainer's warm processes preload transformers (``[warm] preload``). Ends
with one JSON line.

    python bench/rl_fleet.py --auth-only     # only the authentication figures (~1 min)

``router_client_errors``: a client looping on the fleet endpoint (``python -m
trainguard.rl.router``) in front of 3 engines while 5 of them in turn are killed -9 and
restarted: requests without a valid answer (0 expected), with ``router_requests`` answered
and ``router_retries`` the endpoint's retries on another engine (bench/rl_fleet_scale.py,
which also measures the fleet at 8 to 64 engines).

    python bench/rl_fleet.py --router-only   # only the endpoint figures (~1 min)

``--engine vllm --vllm-only`` measures vLLM's figures (and the endpoint's) without the embedded
engine's beside them.

Weight sync through an engine's death (``refit_engine_death``: ``--refit-death-runs`` runs of
bench/refit_drill.py, 3 engine processes, each run kill -9 and SIGSTOP of one engine at 10,
50 and 90 % of its load of the version pushed): ``refit_engine_death_trainer_wait_s`` (the
trainer's sync call, median of the frozen cases, which wait the timeout out; the worst case
beside it) against ``refit_engine_death_sync_timeout_s``, ``refit_engine_death_runs_ok``
(runs where every case returned within the timeout, the others confirmed and the victim
served the version again). ``back_to_back_engine_deaths_rejoin_s``: a run with a pool of 2
standbys, ``--b2b-pairs`` times replica 0 and, 2 s later, replica 1 killed -9: the second
death's kill → replacement serving, median. ``standby_false_ready``: promotions of a standby
whose own log had not said ``standby ready`` before the promotion event, over every run.
``groups_padded``: each rank's record of the groups it trained (``rollout_samples_trained``)
against the rows its log says it trained, over every run. ``max_staleness_after_resume``: an
async run (``--max-staleness 1``) through ``--async-kills`` trainer kills, the largest
recorded staleness of a sample trained after a kill (``staleness_histogram``: all samples).

    python bench/rl_fleet.py --refit-only    # only these figures (~15 min)

Role nodes that fail alone (bench/role_nodes.py, ``--role-node-runs`` runs): a job whose
rollout role runs on 2 role nodes with 2 spares (each its own ``trainguard slurm roles`` agent
on loopback), each run the agents of both role nodes killed -9 in turn:
``role_node_loss_step_delay_s`` (the step the loss fell in minus the median step; target <= 2
median steps) and ``role_node_replaced_s`` (kill → the replica serving on a spare; <= 30).

    python bench/rl_fleet.py --role-nodes-only   # only these figures (~3 min a run)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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

from bench.rl_fleet_scale import router_client_errors  # noqa: E402
from trainguard.core.config.warm import WarmConfig  # noqa: E402
from trainguard.core.contracts.engine import probe_health  # noqa: E402
from trainguard.core.contracts.envvars import VLLM_PYTHON  # noqa: E402
from trainguard.core.contracts.rundir import RunDir  # noqa: E402
from trainguard.core.fleetauth import (  # noqa: E402
    load_secret_file,
    role_token,
    secret_path,
    sign,
)
from trainguard.rl import ConsumedLog, PromptLedger, audit  # noqa: E402
from trainguard.rl.engines.launch import adapter_command  # noqa: E402

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
VLLM_ENGINE = adapter_command("--enable-fault-injection", "--poll-interval-s", "0.3")


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

    def token(self) -> str:
        """The job's rollout token (the agent wrote the job secret into the run directory)."""
        return role_token(load_secret_file(secret_path(self.run_dir)), "rollout")

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
        engine: str = "embedded",
        seed: int = 0,
        extra: tuple[str, ...] = (),
        role_opts: str = "",
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
        command, model, ready = ENGINE, [], ""
        if engine == "vllm":
            command, model, ready = VLLM_ENGINE, ["--model", "tiny-llama"], ",ready=1800"
            model += ["--serving-timeout", "1800"]
            env[VLLM_PYTHON] = os.environ.get(VLLM_PYTHON) or str(REPO / ".venv-vllm/bin/python")
            env["TRAINGUARD_WARM_PRELOAD"] += ",transformers.models.llama.modeling_llama"
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.t_launch = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "100", "--tg-run-dir", str(self.run_dir), "--tg-role",
             f"rollout={engines},standby={standby},budget=1000{ready}{role_opts}:"
             f"{shlex.join(command)}",
             str(REPO / "examples" / "rl_fleet.py"), *model, "--steps", str(steps), "--prompts",
             str(PROMPTS), "--batch", str(BATCH), "--group", "8", "--max-tokens", "16",
             "--request-timeout", "20", "--seed", str(seed), *extra],
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
                h = probe_health(self.sup.port(i), timeout=1.0, token=self.sup.token()).health
                if h is not None and h.inflight:
                    break
                time.sleep(0.02)
            now = time.time()
            self.sup.died(i, kind)
            _signal(self.sup.pid(i), signal.SIGKILL)
        elif kind == "engine_freeze":
            self.sup.died(i, kind)
            _signal(self.sup.pid(i), signal.SIGSTOP)
        elif kind == "engine_500":
            from trainguard.chaos.ops import ChaosTargetError, engine_fault

            try:  # as `trainguard chaos engine-fault` does
                engine_fault(self.sup.run_dir, "rollout", i, "http_500", 4, port=self.sup.port(i))
            except ChaosTargetError:
                pass  # the engine died meanwhile
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


def scenario(root: Path, kinds: list[str], *, steps: int, seed: int, engine: str) -> Run:
    """One run with ``kinds`` injected in turn, each once the previous one has been recovered
    from (an engine back and serving, four more steps); stopped ``steps`` steps after the last."""
    run = Run(root, "+".join(kinds) or "fault_free", steps=100000, engine=engine)
    rng = random.Random(seed)
    at = 4
    for kind in kinds:
        if not run.wait_step(at):
            break
        run.inject(kind, rng)
        deadline = time.monotonic() + (180 if engine == "embedded" else 1800)
        while run.sup.pending() and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.2)  # the engine fault is recovered (replacement serving)
        at = run.step() + 4
    run.wait_step(max(at, steps))
    run.stop()
    print(f"  [{run.name}] {run.audit()}", flush=True)
    return run


def ettr_run(
    root: Path, name: str, duration_s: float, mtbf_s: float | None, seed: int, engine: str
) -> Run:
    """A run of ``duration_s`` counted from its first completed step (the start-up, the same
    with or without faults, is left out), faults every ``mtbf_s`` on average (exponential),
    the kinds in an even shuffled mix. ``run.window_steps``: steps kept in the window."""
    run = Run(root, name, steps=100000, engine=engine)
    rng = random.Random(seed)
    kinds: list[str] = []  # evenly mixed: each round of five has every kind once, shuffled
    for _ in range(100):
        block = list(KINDS)
        rng.shuffle(block)
        kinds.extend(block)
    kinds.reverse()  # popped from the end
    run.wait_step(0, timeout=600 if engine == "embedded" else 3600)
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


# -- deaths mid-refit and back to back, group integrity, staleness across resumes --------------

REFIT_SYNC_TIMEOUT_S = 3.0
REFIT_CASES = [(k, f) for k in ("kill", "stop") for f in (0.1, 0.5, 0.9)]
GROUP = 8
"""``--group`` of the runs above (``Run``)."""


def refit_engine_death(root: Path, runs: int) -> dict[str, Any]:
    """``runs`` runs of the refit drill (bench/refit_drill.py: 3 engine processes, each load of
    a version 0.4 s, the client's sync timeout ``REFIT_SYNC_TIMEOUT_S``), each run every case
    of :data:`REFIT_CASES` (kill -9 or SIGSTOP of one engine once it loaded 10, 50 or 90 % of
    the version pushed). A run is good when in every case the trainer's sync call returned
    within the sync timeout, the other engines confirmed the version and the victim served it
    again. ``refit_engine_death_trainer_wait_s``: the median over the frozen cases (those wait
    the timeout out; a killed engine fails its request at once), the worst of all cases
    beside it."""
    from bench.refit_drill import RefitDrill

    drill = RefitDrill(root / "refit-death", engines=3, sync_timeout_s=REFIT_SYNC_TIMEOUT_S)
    waits: dict[str, list[float]] = {"kill": [], "stop": []}
    rejoin: dict[str, list[float]] = {"kill": [], "stop": []}
    good, failures = 0, []
    try:
        for r in range(runs):
            ok = True
            for i, (kind, frac) in enumerate(REFIT_CASES):
                try:
                    got = drill.case(kind, frac, victim=(r + i) % 3)
                except Exception as e:  # a failed case, never the end of the bench
                    ok = False
                    failures.append(f"run {r} {kind}@{frac}: {type(e).__name__}: {e}")
                    continue
                waits[kind].append(got["wait_s"])
                rejoin[kind].append(got["rejoin_s"])
                case_ok = (got["wait_s"] <= got["timeout_s"] and got["others_confirmed"]
                           and not got["victim_confirmed"] and got["all_at_version"])  # fmt: skip
                if not case_ok:
                    failures.append(f"run {r} {kind}@{frac}: {got}")
                ok &= case_ok
            good += ok
            print(f"  [refit-death] run {r}: {'ok' if ok else 'FAILED'}", flush=True)
    finally:
        drill.close()
    every = waits["kill"] + waits["stop"]
    return {
        "refit_engine_death_trainer_wait_s": round(statistics.median(waits["stop"]), 3)
        if waits["stop"]
        else None,
        "refit_engine_death_trainer_wait_max_s": round(max(every), 3) if every else None,
        "refit_engine_death_kill_wait_s": round(statistics.median(waits["kill"]), 3)
        if waits["kill"]
        else None,
        "refit_engine_death_sync_timeout_s": REFIT_SYNC_TIMEOUT_S,
        "refit_engine_death_runs_ok": f"{good}/{runs}",
        "refit_engine_death_cases_per_run": len(REFIT_CASES),
        "refit_engine_death_rejoin_s": {
            k: round(statistics.median(v), 3) for k, v in rejoin.items() if v
        },
        "refit_engine_death_failures": failures[:5],
    }


def _standby_states(run: Run) -> list[dict[str, Any]]:
    out = []
    for path in sorted((run.run_dir / "roles" / "rollout").glob("standby-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def back_to_back_deaths(root: Path, pairs: int, seed: int) -> Run:
    """One run with ``standby = 2`` (a pool of 2 for the role): ``pairs`` times, once both
    standbys are ready and every earlier death is recovered from, kill -9 replica 0 and, 2 s
    later, replica 1. Rejoin: kill → its replacement ``serving`` the current version."""
    # every pair kills each replica once more: no retirement cap in this run
    run = Run(root, "back_to_back", steps=100000, standby=2, seed=seed,
              role_opts=f",retire={pairs + 1}")  # fmt: skip
    try:
        if not run.wait_step(2):
            return run
        for p in range(pairs):
            deadline = time.monotonic() + 300
            while run.proc.poll() is None and time.monotonic() < deadline:
                sb = _standby_states(run)
                if len(sb) == 2 and all(x["state"] == "standby" for x in sb):
                    if not run.sup.pending():
                        break
                time.sleep(0.2)
            for i, kind in ((0, "b2b_first"), (1, "b2b_second")):
                if i:
                    time.sleep(2.0)
                run.sup.died(i, kind)
                _signal(run.sup.faults[-1][1], signal.SIGKILL)
            print(f"  [back_to_back] pair {p}: replicas 0 and 1 killed 2 s apart", flush=True)
        deadline = time.monotonic() + 300
        while run.sup.pending() and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        run.stop()
    return run


_READY_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) engine\[(\d+)\] engine: standby ready"
)


def standby_false_ready(run_dirs: list[Path]) -> dict[str, int]:
    """Promotions of a standby that had not itself proved ready: for each ``promoted``
    ``role_standby_state`` event, the standby's own log (``engine: standby ready``, written
    by the standby process, with its pid) must say ready before the promotion."""
    false = promotions = 0
    for d in run_dirs:
        ready: dict[int, float] = {}
        for log in (d / "roles").glob("*/standby-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                m = _READY_LINE.match(line)
                if m:
                    t = time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000
                    ready.setdefault(int(m[3]), t)
        for e in _events(d, "role_standby_state"):
            if e.get("state") != "promoted":
                continue
            promotions += 1
            t = ready.get(int(e.get("pid") or -1))
            if t is None or t > e["time"]:
                false += 1
    return {"standby_false_ready": false, "standby_promotions": promotions}


def groups_padded(run_dirs: list[Path]) -> dict[str, Any]:
    """What was trained, inspected: each rank's ``rollout_samples_trained`` record of a step
    (the groups trained, each with its members) against the trainer's own count of the rows
    it trained that step (``samples_trained`` in its log). A group is padded when it holds
    more than ``--group`` members, or when the step trained more rows than its groups' real
    members (each extra row a padded group). Dropped groups by reason beside it."""
    padded = groups = 0
    dropped: dict[str, int] = {}
    for d in run_dirs:
        recs = {
            (r.get("attempt", 0), r.get("rank", 0), r["step"]): r["samples_trained"]
            for rank in (0, 1)
            for r in _records(d, rank)
            if r.get("kind") == "log" and "samples_trained" in r
        }
        for e in _events(d, "rollout_samples_trained"):
            sizes = list(e.get("group_sizes") or [])
            groups += len(sizes)
            padded += sum(g > GROUP for g in sizes)
            rows = recs.get((e.get("attempt", 0), e.get("rank", 0), e.get("step")))
            if rows is not None and rows > sum(sizes):
                padded += rows - sum(sizes)
            for reason, n in dict(e.get("dropped") or {}).items():
                dropped[reason] = dropped.get(reason, 0) + int(n)
    return {"groups_padded": padded, "groups_trained": groups, "groups_dropped": dropped}


def staleness_run(root: Path, *, steps: int, kills: int, k: int, seed: int) -> Run:
    """Async mode (``--max-staleness k``) through ``kills`` trainer kills (rank and group in
    turn) at random steps, to its end."""
    run = Run(root, f"async_k{k}_trainer_kills", steps=steps, seed=seed,
              extra=("--max-staleness", str(k)))  # fmt: skip
    rng = random.Random(seed)
    for step in sorted(rng.sample(range(2, steps - 2), kills)):
        if not run.wait_step(max(step, run.step() + 1)):
            break
        run.inject(("trainer_rank_kill", "trainer_group_kill")[len(run.faults) % 2], rng)
    run.finish(timeout=1800)
    return run


def staleness_after_resume(run: Run, k: int) -> dict[str, Any]:
    """Every trained sample's recorded staleness (each rank's ``rollout_samples_trained``
    events); ``max_staleness_after_resume``: the largest among the samples trained after
    the first trainer kill (a later attempt)."""
    trained = _events(run.run_dir, "rollout_samples_trained")
    every = [s for e in trained for s in e.get("staleness") or []]
    after = [s for e in trained if e.get("attempt", 0) > 0 for s in e.get("staleness") or []]
    hist: dict[int, int] = {}
    for s in every:
        hist[s] = hist.get(s, 0) + 1
    return {
        "max_staleness_after_resume": max(after) if after else None,
        "max_staleness_all": max(every) if every else None,
        "staleness_bound_k": k,
        "staleness_samples_after_resume": len(after),
        "staleness_histogram": dict(sorted(hist.items())),
        "staleness_trainer_kills": len(run.faults),
        "staleness_attempts": len({e.get("attempt", 0) for e in trained}),
    }


def refit_figures(root: Path, args: argparse.Namespace, runs: list[Path]) -> dict[str, Any]:
    """Deaths mid-refit and back to back, group integrity and staleness across resumes;
    ``runs``: the run directories of the scenarios already run (their promotions and groups
    are counted too)."""
    out = refit_engine_death(root, args.refit_death_runs) if args.refit_death_runs else {}
    print(f"weight sync through an engine's death: {out}", flush=True)
    dirs = list(runs)
    if args.b2b_pairs:
        b2b = back_to_back_deaths(root / "embedded", args.b2b_pairs, args.seed)
        second = [s for kind, s in b2b.sup.rejoin_s() if kind == "b2b_second"]
        first = [s for kind, s in b2b.sup.rejoin_s() if kind == "b2b_first"]
        out["back_to_back_engine_deaths_rejoin_s"] = (
            round(statistics.median(second), 3) if second else None
        )
        out["back_to_back_first_death_rejoin_s"] = (
            round(statistics.median(first), 3) if first else None
        )
        out["back_to_back_pairs"] = f"{len(second)}/{args.b2b_pairs}"
        out["back_to_back_rejoin_s_each"] = [round(s, 2) for s in second]
        dirs.append(b2b.run_dir)
    if args.async_steps:
        stale = staleness_run(root / "embedded", steps=args.async_steps, kills=args.async_kills,
                              k=ASYNC_K, seed=args.seed)  # fmt: skip
        out.update(staleness_after_resume(stale, ASYNC_K))
        dirs.append(stale.run_dir)
    out.update(standby_false_ready(dirs))
    out.update(groups_padded(dirs))
    return out


ASYNC_K = 1


AUTH_PROMPTS_PER_REQUEST, AUTH_GROUP, AUTH_MAX_TOKENS = 4, 8, 16
"""A rollout request of the runs above: ``prompts_per_request`` prompts (RolloutConfig's
default) of ``--group 8`` completions, ``--max-tokens 16``."""


def _auth_pair_server(weights: str, port_file: str) -> None:
    """One engine (tiny-gpt2, the store's version 0) behind two HTTP servers: one checks the
    job's token, the other nothing; writes ``{"on": port, "off": port, "token": ...}``."""
    import secrets
    import threading

    from trainguard.core.atomicfile import write_atomic
    from trainguard.rl.engine import Engine, EngineConfig, serve

    class NoAuth:
        """The engine, seen without its authenticator (the server that checks nothing)."""

        auth = None

        def __init__(self, engine: Engine) -> None:
            self._engine = engine

        def __getattr__(self, name: str) -> Any:
            return getattr(self._engine, name)

    token = secrets.token_hex(32)
    engine = Engine(EngineConfig(weights_dir=Path(weights), token=token, poll_interval_s=60))
    on, off = serve(engine), serve(NoAuth(engine))  # type: ignore[arg-type]
    for srv in (on, off):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    engine.boot()
    ports = {"on": on.server_address[1], "off": off.server_address[1], "token": token}
    write_atomic(Path(port_file), json.dumps(ports))
    threading.Event().wait()


def auth_overhead(root: Path, rounds: int = 9, pairs: int = 24) -> dict[str, Any]:
    """Authentication's share of a rollout request's cost: the same engine process behind a
    server that checks the job's signature and one that does not, a client that signs (and
    checks the answers' signatures) and one that does not, the same request (prompts, seed)
    through each, back to back, in turn first. ``auth_overhead``: per round, the median of the
    pairs' differences in CPU time (every thread of the engine process and of the clients) over
    the median CPU time without authentication; the median of the rounds. On an idle machine a
    request's latency is its CPU time (the tiny model generates on one thread); CPU time is what
    a loaded machine leaves measurable. ``auth_overhead_wall``: the same with wall times.
    ``auth_cpu_fraction``: the CPU time of signing and checking one request and its answer,
    timed alone, over the median request latency."""
    import hashlib

    from trainguard.core.fleetauth import Authenticator, answer_ok
    from trainguard.rl import RolloutClient, RolloutConfig, WeightStore
    from trainguard.rl.tiny import tiny_gpt2

    weights = root / "auth" / "weights"
    WeightStore(weights).publish(0, tiny_gpt2(seed=0).state_dict())
    port_file = root / "auth" / "ports.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--auth-pair-server", str(weights), str(port_file)], env=env
    )
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the engine for auth_overhead did not start")
            time.sleep(0.2)
        ports = json.loads(port_file.read_text())
        cfg = RolloutConfig(prompts_per_request=AUTH_PROMPTS_PER_REQUEST)
        on = RolloutClient([f"http://127.0.0.1:{ports['on']}"], config=cfg, token=ports["token"])
        off = RolloutClient([f"http://127.0.0.1:{ports['off']}"], config=cfg)
        on.wait_serving(1, timeout=300)
        off.wait_serving(1, timeout=300)
        prompts = [f"please write {i} now" for i in range(AUTH_PROMPTS_PER_REQUEST)]

        def one(client: RolloutClient, seed: int) -> float:
            t0 = time.perf_counter()
            groups = client.generate(
                prompts, n=AUTH_GROUP, max_tokens=AUTH_MAX_TOKENS, temperature=1.0, seed=seed
            )
            dt = time.perf_counter() - t0
            assert sum(len(g) for g in groups) == AUTH_PROMPTS_PER_REQUEST * AUTH_GROUP
            return dt

        for seed in range(3):  # warm-up
            one(on, seed), one(off, seed)

        def cpu_s() -> float:
            """CPU seconds of every thread of the engine process (``schedstat``: ns) and of
            this process (both clients)."""
            ns = 0
            for task in Path(f"/proc/{proc.pid}/task").iterdir():
                try:
                    ns += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError):  # a thread that ended
                    pass
            return ns / 1e9 + time.process_time()

        ratios, wall_ratios, lat_on, lat_off, cpu_off = [], [], [], [], []
        for r in range(rounds):
            t_on, t_off, d_cpu, d_wall, c_off = [], [], [], [], []
            for k in range(pairs):
                seed, got = 1000 * r + k, {}
                for client in (on, off) if k % 2 == 0 else (off, on):
                    c0 = cpu_s()
                    got[client is on] = (one(client, seed), cpu_s() - c0)
                t_on.append(got[True][0])
                t_off.append(got[False][0])
                c_off.append(got[False][1])
                d_cpu.append(got[True][1] - got[False][1])
                d_wall.append(got[True][0] - got[False][0])
            lat_on += t_on
            lat_off += t_off
            cpu_off += c_off
            # paired: the two requests of a pair ran back to back (the machine's load drifts)
            ratios.append(statistics.median(d_cpu) / statistics.median(c_off))
            wall_ratios.append(statistics.median(d_wall) / statistics.median(t_off))
        on.close()
        off.close()
    finally:
        proc.kill()
        proc.wait()
    # the authentication's own CPU time per request: sign, check, body digest, answer, verify
    body = json.dumps({"prompt": prompts, "n": AUTH_GROUP, "max_tokens": AUTH_MAX_TOKENS}).encode()
    answer = b"x" * (AUTH_PROMPTS_PER_REQUEST * AUTH_GROUP * 400)
    token, reps = "t" * 64, 2000
    auth = Authenticator("rollout", token, window_s=1e9)
    t0 = time.perf_counter()
    for _ in range(reps):
        sig = sign(token, "POST", "/v1/completions", 1, body)
        assert auth.verify("POST", "/v1/completions", 1, sig["Authorization"]) is None
        hashlib.sha256(body).hexdigest()  # the server's check of the body it read
        header = auth.sign_answer(sig.nonce, 200, answer)
        assert answer_ok(token, sig, 200, answer, header)
    cpu_us = (time.perf_counter() - t0) / reps * 1e6
    med_off = statistics.median(lat_off)
    return {
        "auth_overhead": round(statistics.median(ratios), 5),
        "auth_overhead_rounds": [round(x, 5) for x in ratios],
        "auth_overhead_wall": round(statistics.median(wall_ratios), 5),
        "auth_overhead_wall_rounds": [round(x, 5) for x in wall_ratios],
        "auth_request_s": {"on": round(statistics.median(lat_on), 5), "off": round(med_off, 5)},
        "auth_cpu_us_per_request": round(cpu_us, 1),
        "auth_cpu_fraction": round(cpu_us / 1e6 / med_off, 6),
        "auth_request_shape": f"{AUTH_PROMPTS_PER_REQUEST} prompts x n={AUTH_GROUP} x "
        f"{AUTH_MAX_TOKENS} tokens",
    }


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


def figures(root: Path, args: argparse.Namespace, engine: str) -> dict[str, Any]:
    """Every scenario and the two ETTR runs on ``engine``: the figures of the JSON line."""
    root = root / engine
    plan = [[], *[[k] for k in KINDS], list(KINDS)]
    if args.only:
        wanted = args.only.split(",")
        plan = [k for k in plan if "+".join(k) in wanted or (not k and "fault_free" in wanted)]
    runs = [
        scenario(root, kinds, steps=args.steps, seed=args.seed + i, engine=engine)
        for i, kinds in enumerate(plan)
    ]
    ettr: dict[str, Run] = {}
    if args.ettr_s > 0:
        ettr["fault_free"] = ettr_run(root, "ettr_fault_free", args.ettr_s, None, args.seed, engine)
        ettr["failures"] = ettr_run(
            root, "ettr_failures", args.ettr_s, args.mtbf_s, args.seed, engine
        )
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
    return out


def _standby_ready(run: Run) -> bool:
    """Whether the job's rollout role has a warm standby loaded (``standby-<k>.json``)."""
    for path in (run.run_dir / "roles" / "rollout").glob("standby-*.json"):
        try:
            if json.loads(path.read_text()).get("state") == "standby":
                return True
        except (OSError, ValueError):
            continue
    return False


def vllm_run(root: Path, name: str, duration_s: float, mtbf_s: float | None, seed: int) -> Run:
    """One job on vLLM engines (2 replicas, 1 warm standby) that stands for several of the
    embedded engine's runs: its engines start once (minutes on 2 cores) and serve a window of
    ``duration_s`` from the first completed step, faults every ``mtbf_s`` on average
    (exponential), every kind in the first five in a shuffled order. A fault that ends an
    engine (kill -9, SIGSTOP) waits for the standby to be loaded (a cold vLLM start is not what
    the standby figures measure); the other kinds go first meanwhile."""
    run = Run(root, name, steps=100000, engine="vllm", seed=seed)
    rng = random.Random(seed)
    kinds: list[str] = []
    for _ in range(20):
        block = list(KINDS)
        rng.shuffle(block)
        kinds.extend(block)
    run.wait_step(0, timeout=3600)
    start_steps = run.step() + 1
    t0 = time.time()
    t_end = t0 + duration_s
    nxt = t0 + rng.expovariate(1 / mtbf_s) if mtbf_s else t_end * 2
    while time.time() < t_end and run.proc.poll() is None:
        if time.time() >= nxt:
            ok = [k for k in kinds if k not in ("engine_kill", "engine_freeze")]
            if _standby_ready(run) and not run.sup.pending():
                ok = kinds
            if ok:
                kinds.remove(ok[0])
                run.inject(ok[0], rng)
                nxt = time.time() + rng.expovariate(1 / mtbf_s) if mtbf_s else t_end * 2
        time.sleep(0.2)
    run.window_steps = run.step() + 1 - start_steps
    run.stop()
    print(f"  [{run.name}] {run.audit()}, {len(run.faults)} faults", flush=True)
    return run


def trained_samples(run_dir: Path) -> dict[tuple[int, int], str]:
    """(rank, step) → the digest of the samples that rank trained on in that step (the
    example's ``samples_sha``; a step redone after a trainer restart: its last record)."""
    out = {}
    for rank in (0, 1):
        for r in _records(run_dir, rank):
            if r.get("kind") == "log" and "samples_sha" in r:
                out[(rank, int(r["step"]))] = str(r["samples_sha"])
    return out


def vllm_figures(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The embedded engine's keys on vLLM from two jobs (a fault-free one and one with faults
    of every kind, the same run seed, each an ETTR window of ``--ettr-s``) and the refit
    drill; ``replay_samples_equal``: every step both jobs trained, each rank's samples (prompt
    ids and token ids) equal."""
    root = root / "vllm"
    free = vllm_run(root, "fault_free", args.ettr_s, None, args.seed)
    hit = vllm_run(root, "faults", args.ettr_s, args.vllm_mtbf_s, args.seed)
    runs = [free, hit]
    audits = {r.name: r.audit() for r in runs}

    def med(xs: list[float], nd: int = 3) -> float | None:
        return round(statistics.median(xs), nd) if xs else None

    rejoin = {k: [s for kk, s in hit.sup.rejoin_s() if kk == k] for k in KINDS}
    # a replica that failed within 30 s of a trainer kill, not one of the engines faulted
    faulted = {pid for _, pid, _, _ in hit.sup.faults}
    kills = [t for k, t, _ in hit.faults if k.startswith("trainer")]
    on_trainer_kill = [
        e
        for e in _events(hit.run_dir, "role_replica_failed")
        if e.get("pid") not in faulted and any(0 <= e["time"] - t <= 30 for t in kills)
    ]
    syncs = [
        x["weight_sync_s"]
        for x in _records(free.run_dir)
        if x.get("kind") == "log" and "weight_sync_s" in x
    ]
    a, b = trained_samples(free.run_dir), trained_samples(hit.run_dir)
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k] != b[k]]
    m = free.median_step()
    out: dict[str, Any] = {
        "fabricated_samples": sum(x["fabricated"] for x in audits.values()),
        "prompts_skipped": sum(x["skipped"] for x in audits.values()),
        "prompts_duplicated": sum(x["duplicated"] for x in audits.values()),
        "sync_order_equal_fault_free": all(x["same_order"] for x in audits.values()),
        "median_step_s": round(m, 4),
        "engine_kill_step_delay_s": med(hit.step_delay("engine_kill")),
        "engine_rejoin_s": med(rejoin["engine_kill"]),
        "engine_freeze_rejoin_s": med(rejoin["engine_freeze"]),
        "engine_freeze_step_delay_s": med(hit.step_delay("engine_freeze")),
        "engine_restarts_on_trainer_kill": len(on_trainer_kill),
        "trainer_kill_to_next_update_s": med(hit.kill_to_update()),
        "weight_sync_s": med(syncs, 4),
        "rl_ettr_fault_free": round(free.window_steps * m / args.ettr_s, 4),
        "rl_ettr_failures": round(hit.window_steps * m / args.ettr_s, 4),
        "ettr_run_s": args.ettr_s,
        "ettr_faults": len(hit.faults),
        "fault_kinds": sorted({k for k, _, _ in hit.faults}),
        "replay_samples_equal": bool(common) and not differ,
        "replay_samples_compared": len(common),
        "replay_samples_differing": [list(k) for k in differ],
    }
    out["rl_ettr_ratio"] = (
        round(out["rl_ettr_failures"] / out["rl_ettr_fault_free"], 4)
        if out["rl_ettr_fault_free"]
        else None
    )
    print(f"vLLM jobs: {json.dumps(out)}", flush=True)
    if args.refits > 0:
        from bench.vllm_refits import drill

        print("vLLM refit drill:", flush=True)
        out.update(drill(root / "refits", args.refits))
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--auth-pair-server":
        _auth_pair_server(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20, help="steps of each scenario run")
    p.add_argument("--ettr-s", type=float, default=300.0)
    p.add_argument("--mtbf-s", type=float, default=30.0)
    p.add_argument("--only", default=None, help="comma-separated scenarios (debugging)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    p.add_argument("--refits", type=int, default=20, help="--engine vllm: refits of the drill")
    p.add_argument("--auth-only", action="store_true", help="only the auth_overhead figures")
    p.add_argument("--router-only", action="store_true", help="only the fleet endpoint figures")
    p.add_argument("--replay-steps", type=int, default=40, help="0: no replay runs")
    p.add_argument("--replay-faults", type=int, default=6)
    p.add_argument("--refit-only", action="store_true",
                   help="only the refit, back-to-back, group and staleness figures")  # fmt: skip
    p.add_argument("--refit-death-runs", type=int, default=20, help="runs of the refit drill")
    p.add_argument("--b2b-pairs", type=int, default=5, help="back-to-back death pairs (0: none)")
    p.add_argument("--async-steps", type=int, default=24, help="steps of the async run (0: none)")
    p.add_argument("--async-kills", type=int, default=3, help="trainer kills in the async run")
    p.add_argument("--vllm-mtbf-s", type=float, default=60.0, help="--engine vllm: faults' MTBF")
    p.add_argument("--vllm-only", action="store_true",
                   help="--engine vllm: only vLLM's figures, without the embedded engine's")  # fmt: skip
    p.add_argument("--role-nodes-only", action="store_true", help="only the role node figures")
    p.add_argument("--role-node-runs", type=int, default=3, help="runs of 2 role node losses")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-fleet-bench-"))
    print(f"runs in {root}", flush=True)
    if args.refit_only:
        print(json.dumps(refit_figures(root, args, [])), flush=True)
        return
    from bench.role_nodes import role_node_loss

    if args.role_nodes_only:
        print(json.dumps(role_node_loss(root, args.role_node_runs)), flush=True)
        return
    router = {} if args.auth_only else router_client_errors(root)
    print(f"fleet endpoint under engine kills: {router}", flush=True)
    if args.router_only:
        print(json.dumps(router), flush=True)
        return
    vllm = vllm_figures(root, args) if args.engine == "vllm" else None
    if vllm is not None and args.vllm_only:
        print(json.dumps({**vllm, **router}), flush=True)
        return
    auth = auth_overhead(root)
    print(f"authentication: {auth}", flush=True)
    if args.auth_only:
        print(json.dumps(auth), flush=True)
        return
    embedded = {**figures(root, args, "embedded"), **router, **auth}
    scenario_dirs = [d for d in sorted((root / "embedded").iterdir()) if d.is_dir()]
    embedded.update(refit_figures(root, args, scenario_dirs))
    embedded.update(role_node_loss(root, args.role_node_runs))
    if args.replay_steps > 0:
        embedded.update(
            replay_runs(root, steps=args.replay_steps, faults=args.replay_faults, seed=args.seed)
        )
    if args.engine == "embedded":
        print(json.dumps(embedded), flush=True)
        return
    assert vllm is not None
    print(json.dumps({**vllm, "embedded": embedded}), flush=True)


if __name__ == "__main__":
    main()
