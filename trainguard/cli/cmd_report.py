"""``trainguard report RUN_DIR``: write a self-contained HTML report of a run."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainguard.core.contracts.rundir import RunDir


def main(argv: list[str], *, prog: str = "trainguard report") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir", help="a run directory (contains events.jsonl and metrics/)")
    parser.add_argument(
        "-o", "--output", default=None, help="HTML file (default RUN_DIR/report.html)"
    )
    parser.add_argument(
        "--peak-flops",
        type=float,
        default=None,
        help="peak FLOP/s of one device for MFU (default: the run's config or the device table)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not RunDir(run_dir).events.is_file() and not RunDir(run_dir).metrics_dir.is_dir():
        print(
            f"{prog}: error: {run_dir} has no events.jsonl or metrics/: pass a run directory",
            file=sys.stderr,
        )
        return 2
    if args.peak_flops is not None and args.peak_flops <= 0:
        print(f"{prog}: error: --peak-flops must be > 0", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t0:5.1f} s] {msg}", file=sys.stderr, flush=True)

    from trainguard.telemetry.report import write_report

    try:
        path = write_report(run_dir, args.output, peak_override=args.peak_flops, progress=progress)
    except OSError as e:
        print(f"{prog}: error: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
