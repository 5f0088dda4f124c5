"""A tiny real HTTP server: the role replica of the role-supervisor tests (a real process).

It serves ``GET /health`` on $TRAINGUARD_AGENT_ROLE_HOST (default 127.0.0.1):$TRAINGUARD_AGENT_ROLE_PORT with the engine contract's
answer, ``{"status": ..., "weight_version": ..., "pid": ..., "incarnation": ...}``, and ``GET /whoami`` with its pid, role and
replica. Behaviour knobs (argv):

--exit-at-once CODE   exit with CODE before serving (a command that exits at once)
--never-ready         listen and answer ``starting`` forever
--loading-s S         answer ``loading`` for S seconds, then ``serving``
--weight-version V    the version it reports (default 0)
--bad-health-after S  after S seconds, answer /health with BAD (below) instead
--bad-health KIND     ``malformed`` (200, not JSON) or ``500`` (HTTP 500)
--close-after S       after S seconds, close the listening socket and stay alive (refuses)
--quarantined S1 S2   answer ``quarantined`` (a refit that failed its check) from S1 to S2
                      seconds after the start (repeatable), ``serving`` otherwise
--ignore-standby      serve as a replica even when started as a standby (a command that does
                      not honour the standby contract)
--squat-incarnation X answer health naming incarnation X ("none": no incarnation): a squatter
--die-after-s S       exit 5, S seconds after its first ``serving`` health answer (an engine
                      that dies after every load, once its supervisor has seen it ready)

Started as a role's warm standby (``$TRAINGUARD_AGENT_ROLE_STANDBY`` set, unless
``--ignore-standby``) it answers ``standby`` on its own port until the promotion file appears,
then serves on the port it names as that replica (``loading`` for ``--loading-s`` first).
``/whoami`` also says its niceness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--exit-at-once", type=int, default=None)
    p.add_argument("--never-ready", action="store_true")
    p.add_argument("--loading-s", type=float, default=0.0)
    p.add_argument("--weight-version", type=int, default=0)
    p.add_argument("--bad-health-after", type=float, default=None)
    p.add_argument("--bad-health", choices=("malformed", "500"), default="malformed")
    p.add_argument("--close-after", type=float, default=None)
    p.add_argument("--ignore-standby", action="store_true")
    p.add_argument("--squat-incarnation", default=None)
    p.add_argument("--die-after-s", type=float, default=None)
    p.add_argument("--quarantined", type=float, nargs=2, action="append", default=[])
    args = p.parse_args()
    if args.exit_at_once is not None:
        print("role_replica: exiting at once", flush=True)
        sys.exit(args.exit_at_once)
    port = int(os.environ["TRAINGUARD_AGENT_ROLE_PORT"])
    host = os.environ.get("TRAINGUARD_AGENT_ROLE_HOST") or "127.0.0.1"
    started = time.monotonic()
    ident: dict[str, object] = {
        "pid": os.getpid(),
        "role": os.environ.get("TRAINGUARD_AGENT_ROLE"),
        "replica": os.environ.get("TRAINGUARD_AGENT_ROLE_REPLICA"),
        "run_dir": os.environ.get("TRAINGUARD_RUN_DIR"),
        "token": os.environ.get("TRAINGUARD_AGENT_ROLE_TOKEN"),
        "host": host,
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
    }
    incarnation = os.environ.get("TRAINGUARD_AGENT_ROLE_INCARNATION")
    if args.squat_incarnation:  # a squatter: another process's identity, or none at all
        incarnation = None if args.squat_incarnation == "none" else args.squat_incarnation
    promote = os.environ.get("TRAINGUARD_AGENT_ROLE_STANDBY")
    standby = bool(promote) and not args.ignore_standby
    answered_serving = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            bad = args.bad_health_after is not None and (
                time.monotonic() - started >= args.bad_health_after
            )
            if self.path == "/health" and bad and args.bad_health == "500":
                self.send_error(500)
                return
            if self.path == "/health" and bad:
                data = b'{"status": "serving", "weight_version'
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            me = {"pid": os.getpid(), "incarnation": incarnation}
            if self.path == "/health" and standby:
                body: dict[str, object] = {"status": "standby", "weight_version": None, **me}
            elif self.path == "/health":
                if args.never_ready:
                    status = "starting"
                elif time.monotonic() - started < args.loading_s:
                    status = "loading"
                else:
                    status = "serving"
                age = time.monotonic() - started
                if any(a <= age < b for a, b in args.quarantined):
                    status = "quarantined"
                body = {"status": status, "weight_version": args.weight_version, **me}
            elif self.path == "/whoami":
                body = {**ident, "nice": os.getpriority(os.PRIO_PROCESS, 0)}
            else:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            if body.get("status") == "serving":
                answered_serving.set()

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    if standby and promote:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        print(f"role_replica: standby on {port} pid {os.getpid()}", flush=True)
        while True:
            try:
                order = json.loads(open(promote).read())  # noqa: SIM115 - a tiny read
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        give_up = time.monotonic() + float(order.get("port_wait_s", 30.0))
        while True:
            try:
                promoted = ThreadingHTTPServer((host, int(order["port"])), Handler)
                break
            except OSError:  # the dead replica's port is not free yet
                if time.monotonic() > give_up:
                    print(f"role_replica: port {order['port']} stayed taken", flush=True)
                    sys.exit(2)
                time.sleep(0.05)
        server.shutdown()
        server.server_close()
        server, port = promoted, int(order["port"])
        ident["replica"] = str(order["replica"])
        standby = False
        started = time.monotonic()  # loading for --loading-s from here
    print(f"role_replica: serving on {port} pid {os.getpid()}", flush=True)
    if args.die_after_s is not None:  # dies after every load
        threading.Thread(target=server.serve_forever, daemon=True).start()
        # counted from its first serving answer, not from its start: on a loaded machine a
        # probe may come later than S seconds after the start, and the death would be one
        # before readiness instead (a cold start's failure, not a served load's)
        answered_serving.wait()
        time.sleep(args.die_after_s)
        os._exit(5)
    if args.close_after is None:
        server.serve_forever()
        return
    threading.Thread(target=server.serve_forever, daemon=True).start()
    time.sleep(args.close_after)
    server.shutdown()
    server.server_close()
    print("role_replica: port closed, still running", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
