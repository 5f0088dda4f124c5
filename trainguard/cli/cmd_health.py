"""``trainguard health``: one-shot node check (dcgm-exporter / DCGM / NVML / host).

Exit code 0 healthy, 1 degraded (warn, or a source could not tell), 2 unhealthy (fail);
usable as a Slurm prolog or ``HealthCheckProgram``. With ``--slurm`` a failing node drains
itself (``scontrol update nodename=$SLURMD_NODENAME state=drain reason="trainguard: health:
..."``; ``[slurm] drain = "record"`` only says so). Slurm drains a node on any non-zero prolog
exit, so a prolog that should drain only unhealthy nodes reads::

    trainguard health --expect-gpus 8 > /var/log/trainguard-health.log; [ $? -lt 2 ]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from trainguard.core.config import ConfigError, load_config

if TYPE_CHECKING:
    from trainguard.health.node import NodeReport
    from trainguard.health.result import ProbeResult


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dcgm-url", default=None, help="dcgm-exporter URL ([health] dcgm_url)")
    p.add_argument("--expect-gpus", type=int, default=None, help="GPUs this node must show")
    p.add_argument("--config", default=None, help="trainguard.toml ([health] section)")
    p.add_argument("--checkpoint-dir", default=None, help="directory whose free space to check")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port that must be reachable")
    p.add_argument("--compute", action="store_true", help="also run the ~1 s GEMM compute probe")
    p.add_argument(
        "--diag", type=int, default=None, metavar="LEVEL", help="also run dcgmi diag -r LEVEL"
    )
    p.add_argument(
        "--slurm",
        action="store_true",
        help="on fail, drain this Slurm node (SLURMD_NODENAME, or --slurm-node) with the reasons",
    )
    p.add_argument("--slurm-node", default=None, help="the Slurm node name to drain")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str], *, prog: str = "trainguard health") -> int:
    args = _parser(prog).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from trainguard.health.node import NodeProbe, build_sources
    from trainguard.health.result import ProbeResult

    try:
        cfg = load_config(
            args.config,
            overrides={"health.expect_gpus": args.expect_gpus, "health.dcgm_url": args.dcgm_url},
        ).health
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    sources = build_sources(
        cfg,
        dcgm_url=args.dcgm_url,
        checkpoint_dir=args.checkpoint_dir,
        rdzv_endpoint=args.rdzv_endpoint,
    )
    probe = NodeProbe(sources)
    try:
        report = probe.probe()
    finally:
        probe.close()
    if args.compute:
        from trainguard.health.compute import gemm_probe
        from trainguard.health.policy import Policy

        res = ProbeResult(source="compute")
        try:
            c = gemm_probe(max(cfg.preflight_compute_s, 0.2))
            res.details.update(c.to_dict())
            frac, peak = c.fraction_of_peak, c.peak_flops_per_s
            if frac is not None and peak is not None and frac < cfg.min_compute_fraction:
                policy = Policy.from_overrides(cfg.xid_policy, cfg.counter_policy)
                res.add(
                    policy.finding(
                        "compute_slow",
                        f"GEMM {c.flops_per_s / 1e12:.1f} TFLOP/s is {frac:.0%} of the "
                        f"{peak / 1e12:.0f} TFLOP/s peak",
                    )
                )
        except Exception as e:
            res = ProbeResult.unknown("compute", f"compute probe failed: {e}")
        report.extra.append(res)
    if args.diag is not None:
        from trainguard.health.dcgm import run_diag

        report.extra.append(run_diag(args.diag))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        _print_table(report)
    if args.slurm and report.exit_code == 2:
        _drain_self(args, report, prog)
    return report.exit_code


def _drain_self(args: argparse.Namespace, report: NodeReport, prog: str) -> None:
    """The node failed its check: drain it in Slurm with the reasons (one line either way)."""
    from trainguard.slurm.cli import make_slurm
    from trainguard.slurm.fencer import SlurmFencer

    node = args.slurm_node or os.environ.get("SLURMD_NODENAME") or report.node
    try:
        cfg = load_config(args.config).slurm
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return
    fencer = SlurmFencer(make_slurm(), record_only=cfg.drain == "record")
    res = fencer.fence(node, "health: " + "; ".join(report.reasons or [report.status.value]))
    print(f"{prog}: {res.detail}", file=sys.stderr)


def _print_table(report: NodeReport) -> None:
    print(f"node {report.node}: {report.status.value.upper()} (action {report.action.value})")
    print(f"  {report.note()}")
    print(f"  {'source':<14} {'status':<8} {'action':<8} detail")
    for r in report.results + report.extra:
        if not r.present:
            print(f"  {r.source:<14} {'-':<8} {'-':<8} not present: {r.error}")
            continue
        detail = "; ".join(r.reasons) or _brief(r)
        print(f"  {r.source:<14} {r.status.value:<8} {r.action.value:<8} {detail}")
    gpus = next((r.gpus for r in report.results if r.present and r.gpus), {})
    if gpus:
        print(f"  {'gpu':<4} {'model':<28} {'temp':>5} {'xid':>4} {'dbe':>4}  uuid")
        for gpu, g in gpus.items():
            print(
                f"  {gpu:<4} {str(g.get('model', '?'))[:28]:<28} "
                f"{g.get('temp_c', float('nan')):>5.0f} {int(g.get('xid', 0) or 0):>4} "
                f"{int(g.get('ecc_dbe_volatile', 0) or 0):>4}  {g.get('uuid', '?')}"
            )


def _brief(r: ProbeResult) -> str:
    d = r.details
    if r.source == "host":
        return f"disk {d.get('disk_free_gib')} GiB free, memory {d.get('memory_available_gib')} GiB available"
    if r.source == "compute":
        return f"{d.get('tflops')} TFLOP/s ({d.get('device')}, {d.get('dtype')})"
    return f"{len(r.gpus)} GPUs" if r.gpus else "ok"
