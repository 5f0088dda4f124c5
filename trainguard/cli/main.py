"""The ``trainguard`` command: ``trainguard <subcommand> ...``.

Subcommands live in ``trainguard/cli/cmd_<name>.py`` and are imported only when used; each
module has ``main(argv: list[str], *, prog: str) -> int | None``.
"""

from __future__ import annotations

import importlib
import sys

from trainguard.core.procs import pause_gc

__all__ = ["main", "tgrun"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("trainguard.cli.cmd_run", "launch a job; a drop-in for torchrun (same flags)"),
    "health": ("trainguard.cli.cmd_health", "one-shot node health check (exit 0/1/2)"),
    "report": ("trainguard.cli.cmd_report", "write the HTML report of a run directory"),
    "events": ("trainguard.cli.cmd_events", "print the lifecycle events of a run directory"),
    "plan": ("trainguard.cli.cmd_plan", "goodput planner: ETTR, checkpoint intervals, spares"),
    "dashboards": (
        "trainguard.cli.cmd_dashboards",
        "export Grafana dashboards, alert rules, Alertmanager config; push to Grafana",
    ),
    "sbatch": ("trainguard.cli.cmd_sbatch", "write and submit a Slurm job with hot spares"),
    "slurm": ("trainguard.cli.cmd_slurm", "Slurm jobs: status (and the batch script's steps)"),
    "debug": (
        "trainguard.cli.cmd_debug",
        "live view of a running job: every rank's stacks or collectives",
    ),
    "chaos": ("trainguard.cli.cmd_chaos", "inject faults: kill/hang ranks, agents, etcd, XIDs"),
    "fleet": ("trainguard.cli.cmd_fleet", "node history across jobs: nodes, lemons, release"),
    "watch": ("trainguard.cli.cmd_watch", "page when a job goes silent (a watcher outside it)"),
}


def _usage() -> str:
    lines = ["usage: trainguard <command> [args...]", "", "commands:"]
    for name, (_, help_) in SUBCOMMANDS.items():
        lines.append(f"  {name:<10} {help_}")
    lines.append("")
    lines.append("'trainguard <command> --help' shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        from trainguard import __version__

        print(f"trainguard {__version__}")
        return
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"trainguard: error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        sys.exit(2)
    if name == "run":
        pause_gc()  # the launcher turns it back on once it has set up
    module = importlib.import_module(SUBCOMMANDS[name][0])
    code = module.main(rest, prog=f"trainguard {name}")
    if code:
        sys.exit(code)


def tgrun() -> None:
    """The ``tgrun`` command: ``trainguard run``."""
    pause_gc()  # the launcher turns it back on once it has set up
    from trainguard.cli.cmd_run import tgrun_main

    tgrun_main()
