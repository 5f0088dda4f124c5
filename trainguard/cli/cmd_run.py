"""``trainguard run`` / ``tgrun``: the drop-in torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from trainguard.core.config import ConfigError
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, REQUEUE_EXIT_CODE
from trainguard.core.plugin import AgentExit
from trainguard.runtime import launcher
from trainguard.testing.chaos import check_env as check_chaos_env

__all__ = ["main", "tgrun_main"]


@record
def _run(args: argparse.Namespace) -> None:
    launcher.run(args)


def main(argv: list[str] | None = None, *, prog: str = "trainguard run") -> None:
    """Parse torchrun-compatible arguments and run the job; exits like torchrun."""
    parser = launcher.build_parser(prog)
    args = parser.parse_args(argv)
    try:
        check_chaos_env()  # a bad TRAINGUARD_CHAOS stops the launch, not every worker
        _run(args)
    except (launcher.UsageError, ConfigError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except AgentExit as e:  # the node left, or the job stopped (policy): one line, its code
        print(f"{prog}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except SystemExit as e:
        if e.code in (REQUEUE_EXIT_CODE, DO_NOT_REQUEUE_EXIT_CODE):
            _exit_now(e.code)
        raise


def _exit_now(code: int) -> None:
    """Leave with the job's final code once its line is printed and every plugin has finished:
    without the interpreter's teardown, where torch's C++ threads left by a signal-driven
    shutdown can abort the process (SIGABRT, "terminate called without an active exception")
    after the requeue was decided, turning exit 75 into -6."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def tgrun_main() -> None:
    # Logging stays as torchrun leaves it (torch's elastic loggers print warnings), so the
    # console output of a job does not change when torchrun is replaced.
    main(sys.argv[1:], prog="tgrun")
