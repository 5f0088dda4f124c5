"""``trainguard dashboards export DIR`` / ``check DIR`` / ``push --url URL``.

export writes the Grafana dashboards, the Prometheus alert rules with their promtool tests and
the Alertmanager template (the top-level ``dashboards/`` of the repository is this output);
check exits 1 when DIR differs from a fresh export; push uploads the dashboards to Grafana
(token from $TRAINGUARD_GRAFANA_TOKEN or --token-file, never the command line).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str], *, prog: str = "trainguard dashboards") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="write dashboards, alert rules and Alertmanager config")
    ex.add_argument("dir", help="output directory (e.g. dashboards)")
    ck = sub.add_parser("check", help="exit 1 when DIR differs from a fresh export")
    ck.add_argument("dir")
    pu = sub.add_parser("push", help="upload the dashboards to Grafana (idempotent by uid)")
    pu.add_argument("--url", required=True, help="Grafana base URL, e.g. http://grafana:3000")
    pu.add_argument(
        "--token-file",
        default=None,
        help="file holding the API token (default: $TRAINGUARD_GRAFANA_TOKEN)",
    )
    pu.add_argument("--folder", default="trainguard", help="folder uid and title (trainguard)")
    pu.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify Grafana's TLS certificate (anyone on the path can read the token)",
    )
    args = parser.parse_args(argv)

    try:
        from trainguard.dashboards.export import diff, render, write
    except ImportError as e:
        print(f"{prog}: error: {e.name} is missing: pip install 'trainguard[dashboards]'",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.action == "export":
        try:
            changed = write(args.dir)
        except OSError as e:
            print(f"{prog}: error: cannot write {args.dir}: {e.strerror}", file=sys.stderr)
            return 1
        print(f"{len(render())} files in {args.dir} ({len(changed)} changed)")
        return 0
    if args.action == "check":
        stale = diff(args.dir)
        for rel in stale:
            print(f"{args.dir}/{rel} differs from the generated file", file=sys.stderr)
        if stale:
            print(f"run: trainguard dashboards export {args.dir}", file=sys.stderr)
        return 1 if stale else 0

    from trainguard.dashboards.push import PushError, push_dashboards, read_token

    if not args.url.startswith(("http://", "https://")):
        print(f"{prog}: error: --url must start with http:// or https://", file=sys.stderr)
        return 2
    if args.insecure:
        print(f"{prog}: warning: --insecure: Grafana's TLS certificate is not verified; anyone "
              "on the path can read the token", file=sys.stderr)  # fmt: skip
    try:
        token = read_token(args.token_file)
        files = {k: v for k, v in render().items() if k.startswith("grafana/")}
        res = push_dashboards(
            args.url, token, files, folder_uid=args.folder, folder_title=args.folder,
            verify_tls=not args.insecure,
        )  # fmt: skip
    except PushError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    made = "created" if res.folder_created else "existing"
    for uid, url in res.dashboards.items():
        print(f"{uid}: {url or '(no url)'} in {made} folder {res.folder_uid}")
    return 0
