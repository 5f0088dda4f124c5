"""The layout of a run directory (``--tg-run-dir``): every path in it is spelled here.

::

    events.jsonl                          lifecycle events (trainguard.core.events)
    config.json                           the effective config and torchrun's arguments
    metrics/rank_<r>.jsonl                each worker's step and log records
    progress/attempt_<a>/rank_<r>.bin     the progress channel of one attempt
    checkpoints/                          checkpoints, unless [checkpoint] dir says otherwise
    stacks/attempt_<a>/rank_<r>.txt       a hung worker's stacks, as the agent took them
    stacks/attempt_<a>/rank_<r>.faulthandler.txt
                                          a worker's stacks on the stack signal (appended)
    hangs/<a>/                            the diagnosis of a hang of attempt <a> (a DumpDir)
    debug/<id>/                           one ``trainguard debug`` look at a running job (a DumpDir)
    health/straggler_scores.<node>.json   the latest step-time straggler scores of a node's ranks
    rl/weights/                           the rollout engines' weight store (trainguard.rl.weights)
    rl/models/<name>/                     a model directory the job built for its engines
    logs/<step>-<job>-<task>.out          a ``trainguard sbatch`` job step's output (Slurm's)
    heartbeats/<node>.json                an agent's heartbeat, for ``trainguard watch``
    telemetry/metrics_<node>.jsonl        a node's exported metrics (OpenTelemetry, JSONL)
    telemetry/traces_<node>.jsonl         its spans
    telemetry/summary_<node>.json         its end-of-run summary (goodput, export failures)
    prometheus_<node>.json                a running agent's Prometheus endpoint
    report.html                           ``trainguard report``'s page
    agent.mark                            held open by every live agent (trainguard.core.agentmark)
    roles/secret                          the fleet's job secret (0600; trainguard.core.fleetauth)
    roles/<role>/<i>.json                 state of role replica i (rollout, reward engines)
    roles/<role>/<i>.log                  its output (stdout and stderr, every restart)
    roles/<role>/standby-<k>.json|.log    a warm standby's state and output (``standby = N``)
    roles/<role>/standby-<k>.<n>.promote  the order that promoted its n-th start to a replica
    roles/router.log                      the fleet endpoint's output (``[roles] router``)

A dump directory (:class:`DumpDir`, the hang-dump protocol):

::

    request[.<node>]                      a dump request (an agent's, or ``trainguard debug``'s)
    fr_rank_<r>.json                      rank r's flight-recorder trace (the worker's answer)
    stacks_rank_<r>.txt                   rank r's Python stacks, faulthandler (the worker's answer)
    pyspy_rank_<r>.txt                    a stopped rank's stacks, taken by the agent with py-spy
    summary_rank_<r>.json                 rank r's position, as the agent read it
    diagnosis.json                        the agent's verdict on the hang

A worker writes into a dump directory only when it and every directory above it up to the run
directory are real directories of the job's user (:meth:`RunDir.dump_dir_ok`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.agentmark import MARK_FILE
from trainguard.core.atomicfile import owned_dir
from trainguard.core.events import EVENTS_FILE

CONFIG_JSON = "config.json"
"""The run's effective configuration, written by the agent."""

__all__ = ["DumpDir", "RunDir"]


@dataclass(frozen=True, slots=True)
class DumpDir:
    """One dump directory (``hangs/<a>/`` or ``debug/<id>/``): who writes what is in the
    module docstring. Paths only; nothing is created here."""

    path: Path

    def request(self, node: str = "") -> Path:
        """The file an agent (one per node: ``node``) or ``trainguard debug`` creates to ask
        the workers for a dump; removed once answered."""
        return self.path / (f"request.{node}" if node else "request")

    def requests(self) -> list[Path]:
        """The open dump requests."""
        return sorted(self.path.glob("request*"))

    def fr_trace(self, rank: int) -> Path:
        return self.path / f"fr_rank_{rank}.json"

    def stacks(self, rank: int) -> Path:
        """The worker's own faulthandler dump of its threads."""
        return self.path / f"stacks_rank_{rank}.txt"

    def pyspy_stacks(self, rank: int) -> Path:
        """A stopped worker's stacks, read by the agent with py-spy."""
        return self.path / f"pyspy_rank_{rank}.txt"

    def stack_files(self, rank: int) -> list[tuple[Path, str]]:
        """Where rank ``rank``'s stacks may be, best first, with the method that took them."""
        return [(self.stacks(rank), "faulthandler"), (self.pyspy_stacks(rank), "py-spy")]

    def summary(self, rank: int) -> Path:
        return self.path / f"summary_rank_{rank}.json"

    @property
    def diagnosis(self) -> Path:
        return self.path / "diagnosis.json"


@dataclass(frozen=True, slots=True)
class RunDir:
    """Paths of one run directory (nothing is created or read here)."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def config(self) -> Path:
        return self.root / CONFIG_JSON

    @property
    def metrics_dir(self) -> Path:
        return self.root / "metrics"

    def metrics(self, rank: int) -> Path:
        """The records of global rank ``rank``."""
        return self.metrics_dir / f"rank_{rank}.jsonl"

    def metrics_files(self) -> list[Path]:
        """Every rank's records file, sorted by name."""
        return sorted(self.metrics_dir.glob("rank_*.jsonl"))

    @staticmethod
    def metrics_rank(path: Path) -> int | None:
        """The rank of a :meth:`metrics` path, None for another name."""
        try:
            return int(path.stem.split("_", 1)[1])
        except (IndexError, ValueError):
            return None

    @property
    def heartbeats(self) -> Path:
        """The agents' heartbeat files (one per node), read by ``trainguard watch``."""
        return self.root / "heartbeats"

    def heartbeat(self, node: str) -> Path:
        """Node ``node``'s agent heartbeat."""
        return self.heartbeats / f"{node.replace(os.sep, '_')}.json"

    @property
    def checkpoints(self) -> Path:
        """The default checkpoint root (``[checkpoint] dir`` overrides it)."""
        return self.root / "checkpoints"

    def progress(self, attempt: int) -> Path:
        """The progress channel directory of ``attempt``."""
        return self.root / "progress" / f"attempt_{attempt}"

    def attempts(self) -> list[int]:
        """The attempts that have a progress directory, oldest first."""
        out = []
        for d in self.progress(0).parent.glob("attempt_*"):
            try:
                out.append(int(d.name.split("_", 1)[1]))
            except ValueError:
                continue
        return sorted(out)

    def stacks(self, attempt: int) -> Path:
        """Where the stacks of ``attempt``'s hung workers go."""
        return self.root / "stacks" / f"attempt_{attempt}"

    def hung_stack(self, attempt: int, rank: int) -> Path:
        """One hung worker's stack, as the agent took it (py-spy or the stack signal)."""
        return self.stacks(attempt) / f"rank_{rank}.txt"

    def signal_stacks(self, attempt: int, rank: int) -> Path:
        """The file a worker's faulthandler appends its stacks to on the stack signal."""
        return self.stacks(attempt) / f"rank_{rank}.faulthandler.txt"

    def hang(self, attempt: int) -> DumpDir:
        """Where the diagnosis of a hang of ``attempt`` lives: dumps, stacks, the verdict."""
        return DumpDir(self.root / "hangs" / str(attempt))

    @property
    def debug_root(self) -> Path:
        return self.root / "debug"

    def debug(self, name: str) -> DumpDir:
        """One ``trainguard debug`` look (``name``: its time stamp and pid)."""
        return DumpDir(self.debug_root / name)

    def dump_requests(self, attempt: int) -> list[Path]:
        """Every open dump request a worker of ``attempt`` answers: its attempt's hang (a
        restarted worker never overwrites an earlier verdict's evidence) and every debug look."""
        return self.hang(attempt).requests() + sorted(self.debug_root.glob("*/request*"))

    def dump_dir_ok(self, directory: Path) -> bool:
        """Whether a dump may be written into ``directory`` (a request's directory): it and
        every directory between it and the run directory are real directories (no symlink) of
        this process's user (or of the run directory's owner). Anyone who can write into the
        run directory (a group, a shared scratch file system) could otherwise send this user's
        dumps, or a file name of theirs, anywhere."""
        try:
            rel = directory.relative_to(self.root)
            # the job's user, or the run directory's owner (the same, but for a user mapped to
            # another uid on a shared file system, as root is under root_squash)
            owners = {os.getuid(), os.stat(self.root).st_uid}
        except (ValueError, OSError):
            return False
        d = self.root
        for part in rel.parts:
            d = d / part
            if not any(owned_dir(d, uid) for uid in owners):
                return False
        return True

    @property
    def telemetry(self) -> Path:
        """The telemetry plugin's files (each node's metrics, traces and summary)."""
        return self.root / "telemetry"

    def telemetry_file(self, what: str, node: str) -> Path:
        """``what`` = ``metrics`` or ``traces`` (JSONL, appended), ``summary`` (JSON, at the end)
        of ``node``."""
        suffix = "json" if what == "summary" else "jsonl"
        return self.telemetry / f"{what}_{node}.{suffix}"

    def prometheus_endpoint(self, node: str) -> Path:
        """Where the agent of ``node`` writes its Prometheus endpoint (``host``, ``port``,
        ``url``, ``pid``) while it runs."""
        return self.root / f"prometheus_{node}.json"

    @property
    def agent_mark(self) -> Path:
        """The file every live agent of the run holds open (:mod:`trainguard.core.agentmark`)."""
        return self.root / MARK_FILE

    @property
    def report(self) -> Path:
        """``trainguard report``'s HTML page (unless told another path)."""
        return self.root / "report.html"

    def straggler_scores(self, node: str) -> Path:
        """The latest step-time straggler scores of ``node``'s ranks (JSON, replaced at each
        evaluation), for people and tests: the plugins get them over the event bus."""
        return self.root / "health" / f"straggler_scores.{node}.json"

    def straggler_score_files(self) -> list[Path]:
        """Every node's straggler scores file, sorted by name."""
        return sorted((self.root / "health").glob("straggler_scores.*.json"))

    @property
    def weights(self) -> Path:
        """The weight store of the rollout fleet (versions the trainer publishes and the
        engines load: :mod:`trainguard.rl.weights`)."""
        return self.root / "rl" / "weights"

    @property
    def models(self) -> Path:
        """Model directories the job built for its engines (a Hugging Face checkpoint an
        engine such as vLLM starts from: :mod:`trainguard.rl.engines.launch`)."""
        return self.root / "rl" / "models"

    @property
    def logs(self) -> Path:
        """The output of a ``trainguard sbatch`` job's steps (Slurm's ``--output``)."""
        return self.root / "logs"

    def step_log(self, step: str) -> Path:
        """Slurm's ``--output`` pattern for job step ``step`` (``agent``, ``roles``): one file
        per job id and task."""
        return self.logs / f"{step}-%j-%t.out"

    @property
    def roles(self) -> Path:
        """Where the role supervisor keeps its replicas' state files and logs."""
        return self.root / "roles"

    @property
    def role_nodes(self) -> Path:
        """Under ``trainguard sbatch``: the role nodes' beacons (``<node>.alive``), the lost
        ones (``<node>.lost``), the spares' assignments (``<node>.assign.json``)."""
        return self.root / "role-nodes"

    @property
    def role_below_floor(self) -> Path:
        """The line of a role that fell below its serving floor (the job ends with it)."""
        return self.role_nodes / "below-floor"

    @property
    def role_secret(self) -> Path:
        """The rollout fleet's job secret (0600; :mod:`trainguard.core.fleetauth`)."""
        return self.roles / "secret"

    def role_state(self, role: str, replica: int) -> Path:
        """The state of one replica (JSON: pid, port, url, state, restarts, weight_version,
        timestamps), replaced atomically at each change."""
        return self.roles / role / f"{replica}.json"

    @property
    def router_log(self) -> Path:
        """The fleet endpoint's output (``[roles] router``), appended to across its restarts."""
        return self.roles / "router.log"

    def role_log(self, role: str, replica: int) -> Path:
        """The output of one replica, appended to across its restarts."""
        return self.roles / role / f"{replica}.log"

    def role_standby(self, role: str, slot: int, suffix: str) -> Path:
        """A role's warm standby ``slot``: ``json`` its state, ``log`` its output,
        ``<incarnation>.promote`` the file that promotes that incarnation to a replica
        (written by the supervisor)."""
        return self.roles / role / f"standby-{slot}.{suffix}"

    def role_states(self) -> dict[str, list[dict[str, Any]]]:
        """Every replica's last state, by role, replica 0 first (unreadable files skipped)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for path in sorted(self.roles.glob("*/*.json")):
            try:
                state = json.loads(path.read_text())
                idx = int(path.stem)
            except (OSError, ValueError):
                continue
            if isinstance(state, dict):
                out.setdefault(path.parent.name, []).append({"replica": idx, **state})
        for states in out.values():
            states.sort(key=lambda s: s["replica"])
        return out
