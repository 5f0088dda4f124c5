"""``trainguard run`` / ``tgrun``: the drop-in torchrun."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from torch.distributed.elastic.multiprocessing.errors import record

from trainguard.chaos.faults import check_env as check_chaos_env
from trainguard.core.config import ConfigError
from trainguard.core.plugin import AgentExit
from trainguard.core.procs import exit_now
from trainguard.runtime import launcher

__all__ = ["main", "run_job", "tgrun_main"]


@record
def _run(args: argparse.Namespace) -> None:
    launcher.run(args)


def run_job(argv: list[str] | None = None, *, prog: str = "trainguard run") -> int:
    """Parse torchrun-compatible arguments and run the job; returns its exit code, torchrun's
    (a failure report is printed as torchrun prints it). Bad input, before anything starts:
    one line on stderr and ``SystemExit(2)``."""
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
        return e.exit_code
    except SystemExit as e:  # the requeue codes of a preempted job among them
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # ChildFailedError: the report, as the interpreter would print it
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def main(argv: list[str] | None = None, *, prog: str = "trainguard run") -> NoReturn:
    """``trainguard run``: run the job and exit with its code, like torchrun. The process
    leaves without the interpreter's teardown (:func:`trainguard.core.procs.exit_now`), where
    torch's C++ threads left by a failed or signal-driven run can abort it and turn the code
    (1, an excluded node's, the requeue code) into -6."""
    exit_now(run_job(argv, prog=prog))


def tgrun_main() -> None:
    # Logging stays as torchrun leaves it (torch's elastic loggers print warnings), so the
    # console output of a job does not change when torchrun is replaced.
    main(sys.argv[1:], prog="tgrun")
