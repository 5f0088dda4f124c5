"""``trainguard run``: torchrun's parser, ``LaunchConfig`` and elastic agent, plus trainguard.

The flags, their ``PET_*`` env defaults, the worker env contract, restarts, log layout, exit
codes and the root-cause failure report are torch's own: this module reuses
``torch.distributed.run.get_args_parser`` and ``config_from_args`` and composes the same pieces
``torch.distributed.launcher.api.launch_agent`` does, with :class:`TrainGuardAgent` and a
rendezvous handler that gives every attempt a fresh worker store.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from trainguard.chaos import faults as chaos
from trainguard.core.agentmark import hold_mark, release_mark
from trainguard.core.atomicfile import make_dirs
from trainguard.core.config import ConfigError, TrainGuardConfig, load_config, write_effective
from trainguard.core.contracts import envvars
from trainguard.core.contracts.jobstate import JobState
from trainguard.core.events import EventLog
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE
from trainguard.core.plugin import AgentContext, AgentExit, AgentPlugin
from trainguard.core.procs import resume_gc
from trainguard.core.proctime import process_start_time
from trainguard.core.timeouts import contradictions, timeout_chain
from trainguard.runtime import _torch, etcd_v3, spares
from trainguard.runtime._torch import cheap_rendezvous_event_names
from trainguard.runtime.agent import TrainGuardAgent
from trainguard.runtime.rendezvous import AttemptRendezvousHandler

__all__ = ["UsageError", "build_parser", "launch", "run"]

logger = logging.getLogger(__name__)

PluginFactory = Callable[[AgentContext], list[AgentPlugin]]
"""Builds the node's plugins from its context (default: runtime.registry.default_plugins)."""


class UsageError(Exception):
    """Bad input to ``trainguard run``; printed as one line, exit code 2."""


def build_parser(prog: str = "trainguard run") -> argparse.ArgumentParser:
    """torchrun's own parser, plus trainguard's few options (none shadows a torchrun flag)."""
    parser = torchrun.get_args_parser()
    parser.prog = prog
    parser.description = "trainguard: a drop-in torchrun with health checks and telemetry"
    group = parser.add_argument_group("trainguard (everything else: --config or TRAINGUARD_* env)")
    group.add_argument(
        "--config",
        dest="tg_config",
        default=None,
        metavar="TOML",
        help="trainguard's settings file (sections [runtime], [health], [checkpoint], "
        "[telemetry], [recovery], [rendezvous], [warm], ...); precedence: flag > file > TRAINGUARD_* env > default.",
    )
    group.add_argument(
        "--tg-run-dir",
        dest="tg_run_dir",
        default=None,
        metavar="DIR",
        help="Run directory for events, metrics and reports (default ./trainguard-runs/<run id>).",
    )
    group.add_argument(
        "--ft",
        dest="tg_ft",
        action="store_true",
        default=None,
        help="torchft mode: run as one torchft replica group (id: REPLICA_GROUP_ID or [ft] "
        "replica_group); starts a lighthouse on 127.0.0.1 unless [ft] lighthouse is set.",
    )
    group.add_argument(
        "--tg-restart-budget",
        dest="tg_restart_budget",
        type=int,
        default=None,
        metavar="N",
        help="Job-wide restart budget ([recovery] job_restart_budget): restarts of the job as "
        "a whole, all nodes together; when spent every agent exits 93 (do not requeue). "
        "--max-restarts keeps torchrun's per-agent meaning.",
    )
    group.add_argument(
        "--tg-warm",
        dest="tg_warm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Start restarted workers (and a spare's) from pre-started processes with torch "
        "imported ([warm] enabled, on by default); --no-tg-warm starts every worker cold, as "
        "torchrun.",
    )
    group.add_argument(
        "--tg-role",
        dest="tg_roles",
        action="append",
        default=None,
        metavar="NAME=N[,OPT=V...]:COMMAND",
        help="A fleet of N independent replicas beside the trainer (the workers): NAME is "
        "rollout (generation engines) or reward (scoring servers); COMMAND, quoted, starts one "
        "replica (it serves on $TRAINGUARD_AGENT_ROLE_PORT); OPT: port (base port: replica i uses "
        "port+i), budget (restarts of the role), policy (always, never), health (probe path, "
        "default /health), ready (readiness timeout, s), standby (warm standbys), nodes (under "
        "trainguard sbatch: run on that many nodes of their own; needs port), bind (address "
        "the replicas bind). Repeat for each role (torchrun's --role still names the workers' role); [roles.NAME] in "
        "--config holds the same. The workers get TRAINGUARD_ROLLOUT_URLS / "
        "TRAINGUARD_REWARD_URLS. E.g. --tg-role 'rollout=2:python -m trainguard.rl.engine'",
    )
    return parser


def role_overrides(flags: list[str] | None, base: Any = None) -> dict[str, Any]:
    """``--tg-role`` flags → ``{"roles.<name>": table}`` config overrides; a flag's keys replace
    those of the file's (or env's) table of that role (``base``: the config without the flags).
    UsageError (one line) for a malformed flag or a role given twice."""
    from trainguard.core.config.roles import parse_role_flag

    out: dict[str, Any] = {}
    for flag in flags or []:
        try:
            name, table = parse_role_flag(flag)
        except ValueError as e:
            raise UsageError(str(e)) from None
        key = f"roles.{name}"
        if key in out:
            raise UsageError(f"--tg-role {name}: given twice; one --tg-role flag per role")
        below = dict(getattr(base.roles, name, {}) or {}) if base is not None else {}
        out[key] = {**below, **table}
    return out


def _validate(args: argparse.Namespace) -> None:
    try:
        lo, hi = torchrun.parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--nnodes {args.nnodes!r} is not a node count: use N or MIN:MAX, e.g. --nnodes 2 or --nnodes 1:4"
        ) from None
    if not 0 < lo <= hi:
        raise UsageError(
            f"--nnodes {args.nnodes!r}: use N or MIN:MAX with 0 < MIN <= MAX, e.g. --nnodes 1:4"
        )
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: must be >= 0")
    script = args.training_script
    if args.module:
        return
    if args.no_python and not args.run_path:
        if not (os.path.isfile(script) or shutil.which(script)):
            raise UsageError(f"program {script!r} not found: check the path or PATH")
        return
    if not os.path.isfile(script):
        raise UsageError(
            f"training script {script!r} not found (working directory {os.getcwd()}): check the path"
        )


def _apply_torchrun_defaults(args: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` does to the args before building the LaunchConfig."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _resolve_run_dir(cfg: TrainGuardConfig, run_id: str) -> Path:
    if cfg.runtime.run_dir:
        return Path(cfg.runtime.run_dir)
    name = (
        run_id
        if run_id and run_id != "none"
        else time.strftime("%Y%m%d-%H%M%S-") + str(os.getpid())
    )
    return Path(cfg.runtime.runs_root) / name


def _entrypoint_name(entrypoint: Callable[..., object] | str | None, args: Sequence[str]) -> str:
    # Same rule as torch.distributed.launcher.api._get_entrypoint_name (the report's title).
    if callable(entrypoint):
        return entrypoint.__name__
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((a for a in args if a[0] != "-"), "")
        return entrypoint
    return ""


def _master_addr_port(params: RendezvousParameters) -> tuple[str | None, int | None]:
    # Same rule as torch.distributed.launcher.api._get_addr_and_port.
    if params.backend != "static":
        return None, None
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise UsageError("static rendezvous needs an endpoint: add --master-addr and --master-port")
    addr, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise UsageError(f"port is missing in endpoint {endpoint!r}: add --master-port")
    return addr, port


def _handle_preemption_signals(configured: str, preemption_signals: list[str]) -> list[str]:
    """Handle the preemption signals torch does not (SIGUSR1, which Slurm's ``--signal`` sends,
    would otherwise kill the agent and orphan its workers) the way torch handles its own: raise
    ``SignalException`` in the agent, which forwards the signal to the workers.

    ``TORCHELASTIC_SIGNALS_TO_HANDLE`` keeps torchrun's value: the workers inherit it."""
    names = {n.strip() for n in configured.split(",") if n.strip()}
    added: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        return added
    for name in preemption_signals:
        sig = getattr(signal, name, None)
        if name in names or not isinstance(sig, signal.Signals):
            continue
        signal.signal(sig, _torch.recording_terminate_handler)
        added.append(name)
    return added


def _log_preemption_notice(signum: int, frame: object) -> None:
    logger.warning(
        "trainguard run: %s received; the workers got it from the scheduler too and save "
        "a checkpoint; the agent keeps watching them",
        signal.Signals(signum).name,
    )


def _direct_preemption_signals(configured: str, preemption_signals: list[str]) -> str:
    """The scheduler signals the workers itself (a ``trainguard sbatch`` job): the agent logs
    the preemption signals (a handler, not SIG_IGN, so the workers do not inherit an ignored
    signal) and torch's handler (which would forward them) is left to the others."""
    for sig in preemption_signals:
        try:
            signal.signal(getattr(signal, sig), _log_preemption_notice)
        except (AttributeError, ValueError, OSError):
            logger.warning("cannot handle %s in the agent", sig)
    names = [n.strip() for n in configured.split(",") if n.strip()]
    return ",".join(n for n in names if n not in preemption_signals)


def _worker_spec(
    config: LaunchConfig,
    entrypoint: Callable[..., object] | str,
    args: list[str],
    *,
    node: str,
    preemption_signals: list[str],
    direct_signals: bool = False,
    rdzv_defaults: dict[str, Any] | None = None,
) -> WorkerSpec:
    """torch's WorkerSpec for ``config``, with trainguard's rendezvous handler."""
    rdzv_configs = dict(config.rdzv_configs)
    if config.rdzv_backend == etcd_v3.BACKEND_NAME:
        # [rendezvous] config fills in what --rdzv-conf leaves out
        rdzv_configs = {**(rdzv_defaults or {}), **rdzv_configs}
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **rdzv_configs,
    )
    master_addr, master_port = _master_addr_port(params)
    _torch.forget_signals_raised()  # this agent's own, from here on
    if direct_signals:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _direct_preemption_signals(
            config.signals_to_handle, preemption_signals
        )
    else:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
        _handle_preemption_signals(config.signals_to_handle, preemption_signals)
    etcd_v3.register()
    try:
        inner = rdzv_registry.get_rendezvous_handler(params)
    except etcd_v3.EtcdV3ConfigError as e:
        raise UsageError(str(e)) from None
    handler = AttemptRendezvousHandler(inner, node=node)
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )


@dataclass
class Outcome:
    """How one node's agent ended.

    ``state`` (the ``job_finished`` event and the plugins' ``on_finish`` get it): ``SUCCEEDED``,
    ``FAILED``, ``REQUEUE``, ``DO_NOT_REQUEUE``, ``RENDEZVOUS_LOST``, ``SPARE_RELEASED``, the
    signal that stopped the agent (``SIGTERM``..., ``SIGNALLED``), or a plugin's
    ``AgentExit.state`` (``EXCLUDED``, ``EVICTED``, ``DO_NOT_REQUEUE``, ``FAILED``).
    """

    state: JobState
    error: BaseException | None = None
    """What ``launch`` raises (torch's ChildFailedError, SignalException, NodeUnhealthyError...)."""
    return_values: dict[int, Any] = field(default_factory=dict)
    shutdown_rdzv: bool = True
    """False when the others go on without this node (signal, exclusion): the rendezvous stays."""

    def __post_init__(self) -> None:
        self.state = JobState(self.state)  # a plugin's AgentExit may name it as a string


def _run_agent(agent: TrainGuardAgent, config: LaunchConfig, name: str) -> Outcome:
    """Run the agent to completion and classify how it ended; raises nothing but BaseExceptions
    that are not Exceptions (KeyboardInterrupt, SystemExit)."""
    try:
        torch_metrics.initialize_metrics(torch_metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
    except SignalException as e:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        # A preemption notice reaches the agent too: if every worker saved and asked to be
        # requeued, that is what happened, not torch's signal error.
        state = (
            JobState.REQUEUE
            if agent.requeue_after_signal(e.sigval.name)
            else JobState.of_signal(e.sigval.name)
        )
        return Outcome(state, error=e, shutdown_rdzv=False)
    except AgentExit as e:
        # A plugin ended this agent: the node leaves (health, eviction; the rendezvous stays
        # open for the others), or the whole job stops (recovery policy; it is closed).
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        return Outcome(e.state, error=e, shutdown_rdzv=e.close_rendezvous)
    except RendezvousConnectionError as e:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        if agent.attempt >= 0:
            if config.rdzv_backend == "c10d":
                store = getattr(agent.worker_group.spec.rdzv_handler, "job_store", None)
                print(c10d_store_failure(config.rdzv_endpoint, store, e), file=sys.stderr)
            return Outcome(JobState.FAILED, error=e)
        # A spare that never joined a round: its rendezvous store went away, which is how a
        # job that ended without it (or lost its store host) looks from the waiting list.
        print(
            "trainguard run: the rendezvous store closed while this node waited as a spare "
            "(the job ended without it, or the store's host failed); nothing to save",
            file=sys.stderr,
            flush=True,
        )
        return Outcome(JobState.RENDEZVOUS_LOST, shutdown_rdzv=False)
    except Exception as e:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        return Outcome(JobState.FAILED, error=e)
    if result is None:
        # torch returns nothing for a node that waited in the rendezvous's redundancy list
        # (a spare) when the job ended without it.
        return Outcome(JobState.SPARE_RELEASED)
    torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
    if result.is_failed() and agent.requeue:
        return Outcome(JobState.REQUEUE)
    if result.is_failed() and agent.do_not_requeue:
        return Outcome(JobState.DO_NOT_REQUEUE)
    if result.is_failed():
        return Outcome(JobState.FAILED, error=ChildFailedError(name=name, failures=result.failures))
    if result.state == WorkerState.UNHEALTHY:
        # torch hands an UNHEALTHY group back when no restarts are left, and its is_failed()
        # is False: report it like a failure instead of a success.
        failures = result.failures or agent.unhealthy_failures()
        return Outcome(JobState.FAILED, error=ChildFailedError(name=name, failures=failures))
    return Outcome(JobState.SUCCEEDED, return_values=result.return_values)


def c10d_store_failure(endpoint: str, store: object, error: BaseException) -> str:
    """What an agent says when a call to the c10d rendezvous store failed after it joined a
    round: the store's host is gone, or, when this process hosts the store and it still
    listens, this agent's own connection to it failed; either way with the store's own error
    (the cause under torch's RendezvousConnectionError)."""
    cause = error.__cause__ or error
    text = str(cause).strip().splitlines()
    what = f"{type(cause).__name__}: {text[0][:300] if text else ''}"
    port = getattr(store, "port", None)
    if isinstance(port, int) and listens_here(port):
        return (
            f"trainguard run: this agent hosts the c10d rendezvous store ({endpoint}, port "
            f"{port}) and it still listens, but this agent's own connection to it failed: {what}"
        )
    return f"{spares.C10D_STORE_LOST.format(endpoint=endpoint)}\n  the store call failed: {what}"


def listens_here(port: int) -> bool | None:
    """Whether a socket of this process listens on TCP ``port`` (None: cannot tell, no /proc)."""
    inodes: set[str] = set()
    tables = [t for t in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(t)]  # IPv6 or not
    if not tables:
        return None
    try:
        for table in tables:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
            for row in rows:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(cols[9])
        if not inodes:
            return False
        for fd in os.listdir("/proc/self/fd"):
            try:
                link = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
        return False
    except (OSError, ValueError, IndexError):
        return None


def _conclude(outcome: Outcome, name: str) -> dict[int, Any]:
    """The one place an outcome becomes launch's result: return values, or the exception that
    ``trainguard run`` turns into its exit code (requeue: ``REQUEUE_EXIT_CODE``; a failure:
    torch's ChildFailedError report, exit 1; a signal: torch's SignalException; a plugin's
    AgentExit: one line and its exit code (exclusion 1, eviction 94, job stop 93))."""
    if outcome.state is JobState.REQUEUE:
        print(
            f"trainguard run: the workers of {name} saved a preemption checkpoint and exited "
            f"with {REQUEUE_EXIT_CODE}; exiting with {REQUEUE_EXIT_CODE} so the scheduler "
            "requeues the job",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(REQUEUE_EXIT_CODE) from None
    if outcome.state is JobState.DO_NOT_REQUEUE and outcome.error is None:
        # a worker's own exit 93 (an AgentExit with this state carries its own line)
        print(
            f"trainguard run: a worker of {name} exited with {DO_NOT_REQUEUE_EXIT_CODE} (do not "
            f"requeue; its own message says why); not restarted, exiting with "
            f"{DO_NOT_REQUEUE_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(DO_NOT_REQUEUE_EXIT_CODE) from None
    if outcome.error is not None:
        raise outcome.error
    return outcome.return_values


def _exit_hooks(plugins: list[AgentPlugin], ctx: AgentContext, outcome: Outcome) -> Outcome:
    """Let the plugins replace how the agent ends (``AgentPlugin.on_exit``)."""
    for p in plugins:
        try:
            error = p.on_exit(ctx, outcome.state, outcome.error)
        except Exception:
            logger.exception("plugin %s failed in on_exit", p.name)
            continue
        if isinstance(error, AgentExit):
            return Outcome(error.state, error=error, shutdown_rdzv=error.close_rendezvous)
    return outcome


def _finish_plugins(plugins: list[AgentPlugin], ctx: AgentContext, state: JobState) -> None:
    for p in plugins:
        try:
            p.on_finish(ctx, state)
        except Exception:
            logger.exception("plugin %s failed in on_finish", p.name)
        try:
            p.close()
        except Exception:
            logger.exception("plugin %s failed in close", p.name)


def _announce_chaos(events: EventLog) -> None:
    """Injected faults never arm silently: one warning line and a ``chaos_armed`` event."""
    faults = chaos.check_env()
    if not faults:
        return
    described = [f.describe() for f in faults]
    logger.warning("%s is set: faults will be injected: %s", chaos.CHAOS_ENV, "; ".join(described))
    events.emit("chaos_armed", spec=os.environ.get(chaos.CHAOS_ENV, ""), faults=described)


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., object] | str,
    args: list[str],
    *,
    tg_config: TrainGuardConfig,
    run_dir: Path,
    plugin_factory: PluginFactory | None = None,
) -> dict[int, Any]:
    """Run one node's agent to completion; mirrors ``torch.distributed.launcher.api.launch_agent``."""
    cheap_rendezvous_event_names()  # the same event names, without reading the stack's source
    events = EventLog(run_dir)
    ctx = AgentContext(config=tg_config, run_dir=run_dir, events=events, launch_config=config)
    name = _entrypoint_name(entrypoint, args)
    spec = _worker_spec(
        config,
        entrypoint,
        args,
        node=events.node,
        preemption_signals=tg_config.checkpoint.preemption_signals,
        direct_signals=tg_config.runtime.preemption_signals_direct,
        rdzv_defaults=tg_config.rendezvous.rdzv_conf(),
    )
    ctx.job_store = getattr(spec.rdzv_handler, "job_store", None)
    etcd_v3.report_rdzv_events(getattr(spec.rdzv_handler, "_inner", None), events.emit)
    spare_ctl = spares.attach(spec.rdzv_handler, tg_config.spares, events.emit)
    if isinstance(entrypoint, str):
        ctx.worker_argv = (entrypoint, *map(str, args))
    plugins = plugin_factory(ctx) if plugin_factory else []
    agent = TrainGuardAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        ctx=ctx,
        plugins=plugins,
    )
    events.set_context(agent.event_context)
    events.emit(
        "launch",
        run_id=config.run_id,
        entrypoint=name,
        args=list(args),
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        rdzv_backend=config.rdzv_backend,
        max_restarts=config.max_restarts,
        pid=os.getpid(),
        process_start=process_start_time(),
    )
    _announce_chaos(events)
    mark = hold_mark(run_dir)  # this process is an agent of run_dir (trainguard chaos checks it)
    resume_gc()  # the command line held it off while the agent imported and set up
    outcome = Outcome(JobState.FAILED)
    try:
        outcome = _exit_hooks(plugins, ctx, _run_agent(agent, config, name))
        handler = spec.rdzv_handler
        if outcome.state is JobState.EVICTED and agent.attempt >= 0:
            assert isinstance(handler, AttemptRendezvousHandler)  # what _worker_spec builds
            handler.leave()  # the others go on at once, without this node
    finally:
        # restarts: the job-wide worker-group restarts so far (the attempt of the last round)
        events.emit("job_finished", state=outcome.state.value, restarts=max(agent.attempt, 0))
        _finish_plugins(plugins, ctx, outcome.state)
        if spare_ctl is not None:
            spare_ctl.close()  # a tombstone: the others remove this node at once
        if outcome.shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        release_mark(mark)
    if agent.attempt >= 0:
        _print_recovery_summary(run_dir)
    return _conclude(outcome, name)


def _print_recovery_summary(run_dir: Path) -> None:
    """What failed and how the job recovered, in a few lines (never raises)."""
    from trainguard.runtime.registry import recovery_summary

    try:
        lines = recovery_summary(run_dir)
    except Exception as e:  # a summary must never turn a finished job into a failure
        logger.warning("no recovery summary: %s", e)
        return
    print("\n".join(lines), file=sys.stderr, flush=True)


def load_tg_config(args: argparse.Namespace) -> TrainGuardConfig:
    """The trainguard config of parsed ``trainguard run`` options (``--config`` and the
    ``--tg-*`` flags over it); UsageError/ConfigError on bad input."""
    overrides = {
        "runtime.run_dir": args.tg_run_dir,
        "ft.enabled": getattr(args, "tg_ft", None),
        "recovery.job_restart_budget": getattr(args, "tg_restart_budget", None),
        "warm.enabled": getattr(args, "tg_warm", None),
    }
    role_flags = getattr(args, "tg_roles", None)
    if role_flags:
        role_overrides(role_flags)  # a malformed flag is its own line, before the file's errors
        overrides.update(role_overrides(role_flags, load_config(args.tg_config)))
    return load_config(args.tg_config, overrides=overrides)


def prepare(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., object] | str, list[str], TrainGuardConfig, Path]:
    """Validate and resolve everything; raises UsageError/ConfigError on bad input."""
    _validate(args)
    tg_config = load_tg_config(args)
    for spec in tg_config.roles.specs():
        if spec.nodes and not os.environ.get(envvars.SBATCH_ROLE_NODES):
            raise UsageError(
                f"role {spec.name}: nodes = {spec.nodes} runs it on nodes of its own, which "
                "only a trainguard sbatch job allocates; under trainguard run leave nodes out "
                "(the replicas then run beside the trainer on every node)"
            )
        exe = spec.command[0]
        if spec.nodes:
            continue  # it runs on the role's own nodes: their agent checks it there
        if not (shutil.which(exe) or (os.sep in exe and os.path.isfile(exe))):
            raise UsageError(
                f"role {spec.name}: command {exe!r} not found (working directory "
                f"{os.getcwd()}): check the path or PATH of --tg-role / [roles.{spec.name}]"
            )
    if tg_config.roles.router:
        from trainguard.roles.router import check_router_port

        taken = check_router_port(tg_config.roles)  # before anything starts
        if taken is not None:
            raise UsageError(taken)
    _apply_torchrun_defaults(args)
    try:
        config, cmd, cmd_args = torchrun.config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_dir = _resolve_run_dir(tg_config, config.run_id)
    try:
        make_dirs(run_dir, tg_config.runtime.dir_mode_bits)
    except OSError as e:
        raise UsageError(
            f"cannot create run directory {run_dir}: {e.strerror}; set --tg-run-dir"
        ) from None
    effective: dict[str, Any] = {
        "trainguard": tg_config.to_dict(),
        "torchrun": {k: v for k, v in vars(args).items() if not k.startswith("tg_")},
        "run_dir": str(run_dir),
    }
    chain = timeout_chain(
        tg_config, rdzv_configs=dict(config.rdzv_configs), under_slurm="SLURM_JOB_ID" in os.environ
    )
    for line in contradictions(chain):
        logger.warning("%s", line)
    effective["timeouts"] = [link.to_json() for link in chain]
    write_effective(run_dir, effective)
    return config, cmd, cmd_args, tg_config, run_dir


def run(args: argparse.Namespace, *, plugin_factory: PluginFactory | None = None) -> None:
    config, cmd, cmd_args, tg_config, run_dir = prepare(args)
    if plugin_factory is None:
        from trainguard.runtime.registry import default_plugins

        plugin_factory = default_plugins
    lighthouse = None
    if tg_config.ft.enabled:
        from trainguard.runtime.registry import start_ft

        lighthouse = start_ft(tg_config, run_dir)
    try:
        launch(
            config,
            cmd,
            cmd_args,
            tg_config=tg_config,
            run_dir=run_dir,
            plugin_factory=plugin_factory,
        )
    finally:
        if lighthouse is not None:
            lighthouse.stop()


__all__ += ["ConfigError", "load_tg_config", "prepare"]
