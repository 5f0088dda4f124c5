"""``trainguard events RUN_DIR``: print a run's lifecycle events, one per line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainguard.core.events import EVENTS_FILE, read_events


def main(argv: list[str], *, prog: str = "trainguard events") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir", help="a run directory (contains events.jsonl)")
    parser.add_argument("--json", action="store_true", help="print raw JSON lines")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / EVENTS_FILE).is_file():
        print(
            f"{prog}: error: no {EVENTS_FILE} in {args.run_dir}: pass a run directory",
            file=sys.stderr,
        )
        return 2
    for ev in read_events(args.run_dir):
        if args.json:
            print(json.dumps(ev))
            continue
        t = time.strftime("%H:%M:%S", time.localtime(ev.get("time", 0)))
        rest = {k: v for k, v in ev.items() if k not in ("time", "kind", "node", "attempt")}
        print(
            f"{t} {ev.get('node', '?'):<12} a{ev.get('attempt', 0)} {ev.get('kind', '?'):<18} {json.dumps(rest, default=str)}"
        )
    return 0
