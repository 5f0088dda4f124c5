"""``trainguard run`` / ``tgrun``: the drop-in torchrun."""

from __future__ import annotations

import argparse
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from trainguard.core.config import ConfigError
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


def tgrun_main() -> None:
    # Logging stays as torchrun leaves it (torch's elastic loggers print warnings), so the
    # console output of a job does not change when torchrun is replaced.
    main(sys.argv[1:], prog="tgrun")
