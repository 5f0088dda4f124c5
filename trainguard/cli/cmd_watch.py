"""``trainguard watch RUN_DIR``: a watcher outside the job that pages when it goes silent.

It reads the agents' heartbeats and ``events.jsonl`` of RUN_DIR and pages through the
configured pager (``[alerts]`` of ``--config`` and ``TRAINGUARD_ALERTS_*``, as the job's own
agents do) when no agent was heard from for the silence limit, when every agent is gone
without a final event, or when the job has not started within ``--queued-limit``. It exits 0
once the job ended with its final events, 3 when the job was lost. ``trainguard sbatch``
starts one on the batch host beside the job step.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from trainguard.core.config import ConfigError, load_config
from trainguard.dashboards.pager import Pager, read_secret
from trainguard.dashboards.watch import EXIT_LOST, Watcher, silence_for


def main(argv: list[str], *, prog: str = "trainguard watch") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_dir", help="the job's run directory (--tg-run-dir)")
    p.add_argument("--config", default=None, help="trainguard.toml (its [alerts] section)")
    p.add_argument("--queued-limit", type=float, default=None, metavar="S",
                   help="page when no agent started S seconds after the watcher did")  # fmt: skip
    p.add_argument("--slurm-job", default=None, metavar="ID",
                   help="with --queued-limit: page only while this Slurm job is PENDING")  # fmt: skip
    p.add_argument("--poll", type=float, default=1.0, metavar="S", help="seconds between looks")
    p.add_argument("--if-configured", action="store_true",
                   help="exit 0 at once where no pager is configured (the batch script's "
                   "watcher)")  # fmt: skip
    p.add_argument("--step-ended", type=int, default=None, metavar="RC",
                   help="the job step just ended with exit code RC: page if it ended without "
                   "every agent's final event, then exit (0, or 3 when it did)")  # fmt: skip
    p.add_argument("--once", action="store_true",
                   help="look once, print the state as JSON and exit (0 running or finished, "
                   "1 silent or waiting, 3 lost); pages nothing")  # fmt: skip
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainguard watch: %(message)s")
    try:
        cfg = load_config(args.config).alerts
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.poll <= 0 or (args.queued_limit is not None and args.queued_limit <= 0):
        print(f"{prog}: error: --poll and --queued-limit must be > 0 seconds", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        print(f"{prog}: error: {run_dir} is not a directory: pass the job's run directory",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.once:
        v = Watcher(run_dir, cfg, None).look()
        print(json.dumps({"state": v.state, "message": v.message, **v.seen}, default=str))
        return {"running": 0, "finished": 0, "lost": 3}.get(v.state, 1)
    if not cfg.webhook_url:
        if args.if_configured:
            return 0
        print(f"{prog}: error: no pager configured: set [alerts] webhook_url (--config) or "
              "TRAINGUARD_ALERTS_WEBHOOK_URL", file=sys.stderr)  # fmt: skip
        return 2
    pager = Pager(cfg, secret=read_secret(cfg))
    watcher = Watcher(run_dir, cfg, pager, queued_limit_s=args.queued_limit,
                      slurm_job=args.slurm_job)  # fmt: skip
    if args.step_ended is not None:
        v = watcher.step_ended(args.step_ended)
        pager.close()
        logging.info("the job step ended (exit %d): %s", args.step_ended, v.message)
        return EXIT_LOST if v.state == "lost" else 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    logging.info("watching %s (silence limit %.0f s), paging %s", run_dir, silence_for(cfg),
                 pager.shown_url)  # fmt: skip
    try:
        code = watcher.run_until_done(args.poll, stop)
    except KeyboardInterrupt:
        code = 0
    finally:
        pager.close()
    logging.info("done: %s", "the job was lost" if code else "the job ended")
    return code
