"""``trainguard debug RUN_DIR stacks|collectives [--ranks 0,3]``: a live view of a running job.

Every worker of a trainguard job runs a small watcher thread (started before the script) that
answers dump requests: all threads' Python stacks and its flight-recorder trace, written as
files into ``RUN_DIR/debug/<id>/``. Nothing stops, nothing is signalled, no collective is
issued; ranks that do not answer within the timeout (a process that holds the GIL in C code,
a stopped one) are listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
import time
from pathlib import Path

from trainguard.core.atomicfile import make_dirs, owned_dir, write_atomic
from trainguard.core.contracts.rundir import DumpDir, RunDir
from trainguard.health.hangcollect import read_json, wait_for_files
from trainguard.health.hangdiag import RankDump, analyse
from trainguard.health.stacktext import aggregate_stacks


def _current_ranks(run_dir: Path) -> tuple[int, list[int]]:
    """The newest attempt and the ranks that have a progress record in it."""
    attempts = RunDir(run_dir).attempts()
    if not attempts:
        return -1, []
    attempt = attempts[-1]
    ranks = set()
    for f in RunDir(run_dir).progress(attempt).glob("*rank_*.bin"):
        m = re.search(r"rank_(\d+)\.bin$", f.name)
        if m:
            ranks.add(int(m.group(1)))
    return attempt, sorted(ranks)


def _parse_ranks(text: str | None) -> set[int] | None:
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def collect(run_dir: Path, ranks: list[int], timeout_s: float) -> tuple[DumpDir, dict[int, Path]]:
    """Ask the job's workers for a dump; return the directory and the ranks that answered."""
    # a fresh directory of this user's (mkdir fails on anything planted at its name), with a
    # random part: the workers write only into request directories that are the job user's
    rd = RunDir(run_dir)
    d = rd.debug(f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(4)}")
    make_dirs(rd.debug_root)
    if not owned_dir(rd.debug_root):
        raise OSError(f"{rd.debug_root} is a symlink or not this user's directory")
    d.path.mkdir(mode=0o700)
    req = d.request()
    write_atomic(req, json.dumps({"time": time.time()}))
    try:
        return d, wait_for_files({r: d.fr_trace(r) for r in ranks}, time.monotonic() + timeout_s)
    finally:
        req.unlink(missing_ok=True)  # a later worker must not answer a finished request


def main(argv: list[str], *, prog: str = "trainguard debug") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir", help="the run directory of a running job")
    parser.add_argument("view", choices=["stacks", "collectives"])
    parser.add_argument("--ranks", help="ranks to show, e.g. 0,3 or 0-7 (default: all)")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait (4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        wanted = _parse_ranks(args.ranks)
    except ValueError:
        print(f"{prog}: error: --ranks {args.ranks!r}: use e.g. 0,3 or 0-7", file=sys.stderr)
        return 2
    attempt, ranks = _current_ranks(run_dir)
    if attempt < 0 or not ranks:
        print(
            f"{prog}: error: no running workers found in {run_dir} (no progress records): "
            "pass the run directory of a job started with `trainguard run`",
            file=sys.stderr,
        )
        return 2
    ranks = [r for r in ranks if wanted is None or r in wanted]
    t0 = time.monotonic()
    try:
        d, got = collect(run_dir, ranks, args.timeout)
    except OSError as e:
        print(f"{prog}: error: cannot ask {run_dir}'s workers for a dump: {e}", file=sys.stderr)
        return 2
    took = time.monotonic() - t0
    dumps: dict[int, RankDump] = {}
    for r, path in got.items():
        trace = read_json(path) or {}
        try:
            stack = d.stacks(r).read_text(encoding="utf-8")
        except OSError:
            stack = ""
        dumps[r] = RankDump.from_trace(r, trace.get("trainguard", {}).get("host", "?"), trace,
                                       stack=stack)  # fmt: skip
    silent = sorted(set(ranks) - set(got))
    if args.view == "stacks":
        groups = aggregate_stacks({r: x.stack for r, x in dumps.items()})
        if args.json:
            print(json.dumps({"attempt": attempt, "stacks": groups, "no_answer": silent,
                              "collect_s": round(took, 3)}))  # fmt: skip
            return 0
        for g in groups:
            print(f"=== ranks {_fmt(g['ranks'])} ({len(g['ranks'])}) ===\n{g['stack']}\n")
    else:
        diag = analyse(dumps)
        if args.json:
            print(json.dumps({"attempt": attempt, **diag.to_json(), "no_answer": silent,
                              "collect_s": round(took, 3)}))  # fmt: skip
            return 0
        for g in diag.groups:
            where = f"in {g['op']} #{g['entered']}" if g["in_flight"] else "between collectives"
            print(
                f"ranks {_fmt(g['ranks'])}: pg {g['pg']} {where}, last completed #{g['completed']}"
            )
        for f in diag.frames:
            print(f"ranks {_fmt(f['ranks'])}: main thread at {f['frame']}")
    if silent:
        print(f"no answer within {args.timeout:g}s from ranks {_fmt(silent)}")
    print(f"({len(got)} of {len(ranks)} ranks answered in {took:.2f}s, attempt {attempt})")
    return 0


def _fmt(ranks: list[int]) -> str:
    return "{" + ",".join(str(r) for r in ranks) + "}"
