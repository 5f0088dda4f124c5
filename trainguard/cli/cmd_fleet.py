"""``trainguard fleet``: the node history shared by every job, and lemon nodes.

    trainguard fleet nodes              every node: incidents in the window, records, lemon
    trainguard fleet lemons             only the lemons (refused by every new job)
    trainguard fleet history NODE       a node's records
    trainguard fleet release NODE       an operator's release: its count starts again
    trainguard fleet release NODE --slurm   ... and, once this node's health check passes,
                                            resume it in Slurm if trainguard drained it
                                            (run it on the node: srun -w NODE ...)
    trainguard fleet grant --nodes ROLE     PostgreSQL, as the tables' owner: the node roles'
                                            group may read and add records, [fleet]
                                            operator_role may release

The database is ``[fleet] url`` (``--config``, ``TRAINGUARD_FLEET_URL``), else
``<runs_root>/fleet.db``. With ``[fleet] node_role``, ``release`` logs in as ``[fleet]
operator_role``. Exit code 0; 2 on a bad setting or an unusable database (one line).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time

from trainguard.core.config import ConfigError, load_config


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="trainguard.toml ([fleet] section)")
    p.add_argument("--url", default=None, help="the fleet database ([fleet] url)")
    p.add_argument("--json", action="store_true", help="JSON instead of a table")
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("nodes", help="every node")
    sub.add_parser("lemons", help="the lemon nodes")
    h = sub.add_parser("history", help="a node's records")
    h.add_argument("node")
    r = sub.add_parser("release", help="release a node (after its repair)")
    r.add_argument("node")
    r.add_argument("--reason", default="released by an operator")
    r.add_argument(
        "--slurm",
        action="store_true",
        help="run this node's health check, then resume NODE in Slurm (scontrol, operator rights)",
    )
    r.add_argument("--force", action="store_true", help="resume a node drained by someone else")
    g = sub.add_parser("grant", help="PostgreSQL: grant the node roles and the operator role")
    g.add_argument("--nodes", required=True, help="the role every node role is a member of")
    return p


def _health_check(full: object) -> tuple[bool, str]:
    """This node's health check (``trainguard health``'s probes): passed, and one line."""
    from trainguard.health.node import NodeProbe, build_sources
    from trainguard.health.result import Status

    cfg = full.health  # type: ignore[attr-defined]
    report = NodeProbe(build_sources(cfg)).probe()
    passed = report.status is not Status.FAIL
    why = "; ".join(report.reasons) if getattr(report, "reasons", None) else report.status.value
    return passed, why


def _resume(node: str, full: object, force: bool) -> int:
    from trainguard.slurm.cli import SlurmError, make_slurm
    from trainguard.slurm.fencer import resume_node

    passed, why = _health_check(full)
    if not passed:
        print(f"node {node} not resumed in Slurm: its health check failed: {why}", file=sys.stderr)
        return 1
    try:
        print(resume_node(make_slurm(), node, force=force))
    except (SlurmError, OSError) as e:
        print(f"node {node} not resumed in Slurm: {e}", file=sys.stderr)
        return 1
    return 0


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def main(argv: list[str], *, prog: str = "trainguard fleet") -> int:
    args = _parser(prog).parse_args(argv)
    from trainguard.fleet.db import FleetDBError, PostgresFleetDB, open_db, safe_node_name
    from trainguard.fleet.lemons import lemon_status

    try:
        full = load_config(args.config, overrides={"fleet.url": args.url})
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    cfg = full.fleet
    role = cfg.operator_role if args.what == "release" and cfg.node_role else ""
    try:
        opened = open_db(
            cfg.url, runs_root=full.runtime.runs_root, connect_timeout_s=cfg.connect_timeout_s,
            role=role,
        )  # fmt: skip
        with opened as db:
            if args.what == "grant":
                if not isinstance(db, PostgresFleetDB):
                    raise FleetDBError(
                        "grant needs a postgresql:// [fleet] url (SQLite has no roles)"
                    )
                db.grant_roles(nodes=args.nodes, operator=cfg.operator_role)
                print(
                    f"{db.where}: {args.nodes} may read and add records, {cfg.operator_role} may "
                    "release"
                )
                return 0
            if args.what == "release":
                node, _ = safe_node_name(args.node)
                before = lemon_status(db, node, cfg)
                db.release(node, by=getpass.getuser(), reason=args.reason)
                print(
                    f"node {node} released ({before.incidents} incident(s) in the window before; "
                    f"{'was' if before.is_lemon else 'was not'} a lemon)"
                )
                return _resume(node, full, args.force) if args.slurm else 0
            if args.what == "history":
                node, _ = safe_node_name(args.node)
                recs = db.history(node)
                if args.json:
                    print(json.dumps([r.to_dict() for r in recs], indent=2))
                    return 0
                for r in recs:
                    what = r.detail.get("summary") or r.detail.get("reason") or ""
                    print(f"{_when(r.time)}  {r.job:<16} {r.kind:<9} {r.cause:<14} {what}")
                if not recs:
                    print(f"no records of node {node}")
                return 0
            rows = [lemon_status(db, n, cfg) for n in db.nodes()]
            total = {n: len(db.history(n)) for n in db.nodes()}
    except FleetDBError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if args.what == "lemons":
        rows = [s for s in rows if s.is_lemon]
    if args.json:
        out = [
            {"node": s.node, "incidents": s.incidents, "records": total.get(s.node, 0),
             "lemon": s.is_lemon, "history": s.history, "ignored": s.ignored}
            for s in rows
        ]  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    if not rows:
        print("no lemon nodes" if args.what == "lemons" else "no nodes recorded")
        return 0
    print(f"{'node':<24} {'incidents':>9} {'records':>8}  lemon")
    for s in rows:
        print(
            f"{s.node:<24} {s.incidents:>9} {total.get(s.node, 0):>8}  {'yes' if s.is_lemon else 'no'}"
        )
    return 0
