"""Faults injected from outside a job (``trainguard chaos ...``): find a run's processes and the
processes behind a port, pause a service, corrupt a checkpoint. Standard library only (killing
process trees: :mod:`trainguard.chaos.procs`; the failing dcgm-exporter endpoint:
:mod:`trainguard.chaos.dcgm`).

Every function takes explicit targets (pids, ports, directories) and never acts on anything it
was not pointed at; the CLI (``trainguard.cli.cmd_chaos``) resolves a run directory's ranks,
agents and checkpoints to those targets.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import signal
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainguard.chaos.procs import alive, descendants, lineage
from trainguard.core.agentmark import MARK_FILE, holds_mark, mark_identity
from trainguard.core.contracts.event_kinds import LAUNCH, RENDEZVOUS, WORKERS_STARTED
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.events import node_name
from trainguard.core.proctime import process_start_time

__all__ = [
    "ChaosTargetError",
    "agent_pid",
    "corrupt_checkpoint",
    "listening_pids",
    "local_addresses",
    "pause",
    "refuse_reason",
    "worker_pid",
]


class ChaosTargetError(LookupError):
    """The target of a fault does not exist (no such rank, agent, port or checkpoint)."""


# -- sockets ----------------------------------------------------------------------------------
def _proc_addr(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def local_addresses(host: str) -> set[str]:
    """The addresses ``host`` resolves to that belong to this machine (one can bind them);
    empty when it names another machine."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return set()
    local = set()
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
        except OSError:
            continue
        local.add(str(ipaddress.ip_address(sockaddr[0])))
    return local


def listening_pids(port: int, addresses: set[str] | None = None) -> list[int]:
    """Pids of the processes with a TCP socket listening on ``port`` (IPv4 or IPv6); with
    ``addresses``, only sockets bound to one of them or to every address (0.0.0.0, ::)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) <= 9 or cols[3] != "0A":
                continue
            hexaddr, _, hexport = cols[1].rpartition(":")
            if int(hexport, 16) != port:
                continue
            if addresses is not None:
                addr = _proc_addr(hexaddr)
                mapped = getattr(addr, "ipv4_mapped", None)
                if not (addr.is_unspecified or str(mapped or addr) in addresses):
                    continue
            inodes.add(cols[9])
    if not inodes:
        return []
    wanted = {f"socket:[{i}]" for i in inodes}
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{d}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{d}/fd/{fd}") in wanted:
                    pids.append(int(d))
                    break
            except OSError:
                continue
    return sorted(pids)


def pause(
    pids: Iterable[int], seconds: float, *, on_stopped: Callable[[], None] | None = None
) -> None:
    """SIGSTOP ``pids`` for ``seconds``, then SIGCONT them (also when interrupted)."""
    pids = list(pids)
    stopped = []
    try:
        for p in pids:
            os.kill(p, signal.SIGSTOP)
            stopped.append(p)
        if on_stopped is not None:
            on_stopped()
        time.sleep(seconds)
    finally:
        for p in stopped:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


# -- a run directory's processes --------------------------------------------------------------
def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).events
    if not path.is_file():
        raise ChaosTargetError(f"no events.jsonl in {run_dir}: pass the job's --tg-run-dir")
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# A pid read from events.jsonl is only a claim: anyone who can write the run directory can
# write any pid there, with that process's start time (public in /proc/<pid>/stat), and the pid
# of a process that ended is soon another process's. A target is signalled only when it is
# verifiably this job's and on this machine. An agent: a live process, not init and not the
# caller or one of its ancestors, run by the run directory's owner, that holds the run
# directory's agent mark open (trainguard.core.agentmark: a fact about the process itself, which
# no line of the log can give) and whose start time is the one its ``launch`` event recorded.
# A worker: a live process of the same owner in the process tree of such an agent of the node
# that recorded it.
_START_SLACK_S = 1.0


def _pid(value: Any) -> int | None:
    try:
        pid = int(value)
    except (TypeError, ValueError):
        return None
    return pid if pid > 0 else None


def _uids(pid: int) -> tuple[int, ...]:
    """Real, effective, saved and filesystem uids of ``pid`` (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def refuse_reason(pid: int) -> str | None:
    """Why ``pid`` is never a target, whatever names it (None: it may be one)."""
    if pid <= 1:
        return "is init (pid 1), never a process of a job"
    if pid in lineage():  # the drill would end itself, or the shell or job that runs it
        return "is this command or one of its ancestors"
    if not alive(pid):
        return "is not a live process"
    return None


class _Verifier:
    """Checks pids named in the events of one run directory against the processes themselves."""

    def __init__(self, run_dir: Path, events: list[dict[str, Any]]) -> None:
        self.events = events
        try:
            self.owner: int | None = os.stat(run_dir).st_uid
        except OSError:
            self.owner = None
        self.mark = None if self.owner is None else mark_identity(run_dir, self.owner)

    def _owned(self, pid: int) -> bool:
        uids = _uids(pid)
        return bool(uids) and self.owner is not None and all(u == self.owner for u in uids[:2])

    def agent_reason(self, pid: int) -> str | None:
        """Why ``pid`` is not a verified agent of this run (None: it is one)."""
        why = refuse_reason(pid)
        if why is not None:
            return why
        if not self._owned(pid):
            return f"is not run by the run directory's owner (uid {self.owner})"
        if self.mark is None or not holds_mark(pid, self.mark):
            return f"does not hold the run directory's {MARK_FILE} open (not an agent of it)"
        started = process_start_time(pid)
        for ev in self.events:
            if ev.get("kind") != LAUNCH or _pid(ev.get("pid")) != pid:
                continue
            try:
                if started is not None and abs(float(ev["process_start"]) - started) <= (
                    _START_SLACK_S
                ):
                    return None
            except (KeyError, TypeError, ValueError):
                continue
        return "started at another time than its launch event says (a pid reused since)"

    def agents(self, node: str | None = None) -> list[int]:
        """The verified agents (of ``node``, or any) named by ``launch`` events, newest first."""
        out: list[int] = []
        for ev in reversed(self.events):
            pid = _pid(ev.get("pid"))
            if ev.get("kind") != LAUNCH or pid is None or pid in out:
                continue
            if node is not None and ev.get("node") != node:
                continue
            if self.agent_reason(pid) is None:
                out.append(pid)
        return out

    def worker_reason(self, pid: int, node: object) -> str | None:
        """Why ``pid`` is not in the process tree of a verified agent of ``node``."""
        why = refuse_reason(pid)
        if why is not None:
            return why
        if not self._owned(pid):
            return f"is not run by the run directory's owner (uid {self.owner})"
        agents = self.agents(node if isinstance(node, str) else None)
        if not any(pid in descendants(agent) for agent in agents):
            return "is not in the process tree of an agent of this job on this machine"
        return None


def _not_ours(pid: int | None, what: str, node: object, why: str) -> ChaosTargetError:
    here = node_name()
    where = (
        "" if node in (None, here) else f" (its node is {node!r}, this is {here!r}: run this there)"
    )
    return ChaosTargetError(f"pid {pid}, recorded for {what}, {why}: not signalled{where}")


def worker_pid(run_dir: Path, rank: int) -> int:
    """The live worker of global ``rank`` (from the newest ``workers_started`` event that
    names it), if it is in the process tree of a verified agent of its node on this machine."""
    events = _events(run_dir)
    check = _Verifier(run_dir, events)
    for ev in reversed(events):
        if ev.get("kind") != WORKERS_STARTED:
            continue
        for w in ev.get("workers") or []:
            if w.get("rank") != rank:
                continue
            pid = _pid(w.get("pid"))
            why = "is not a pid" if pid is None else check.worker_reason(pid, ev.get("node"))
            if why is None and pid is not None:
                return pid
            raise _not_ours(pid, f"rank {rank}", ev.get("node"), why or "")
    raise ChaosTargetError(f"no worker of rank {rank} in {run_dir}/events.jsonl")


def agent_pid(
    run_dir: Path,
    *,
    group_rank: int | None = None,
    node: str | None = None,
    pid: int | None = None,
) -> int:
    """The live agent of ``group_rank`` (newest ``rendezvous`` event's members), of ``node``
    (its ``launch`` events) or ``pid``; one of the three. Only a verified agent of this job on
    this machine (see above)."""
    events = _events(run_dir)
    check = _Verifier(run_dir, events)
    if pid is not None:
        why = check.agent_reason(pid)
        if why is None:
            return pid
        raise _not_ours(pid, "--pid", None, why)
    if group_rank is not None:
        for ev in reversed(events):
            members = ev.get("members") if ev.get("kind") == RENDEZVOUS else None
            if not members or group_rank >= len(members):
                continue
            member = members[group_rank] or {}
            named = _pid(member.get("pid"))
            why = "is not a pid" if named is None else check.agent_reason(named)
            if why is None and named is not None:
                return named
            raise _not_ours(named, f"group rank {group_rank}", member.get("node"), why or "")
        raise ChaosTargetError(f"no agent of group rank {group_rank} in {run_dir}")
    agents = check.agents(node)
    if agents:
        return agents[0]
    raise ChaosTargetError(
        f"no live agent of node {node!r} on this machine in {run_dir} (an agent is signalled "
        "only where it runs, and only when it holds the run directory's agent mark)"
    )


# -- checkpoints ------------------------------------------------------------------------------
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def corrupt_checkpoint(
    root: Path, *, step: int | None = None, num_bytes: int = 64, seed: int = 0
) -> dict[str, Any]:
    """Flip ``num_bytes`` bytes in the middle of one DCP shard (``*.distcp``) of the newest
    committed checkpoint under ``root`` (or of ``step``). The manifest stays, so a reader that
    trusts it without checking sees a committed checkpoint whose data is wrong."""
    root = Path(root)
    committed = sorted(
        int(m.group(1))
        for d in (root.iterdir() if root.is_dir() else [])
        if (m := _STEP_RE.match(d.name)) and (d / "manifest.json").is_file()
    )
    if not committed:
        raise ChaosTargetError(f"no committed checkpoint (step_*/manifest.json) under {root}")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise ChaosTargetError(f"no committed checkpoint of step {step} under {root}: {committed}")
    d = root / f"step_{step:08d}"
    shards = sorted(p for p in d.glob("*.distcp") if p.stat().st_size > 0)
    if not shards:
        raise ChaosTargetError(f"no non-empty .distcp shard in {d}")
    target = max(shards, key=lambda p: p.stat().st_size)
    size = target.stat().st_size
    n = max(1, min(num_bytes, size))
    start = (size - n) // 2
    rng = random.Random(seed)
    with open(target, "r+b") as f:
        f.seek(start)
        data = bytearray(f.read(n))
        for i in range(len(data)):
            data[i] ^= rng.randrange(1, 256)  # never 0: every byte changes
        f.seek(start)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"step": step, "file": str(target), "offset": start, "bytes": n}
