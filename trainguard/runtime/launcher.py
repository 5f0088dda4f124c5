"""``trainguard run``: torchrun's parser, ``LaunchConfig`` and elastic agent, plus trainguard.

The flags, their ``PET_*`` env defaults, the worker env contract, restarts, log layout, exit
codes and the root-cause failure report are torch's own: this module reuses
``torch.distributed.run.get_args_parser`` and ``config_from_args`` and composes the same pieces
``torch.distributed.launcher.api.launch_agent`` does, with :class:`TrainGuardAgent` and a
rendezvous handler that gives every attempt a fresh worker store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch.distributed import run as torchrun
from torch.distributed.elastic import events as torch_events
from torch.distributed.elastic import metrics as torch_metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from trainguard.core.config import ConfigError, TrainGuardConfig, load_config
from trainguard.core.events import EventLog
from trainguard.core.failures import REQUEUE_EXIT_CODE
from trainguard.core.plugin import AgentPlugin
from trainguard.runtime import etcd_v3
from trainguard.runtime.agent import NodeUnhealthyError, TrainGuardAgent
from trainguard.runtime.rendezvous import AttemptRendezvousHandler

__all__ = ["UsageError", "build_parser", "launch", "run"]

logger = logging.getLogger(__name__)

PluginFactory = Callable[[TrainGuardConfig, Path, EventLog], list[AgentPlugin]]


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
        metavar="TRAINGUARD_TOML",
        help="trainguard's settings file (sections [runtime], [health], [checkpoint], "
        "[telemetry], [recovery], [rendezvous]); precedence: flag > file > TRAINGUARD_* env > default.",
    )
    group.add_argument(
        "--tg-run-dir",
        dest="tg_run_dir",
        default=None,
        metavar="DIR",
        help="Run directory for events, metrics and reports (default ./trainguard-runs/<run id>).",
    )
    return parser


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


def _entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: Sequence[str]) -> str:
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


def _unhealthy_failures(agent: TrainGuardAgent) -> dict[int, ProcessFailure]:
    """One failure per local worker of a group the agent declared unhealthy (exit code 1)."""
    return {
        w.global_rank: ProcessFailure(
            local_rank=w.local_rank, pid=w.id or -1, exitcode=1, error_file=""
        )
        for w in agent.get_worker_group().workers
    }


def _worker_exitcodes(agent: TrainGuardAgent) -> list[int | None]:
    """Exit codes of the local workers after the agent shut them down (script or function
    entrypoints); empty when none were started."""
    pc = getattr(agent, "_pcontext", None)
    handlers = getattr(pc, "subprocess_handlers", None)
    if handlers:
        return [h.proc.returncode for h in handlers.values()]
    procs = getattr(getattr(pc, "_pc", None), "processes", None)
    if procs:
        return [p.exitcode for p in procs]
    return []


def _requeue_exit(name: str) -> SystemExit:
    print(
        f"trainguard run: the workers of {name} saved a preemption checkpoint and exited with "
        f"{REQUEUE_EXIT_CODE}; exiting with {REQUEUE_EXIT_CODE} so the scheduler requeues the job",
        file=sys.stderr,
        flush=True,
    )
    return SystemExit(REQUEUE_EXIT_CODE)


def _signals_to_handle(configured: str, preemption_signals: list[str]) -> str:
    """torch's handled signals plus the preemption signals the workers save on (SIGUSR1, which
    Slurm's ``--signal`` sends, would otherwise kill the agent and orphan its workers)."""
    names = [n.strip() for n in configured.split(",") if n.strip()]
    for sig in preemption_signals:
        if sig not in names:
            names.append(sig)
    return ",".join(names)


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
    *,
    tg_config: TrainGuardConfig,
    run_dir: Path,
    plugin_factory: PluginFactory | None = None,
) -> dict[int, Any]:
    """Run one node's agent to completion; mirrors ``torch.distributed.launcher.api.launch_agent``."""
    events = EventLog(run_dir)
    name = _entrypoint_name(entrypoint, args)
    rdzv_configs = dict(config.rdzv_configs)
    if config.rdzv_backend == etcd_v3.BACKEND_NAME:
        # [rendezvous] config fills in what --rdzv-conf leaves out
        rdzv_configs = {**tg_config.rendezvous.rdzv_conf(), **rdzv_configs}
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
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = _signals_to_handle(
        config.signals_to_handle, tg_config.checkpoint.preemption_signals
    )
    etcd_v3.register()
    try:
        inner = rdzv_registry.get_rendezvous_handler(params)
    except etcd_v3.EtcdV3ConfigError as e:
        raise UsageError(str(e)) from None
    handler = AttemptRendezvousHandler(inner, node=events.node)
    spec = WorkerSpec(
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
    plugins = plugin_factory(tg_config, run_dir, events) if plugin_factory else []
    agent = TrainGuardAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        tg_config=tg_config,
        run_dir=run_dir,
        events=events,
        plugins=plugins,
    )
    events._context = agent.event_context
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
    )
    shutdown_rdzv = True
    state = "failed"
    try:
        torch_metrics.initialize_metrics(torch_metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed() and agent.requeue:
            state = "requeue"
            raise _requeue_exit(name)
        if result.is_failed():
            raise ChildFailedError(name=name, failures=result.failures)
        if result.state == WorkerState.UNHEALTHY:
            # torch hands an UNHEALTHY group back when no restarts are left, and its
            # is_failed() is False: report it like a failure instead of a success.
            raise ChildFailedError(
                name=name, failures=result.failures or _unhealthy_failures(agent)
            )
        state = "succeeded"
        return result.return_values
    except ChildFailedError:
        raise
    except SignalException as e:
        state = e.sigval.name
        shutdown_rdzv = False
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        codes = _worker_exitcodes(agent)
        if codes and all(c == REQUEUE_EXIT_CODE for c in codes):
            # The signal was a preemption notice and every worker saved and asked to be
            # requeued: say so with their exit code instead of torch's signal error.
            state = "requeue"
            events.emit(
                "requeue",
                exitcode=REQUEUE_EXIT_CODE,
                signal=e.sigval.name,
                message="workers saved a preemption checkpoint and asked to be requeued",
            )
            raise _requeue_exit(name) from None
        raise
    except NodeUnhealthyError:
        # This node leaves (health policy); the rendezvous stays open for the others.
        state = "excluded"
        shutdown_rdzv = False
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        torch_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        events.emit("job_finished", state=state)
        for p in plugins:
            try:
                p.on_finish(agent, state)
            except Exception:
                logger.exception("plugin %s failed in on_finish", p.name)
            try:
                p.close()
            except Exception:
                logger.exception("plugin %s failed in close", p.name)
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def prepare(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str], TrainGuardConfig, Path]:
    """Validate and resolve everything; raises UsageError/ConfigError on bad input."""
    _validate(args)
    tg_config = load_config(args.tg_config, overrides={"runtime.run_dir": args.tg_run_dir})
    _apply_torchrun_defaults(args)
    try:
        config, cmd, cmd_args = torchrun.config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    run_dir = _resolve_run_dir(tg_config, config.run_id)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create run directory {run_dir}: {e.strerror}; set --tg-run-dir"
        ) from None
    effective = {
        "trainguard": tg_config.to_dict(),
        "torchrun": {k: v for k, v in vars(args).items() if not k.startswith("tg_")},
        "run_dir": str(run_dir),
    }
    (run_dir / "config.json").write_text(json.dumps(effective, indent=2, default=str) + "\n")
    return config, cmd, cmd_args, tg_config, run_dir


def run(args: argparse.Namespace, *, plugin_factory: PluginFactory | None = None) -> None:
    config, cmd, cmd_args, tg_config, run_dir = prepare(args)
    if plugin_factory is None:
        from trainguard.runtime.registry import default_plugins

        plugin_factory = default_plugins
    launch(
        config, cmd, cmd_args, tg_config=tg_config, run_dir=run_dir, plugin_factory=plugin_factory
    )


__all__ += ["ConfigError", "prepare"]
