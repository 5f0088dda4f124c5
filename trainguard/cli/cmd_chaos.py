"""``trainguard chaos ...``: inject real faults into a running job, from outside.

    trainguard chaos check 'kill:rank=1,step=40;hang:rank=0,step=60'   # explain a TRAINGUARD_CHAOS spec
    trainguard chaos kill-rank RUN_DIR --rank 1 [--signal STOP]         # a worker, by global rank
    trainguard chaos kill-agent RUN_DIR --group-rank 0                   # an agent and its workers (kill -9)
    trainguard chaos pause --endpoint 127.0.0.1:2379 --seconds 10        # SIGSTOP etcd (or --pid P), then SIGCONT
    trainguard chaos dcgm --port 9400 --xid 79 --after 10                # a dcgm-exporter that turns to XID 79
    trainguard chaos corrupt-checkpoint RUN_DIR [--step N]               # flip bytes in the newest DCP shard

Faults from inside the workers (kill/hang/slow rank r at step s) are the ``TRAINGUARD_CHAOS``
environment variable (see ``trainguard chaos check --help``). Nothing here runs unless asked.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from trainguard.chaos import faults as chaos
from trainguard.chaos import ops as chaos_ops
from trainguard.chaos import procs
from trainguard.chaos.dcgm import DcgmExporter
from trainguard.core.atomicfile import write_atomic
from trainguard.core.contracts.rundir import RunDir

__all__ = ["main"]


def _signal(raw: str) -> int:
    name = raw.upper()
    if name.isdigit():
        return int(name)
    try:
        return int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
    except KeyError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a signal name (KILL, TERM...)") from None


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="ACTION")

    c = sub.add_parser("check", help="parse and explain a TRAINGUARD_CHAOS spec")
    c.add_argument("spec", nargs="?", help=f"the spec (default: ${chaos.CHAOS_ENV})")

    k = sub.add_parser("kill-rank", help="signal the worker of a global rank (default kill -9)")
    k.add_argument("run_dir", type=Path)
    k.add_argument("--rank", type=int, required=True)
    k.add_argument("--signal", type=_signal, default=signal.SIGKILL, help="KILL (default), STOP...")

    a = sub.add_parser("kill-agent", help="kill -9 an agent and every process under it")
    a.add_argument("run_dir", type=Path, nargs="?")
    who = a.add_mutually_exclusive_group(required=True)
    who.add_argument("--group-rank", type=int, help="the agent of this node rank (last round)")
    who.add_argument("--node", help="the agent of this node name (its launch event)")
    who.add_argument(
        "--pid", type=int, help="this agent pid (with RUN_DIR: checked to be one of its agents)"
    )

    s = sub.add_parser("pause", help="SIGSTOP a service for a while, then SIGCONT (e.g. etcd)")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--pid", type=int, action="append", help="a pid (repeatable)")
    what.add_argument("--port", type=int, help="the process listening on this TCP port")
    what.add_argument("--endpoint", help="host:port of the service (e.g. etcd's client URL)")
    s.add_argument("--seconds", type=float, required=True)

    d = sub.add_parser("dcgm", help="serve a dcgm-exporter /metrics that turns to an XID")
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=9400, help="0: a free port (see --port-file)")
    d.add_argument("--xid", type=int, default=79, help="the XID injected (79: fell off the bus)")
    d.add_argument("--gpu", type=int, default=0, help="the GPU index that reports it")
    d.add_argument("--gpus", type=int, default=8, help="GPUs of the simulated node")
    d.add_argument("--hostname", default=os.uname().nodename)
    d.add_argument("--after", type=float, default=None, help="healthy for this many seconds")
    d.add_argument("--trigger-file", default=None, help="healthy until this file exists")
    d.add_argument("--port-file", default=None, help="write the bound port here when serving")

    x = sub.add_parser("corrupt-checkpoint", help="flip bytes in the newest committed checkpoint")
    x.add_argument("path", type=Path, help="a run directory (uses <run>/checkpoints) or the root")
    x.add_argument("--step", type=int, default=None)
    x.add_argument("--bytes", type=int, default=64)
    return p


def _checkpoint_root(path: Path) -> Path:
    if RunDir(path).checkpoints.is_dir() and not any(path.glob("step_*")):
        return RunDir(path).checkpoints
    return path


def _pause_targets(args: argparse.Namespace) -> list[int]:
    pids = _pause_candidates(args)
    for pid in pids:
        if (why := chaos_ops.refuse_reason(pid)) is not None:
            raise chaos_ops.ChaosTargetError(f"pid {pid} {why}: not stopped")
    return pids


def _pause_candidates(args: argparse.Namespace) -> list[int]:
    if args.pid:
        return list(args.pid)
    port, addresses = args.port, None
    if port is None:
        raw = args.endpoint.split("://")[-1].rstrip("/")
        host, _, port_text = raw.rpartition(":")
        host = host.strip("[]")
        try:
            port = int(port_text)
        except ValueError:
            port = 0
        if not host or not 0 < port < 65536:
            raise chaos_ops.ChaosTargetError(
                f"--endpoint {args.endpoint!r} is not host:port, e.g. 127.0.0.1:2379"
            )
        addresses = chaos_ops.local_addresses(host)
        if not addresses:
            raise chaos_ops.ChaosTargetError(
                f"--endpoint {args.endpoint!r}: {host} is not an address of this machine; run "
                "pause on the service's host (it signals local processes only)"
            )
    pids = chaos_ops.listening_pids(port, addresses)
    if not pids:
        where = f"{args.endpoint}" if addresses is not None else f"port {port}"
        raise chaos_ops.ChaosTargetError(f"no process of this machine listens on {where}")
    return pids


def _run(args: argparse.Namespace, prog: str) -> int:
    if args.cmd == "check":
        spec = args.spec if args.spec is not None else os.environ.get(chaos.CHAOS_ENV, "")
        for f in chaos.parse_spec(spec):
            print(f"{f.text}: {f.describe()}")
        return 0
    if args.cmd == "kill-rank":
        pid = chaos_ops.worker_pid(args.run_dir, args.rank)
        os.kill(pid, args.signal)
        name = signal.Signals(args.signal).name
        print(f"{prog}: sent {name} to rank {args.rank} (pid {pid})", flush=True)
        return 0
    if args.cmd == "kill-agent":
        if args.run_dir is not None:
            pid = chaos_ops.agent_pid(
                args.run_dir, group_rank=args.group_rank, node=args.node, pid=args.pid
            )
        elif args.pid is None:
            raise chaos_ops.ChaosTargetError("--group-rank and --node need the run directory")
        elif (why := chaos_ops.refuse_reason(args.pid)) is not None:
            raise chaos_ops.ChaosTargetError(f"pid {args.pid} {why}: not signalled")
        else:
            pid = args.pid  # named by the caller, without a run directory to check it against
        killed = procs.kill_tree(pid)
        if not killed:
            raise chaos_ops.ChaosTargetError(f"no process {pid}")
        print(f"{prog}: killed agent {pid} and {len(killed) - 1} processes under it", flush=True)
        return 0
    if args.cmd == "pause":
        pids = _pause_targets(args)
        t0 = time.monotonic()
        chaos_ops.pause(
            pids,
            args.seconds,
            on_stopped=lambda: print(f"{prog}: stopped {pids} (SIGSTOP)", flush=True),
        )
        print(f"{prog}: resumed {pids} after {time.monotonic() - t0:.1f} s (SIGCONT)", flush=True)
        return 0
    if args.cmd == "dcgm":
        srv = DcgmExporter(
            host=args.host, port=args.port, xid=args.xid, gpu=args.gpu, num_gpus=args.gpus,
            hostname=args.hostname, after_s=args.after, trigger_file=args.trigger_file,
        )  # fmt: skip
        if args.port_file:
            write_atomic(args.port_file, str(srv.port))
        when = []
        if args.after is not None:
            when.append(f"after {args.after:g} s")
        if args.trigger_file:
            when.append(f"once {args.trigger_file} exists")
        print(
            f"{prog}: serving {srv.url}: GPU {args.gpu} reports XID {args.xid} "
            f"{' or '.join(when) or 'from the start'}",
            flush=True,
        )
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            srv.server.server_close()
        return 0
    if args.cmd == "corrupt-checkpoint":
        out = chaos_ops.corrupt_checkpoint(
            _checkpoint_root(args.path), step=args.step, num_bytes=args.bytes
        )
        print(
            f"{prog}: flipped {out['bytes']} bytes at offset {out['offset']} of {out['file']} "
            f"(step {out['step']})",
            flush=True,
        )
        return 0
    raise AssertionError(args.cmd)


def main(argv: list[str], *, prog: str = "trainguard chaos") -> int:
    args = _parser(prog).parse_args(argv)
    try:
        return _run(args, prog)
    except (chaos.ChaosSpecError, chaos_ops.ChaosTargetError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"{prog}: error: not allowed to signal that process ({e})", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
