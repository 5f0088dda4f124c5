"""Rendezvous at scale: N simulated agents complete one round of torch's dynamic rendezvous.

Every simulated agent is a real ``DynamicRendezvousHandler`` (``create_handler`` with
``min_nodes = max_nodes = N``, torch's default keep-alive and timeouts) calling
``next_rendezvous()`` once; no workers. The agents are threads spread over a few processes
(``--procs``; one process's GIL would otherwise be the bottleneck). Two backends, side by side
in one run, on the same machine:

- ``trainguard etcd-v3``: trainguard's backend and store on a real etcd 3.4 (Debian
  etcd-server, loopback, data directory on disk, fsync on);
- ``torch c10d``: torch's ``C10dRendezvousBackend`` on a TCPStore hosted by this bench process
  (as a dedicated store node would; each agent connects as a client).

The time of a round is from "go" (every agent built and waiting) to the last agent's return.
A round that does not finish in ``--timeout`` (300 s) counts as null. Medians of ``--runs``.
Ends with one JSON line: ``trainguard_etcd_rdzv_s_<N>`` and ``torch_c10d_rdzv_s_<N>`` for
N in 100, 300, 1000, and the etcd rounds' tail, ``trainguard_etcd_rdzv_p90_s_<N>`` and
``trainguard_etcd_rdzv_max_s_<N>`` (null when a round did not finish).

Node loss (``--node-loss 100,1000``, etcd-v3, ``--spares 2``, ``--loss-runs 5``): N agents in a
complete round and k spares waiting in the redundancy list, every agent with the spares'
beacon and reaper (what ``trainguard run`` attaches); one active agent's process is SIGKILLed
and the other active agents join the next round at once (as each does once its workers fail on
the lost peer). The time from the kill until etcd holds a complete round of N nodes without
the dead one: ``trainguard_node_loss_rdzv_s_<N>`` (median). Each etcd round also says when its agents were done (p50, p90), their CPU
and etcd's, and the etcd requests per agent by kind (``RDZV_SCALE_DETAIL=1``: also by key and
the operations of multi-key transactions; ``RDZV_SCALE_STACKS=1``: where the agents
that have not returned wait, and the state they hold, 15 s before a round's timeout). ``--progress`` shows the round filling, with etcd's and the
agents' CPU.

    python bench/rendezvous_scale.py [--sizes 100,300,1000] [--runs 3] [--runs-large 1] [--procs 4]
    RDZV_SCALE_SPARES=1 python bench/rendezvous_scale.py --only etcd --sizes 1000 --runs 10 \
        --node-loss 1000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


# -- child: a process with many simulated agents ------------------------------------------------
_REQUESTS: dict[str, int] = {}


def _key_kind(payload: dict) -> str:
    """What an etcd request is about: the part of its (first) key after the run id."""
    import base64

    ops = payload.get("success") or [payload]
    op = ops[0] if ops else {}
    if "key" not in op:
        op = next(iter(op.values()), {}) if op else {}
    key = base64.b64decode(op.get("key", "") if isinstance(op, dict) else "").decode("latin-1")
    parts = key.split("/")  # /trainguard/rdzv/<run id>/<kind>[/...]
    return (parts[4] if len(parts) > 4 else "") + ("+" if len(ops) > 1 else "")


def _count_requests(client_cls: type) -> None:
    """Count the etcd requests of this process's agents by kind (``kv/txn``, ``watch``...)."""
    lock = threading.Lock()
    call, watch = client_cls.call, client_cls.watch

    def bump(kind: str) -> None:
        with lock:
            _REQUESTS[kind] = _REQUESTS.get(kind, 0) + 1

    def counted_call(self, path, payload, **kw):  # type: ignore[no-untyped-def]
        if os.environ.get("RDZV_SCALE_DETAIL"):  # by key too: kv/txn[state], kv/range[store]...
            kind = _key_kind(payload)
            bump(f"{path}[{kind}]")
            for _ in range(len(payload.get("success") or []) - 1):  # operations past the first
                bump(f"ops+[{kind}]")
        else:
            bump(path)
        return call(self, path, payload, **kw)

    def counted_watch(self, key, **kw):  # type: ignore[no-untyped-def]
        bump("watch")
        return watch(self, key, **kw)

    client_cls.call, client_cls.watch = counted_call, counted_watch

    from trainguard.runtime.etcd_v3 import client as client_mod

    post = client_mod._Member.post

    def counted_post(self, path, payload, headers):  # type: ignore[no-untyped-def]
        status, text = post(self, path, payload, headers)
        n = len(json.dumps(payload)) + len(text)  # bytes sent and received (JSON bodies)
        with lock:
            _REQUESTS["bytes"] = _REQUESTS.get("bytes", 0) + n
        return status, text

    client_mod._Member.post = counted_post


def child(
    backend: str, endpoint: str, run_id: str, n_total: int, n_here: int, timeout: int
) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as trainguard's wrapper does
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    conf: dict[str, object] = {"join_timeout": timeout}
    extra = os.environ.get("RDZV_SCALE_CONF", "")  # e.g. cas_backoff=0.05 (etcd-v3 tuning)
    if backend != "c10d" and extra:
        conf.update(kv.split("=", 1) for kv in extra.split(","))
    if backend == "c10d":
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

        conf["is_host"] = False
    else:
        from trainguard.runtime.etcd_v3 import EtcdV3Client, create_rdzv_handler

        _count_requests(EtcdV3Client)

    handlers = []
    backends = []
    for _ in range(n_here):
        params = RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=run_id,
            min_nodes=n_total,
            max_nodes=n_total,
            **conf,
        )
        if backend == "c10d":  # torch's registry does exactly this for c10d
            be, store = create_backend(params)
            h = create_handler(store, be, params)
        else:  # the handler `--rdzv-backend etcd-v3` gets
            h = create_rdzv_handler(params)
            be = h._state_holder._backend  # type: ignore[attr-defined]
        backends.append(be)
        handlers.append(h)

    spare_ctls: list[object | None] = [None] * len(handlers)
    if os.environ.get("RDZV_SCALE_SPARES"):  # what `trainguard run` adds: beacon + reaper
        from trainguard.core.config.spares import SparesConfig
        from trainguard.runtime import spares

        def emit(kind: str, **fields: object) -> None:  # removals are what to look at
            if kind == "node_dead":
                print(f"  node_dead {fields}"[:300], file=sys.stderr, flush=True)

        spare_ctls = [spares.attach(h, SparesConfig(), emit) for h in handlers]

    go = threading.Event()
    ends: list[float] = []
    errors: list[str] = []
    ranks: list[int] = []

    def agent(h: object, ctl: object | None) -> None:
        go.wait()
        try:
            with ctl.watching() if ctl is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
                info = h.next_rendezvous()  # type: ignore[attr-defined]
            ranks.append(info.rank)
            ends.append(time.time())
        except Exception as e:  # reported to the parent
            errors.append(f"{type(e).__name__}: {e}"[:300])

    threads = [
        threading.Thread(target=agent, args=(h, c), daemon=True)
        for h, c in zip(handlers, spare_ctls, strict=True)
    ]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    t_go = os.times()
    go.set()
    if os.environ.get("RDZV_SCALE_STACKS"):  # where the agents wait, shortly before the timeout
        threading.Thread(
            target=_dump_late, args=(handlers, threads, errors, max(timeout - 15, 5)), daemon=True
        ).start()
    for t in threads:
        t.join()
    steady_s = float(os.environ.get("RDZV_SCALE_STEADY_S") or 0)
    round_requests = dict(_REQUESTS)
    steady: dict[str, object] = {}
    if steady_s > 0 and ends and not errors:
        steady = _steady(handlers, spare_ctls, steady_s)
    out = {"ok": len(ends), "errors": errors[:3], "n_errors": len(errors)}
    out["t_end"] = max(ends) if ends else None
    t = os.times()
    out["cpu_s"] = t.user + t.system - t_go.user - t_go.system  # the round's CPU only
    out["ranks"] = sorted(ranks)
    out["writes"] = sum(getattr(b, "writes", 0) for b in backends)
    out["wins"] = sum(getattr(b, "wins", 0) for b in backends)
    out["batched"] = sum(getattr(getattr(h, "_state_holder", None), "batched", 0) for h in handlers)
    out["requests"] = round_requests
    out["steady"] = steady
    out["ends"] = ends
    print(json.dumps(out), flush=True)
    os._exit(0)  # skip torch's interpreter teardown of a thousand handlers


def _dump_stacks(names: tuple[str, ...]) -> None:
    """Where the threads running one of ``names`` wait (the most common stacks, on stderr)."""
    import collections
    import traceback

    where: collections.Counter[str] = collections.Counter()
    for frame in sys._current_frames().values():
        stack = traceback.extract_stack(frame)
        if not any(f.name in names for f in stack):
            continue
        where[" < ".join(f"{f.name}:{f.lineno}" for f in reversed(stack[-7:]))] += 1
    for k, v in where.most_common(8):
        print(f"  {v:4d} {k}", file=sys.stderr, flush=True)


def _dump_late(handlers: list, threads: list, errors: list, after_s: float) -> None:
    """``RDZV_SCALE_STACKS=1``: a round not done ``after_s`` after go: where its agents wait
    and the state the ones still waiting hold (round, participants, complete, closed)."""
    time.sleep(after_s)
    left = [h for h, t in zip(handlers, threads, strict=True) if t.is_alive()]
    if not left:
        return
    print(f"  {len(left)} agents here not returned after {after_s:.0f} s", file=sys.stderr)
    for e in errors[:5]:  # agents whose rendezvous raised (out of the round for good)
        print(f"  error ({len(errors)} in all): {e}", file=sys.stderr, flush=True)
    _dump_stacks(("agent",))
    import collections

    held: collections.Counter[str] = collections.Counter()
    for h in left:
        try:
            st = h._state_holder.state  # type: ignore[attr-defined]
            me = h._this_node  # type: ignore[attr-defined]
            held[
                f"round={st.round} participants={len(st.participants)} "
                f"complete={st.complete} closed={st.closed} wait={len(st.wait_list)} "
                f"redundancy={len(st.redundancy_list)} me_in={me in st.participants}"
            ] += 1
        except Exception as e:
            held[f"{type(e).__name__}: {e}"[:120]] += 1
    for k, v in held.most_common(6):
        print(f"  {v:4d} hold {k}", file=sys.stderr, flush=True)
    lost = getattr(left[0]._state_holder, "lost", None)  # type: ignore[attr-defined]
    if lost:
        print(f"  lost: {dict(list(lost.items())[:5])}", file=sys.stderr, flush=True)


MONITOR_S = 0.25
"""How often a simulated agent asks ``num_nodes_waiting`` (and, with spares, checks the running
round's liveness) in the steady phase: torch's agent asks every ``monitor_interval`` (0.1 s);
both answers are cached or watched, so the count of etcd requests does not depend on it."""


STEADY_SETTLE_S = 10.0
"""Seconds of the steady phase not counted: the round's last writes, the watches starting."""


def _steady(handlers: list, ctls: list, seconds: float) -> dict[str, object]:
    """The steady phase of a complete round: every agent as while its workers train (torch's
    keep-alive timer runs by itself; ``num_nodes_waiting`` and, with spares, the running round's
    liveness check every ``MONITOR_S``); the etcd requests made in ``seconds`` of it, after
    ``STEADY_SETTLE_S``."""
    stop = threading.Event()
    waiting = [0]

    def monitor(h: object, ctl: object | None) -> None:
        while not stop.wait(MONITOR_S):
            try:
                if h.num_nodes_waiting() > 0:  # type: ignore[attr-defined]
                    waiting[0] += 1
                if ctl is not None:
                    ctl.dead_participants()  # type: ignore[attr-defined]
            except Exception as e:
                print(f"  steady: {type(e).__name__}: {e}"[:200], file=sys.stderr, flush=True)

    threads = [
        threading.Thread(target=monitor, args=(h, c), daemon=True)
        for h, c in zip(handlers, ctls, strict=True)
    ]
    for t in threads:
        t.start()
    time.sleep(STEADY_SETTLE_S)  # the round's last writes land, the agents' watches start
    _REQUESTS.clear()
    t0 = time.monotonic()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    counted = dict(_REQUESTS)
    counted.pop("bytes", None)
    return {"requests": counted, "seconds": elapsed, "agents": len(handlers), "waiting": waiting[0]}


def child_loss(endpoint: str, run_id: str, n_total: int, n_here: int, timeout: int) -> None:
    """Node loss: ``n_here`` agents with spares attached (what ``trainguard run`` attaches)
    join on "go"; on "again <round>" every agent whose round completed joins the next round (as
    its agent does once its workers fail on the lost peer; one whose first call returns only
    later, in that round, too); "report" prints what happened since "again" (the spares'
    first calls return in the next round)."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainguard.core.config.spares import SparesConfig
    from trainguard.runtime import spares
    from trainguard.runtime.etcd_v3 import EtcdV3Client, create_rdzv_handler

    _count_requests(EtcdV3Client)
    handlers = [
        create_rdzv_handler(
            RendezvousParameters(
                backend="etcd-v3",
                endpoint=endpoint,
                run_id=run_id,
                min_nodes=n_total,
                max_nodes=n_total,
                join_timeout=timeout,
            )  # fmt: skip
        )
        for _ in range(n_here)
    ]
    removed: list[str] = []

    def emit(kind: str, **fields: object) -> None:
        if kind == "node_dead":
            removed.append(str(fields.get("reason")))
            print(f"  node_dead {fields}"[:300], file=sys.stderr, flush=True)

    ctls = [spares.attach(h, SparesConfig(), emit) for h in handlers]
    lock = threading.Lock()
    first: list[int] = []  # agents whose first round completed
    ends: list[float] = []  # returns after "again"
    errors: list[str] = []
    again = threading.Event()

    killed_in: list[int] = []  # the round the lost node was killed in
    n_late: list[int] = []  # participants of that round back from it only after the kill

    def agent(i: int) -> None:
        h, ctl = handlers[i], ctls[i]
        try:
            with ctl.watching():  # type: ignore[union-attr]
                h.next_rendezvous()
            with lock:
                if not again.is_set():
                    first.append(i)
                    return
                # back only after the kill (a slow return on a loaded box): a participant of
                # the round the node was lost in rejoins as the others did; a spare's first
                # round is the recovered one
                late = h._state_holder.state.round <= killed_in[0]  # type: ignore[attr-defined]
                if not late:
                    ends.append(time.time())
                    return
                n_late.append(i)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])
            return
        rejoin(i)

    def rejoin(i: int) -> None:
        try:
            with ctls[i].watching():  # type: ignore[union-attr]
                handlers[i].next_rendezvous()
            with lock:
                ends.append(time.time())
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}"[:300])

    nodes = [repr(h._this_node) for h in handlers]  # type: ignore[attr-defined]
    print("ready " + json.dumps(nodes), flush=True)
    sys.stdin.readline()  # go
    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n_here)]
    for t in threads:
        t.start()
    killed_in.append(int(sys.stdin.readline().split()[1]))  # again <round>
    _REQUESTS.clear()
    t0 = os.times()
    with lock:
        again.set()
        rejoining = list(first)
    for i in rejoining:
        threading.Thread(target=rejoin, args=(i,), daemon=True).start()
    sys.stdin.readline()  # report, once the agents' returns stop (10 s without one, 60 s at most)
    end, seen, quiet = time.monotonic() + 60, -1, time.monotonic()
    while time.monotonic() < end and time.monotonic() - quiet < 10.0:
        if len(ends) != seen:
            seen, quiet = len(ends), time.monotonic()
        time.sleep(0.1)
    t1 = os.times()
    if os.environ.get("RDZV_SCALE_STACKS"):  # where the agents that did not return wait
        _dump_stacks(("rejoin", "agent"))
    out = {
        "ends": ends, "errors": errors[:3], "requests": dict(_REQUESTS), "removed": removed,
        "late": len(n_late),
        "cpu_s": t1.user + t1.system - t0.user - t0.system,
    }  # fmt: skip
    print(json.dumps(out), flush=True)
    os._exit(0)


# -- parent --------------------------------------------------------------------------------------
def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _show_progress(endpoint: str, run_id: str, t0: float, stop: threading.Event) -> None:
    from trainguard.runtime.etcd_v3 import EtcdV3Client, _unpack, parse_endpoints
    from trainguard.runtime.etcd_v3.codec import decode_state

    c = EtcdV3Client(parse_endpoints(endpoint))
    while not stop.wait(2.0):
        found = c.get(f"/trainguard/rdzv/{run_id}/state")
        if found is None:
            continue
        st = decode_state(_unpack(found[0]))
        print(
            f"  t={time.time() - t0:5.1f}s rev={found[1]} round={st.round} "
            f"participants={len(st.participants)} complete={st.complete} "
            f"heartbeats={len(st.last_heartbeats)}",
            flush=True,
        )


def _spawn_children(
    argv: list[str],
    counts: list[int],
    timeout: float,
    progress: bool,
    env: dict[str, str] | None = None,
) -> list:
    """One child process per entry of ``counts`` (``__file__ *argv <n> <count> <timeout>``
    follows), in sessions of their own; stderr shown only with ``--progress``."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return [
        subprocess.Popen(
            [sys.executable, __file__, *argv, str(c), str(int(timeout))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # node_dead lines with --progress, and where agents wait with RDZV_SCALE_STACKS
            stderr=None if progress or os.environ.get("RDZV_SCALE_STACKS") else subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
        for c in counts
    ]


def one_round(
    backend: str,
    endpoint: str,
    n: int,
    procs: int,
    timeout: float,
    progress: bool = False,
    steady_s: float = 0.0,
) -> tuple[float | None, str, float | None]:
    """One round of ``n`` agents: its time (None: not completed), what happened, and with
    ``steady_s`` the etcd requests per agent and second in that long a steady phase after it."""
    run_id = f"scale-{backend}-{n}-{uuid.uuid4().hex[:8]}"
    counts = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    counts = [c for c in counts if c]
    children = _spawn_children(
        ["--child", backend, endpoint, run_id, str(n)],
        counts,
        timeout,
        progress,
        env={"RDZV_SCALE_STEADY_S": str(steady_s)},
    )
    try:
        for c in children:
            line = c.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                return None, f"a child did not start: {line!r}", None
        t_go = time.time()
        for c in children:
            c.stdin.write("go\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        stop = threading.Event()
        if progress and backend == "etcd-v3":
            threading.Thread(
                target=_show_progress, args=(endpoint, run_id, t_go, stop), daemon=True
            ).start()
        results = []
        deadline = time.monotonic() + timeout + (steady_s + STEADY_SETTLE_S if steady_s else 0)
        for c in children:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([c.stdout], [], [], max(left, 0))
            if not ready:
                return None, f"did not finish in {timeout:.0f} s", None
            line = c.stdout.readline()  # type: ignore[union-attr]
            if not line:
                return None, "a child died", None
            results.append(json.loads(line))
        ok = sum(r["ok"] for r in results)
        ranks = sorted(x for r in results for x in r["ranks"])
        if ok != n or ranks != list(range(n)):
            errs = [e for r in results for e in r["errors"]]
            return None, f"{ok}/{n} agents joined; errors: {errs[:2]}", None
        writes = sum(r["writes"] for r in results)
        wins = sum(r["wins"] for r in results)
        batched = sum(r.get("batched", 0) for r in results)
        cpu = sum(r.get("cpu_s", 0.0) for r in results)
        requests: dict[str, int] = {}
        for r in results:
            for k, v in r.get("requests", {}).items():
                requests[k] = requests.get(k, 0) + v
        stats = f"ok ({wins} of {writes} state writes won" if writes else "ok ("
        if writes:
            stats += f", {batched} agents admitted by another's write, "
        ends = sorted(e - t_go for r in results for e in r.get("ends", []))
        p50, p90 = ends[len(ends) // 2], ends[len(ends) * 9 // 10]
        stats += f"agents done at p50 {p50:.1f} s, p90 {p90:.1f} s, "
        stats += f"agents' CPU {cpu:.1f} s"
        nbytes = requests.pop("bytes", 0)
        if requests:
            per = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(requests.items()))
            stats += f"; etcd requests per agent: {sum(requests.values()) / n:.1f} ({per})"
            stats += f"; {nbytes / n / 1024:.0f} KiB per agent"
        stats += ")"
        rate = None
        steady = [r["steady"] for r in results if r.get("steady")]
        if steady and len(steady) == len(results):
            by_kind: dict[str, float] = {}
            for st in steady:  # requests per second of each process's window, summed
                for k, v in st["requests"].items():
                    by_kind[k] = by_kind.get(k, 0.0) + v / st["seconds"]
            rate = sum(by_kind.values()) / n
            per = ", ".join(f"{k} {v / n:.3f}" for k, v in sorted(by_kind.items()))
            waiting = sum(st["waiting"] for st in steady)
            stats += (
                f"; steady {steady_s:.0f} s: {rate:.3f} etcd requests per agent per second"
                f" ({per}){f'; num_nodes_waiting > 0 seen {waiting} times' if waiting else ''}"
            )
        return max(r["t_end"] for r in results) - t_go, stats, rate
    finally:
        if progress:
            stop.set()
        for c in children:
            if c.poll() is None:
                try:
                    os.killpg(c.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            c.wait()


def node_loss(
    endpoint: str,
    n: int,
    spares_k: int,
    procs: int,
    timeout: float,
    progress: bool = False,
    settle: float = 1.0,
) -> tuple[float | None, str]:
    """N agents in a complete round and ``spares_k`` spares (all with the spares' beacons and
    reapers); one active agent's process is SIGKILLed, the others rejoin at once. The time
    from the kill until etcd holds a complete round of N nodes without the dead one."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    from trainguard.runtime.etcd_v3 import EtcdV3Client, _unpack, parse_endpoints
    from trainguard.runtime.etcd_v3.codec import decode_state

    run_id = f"loss-{n}-{uuid.uuid4().hex[:8]}"
    total = n + spares_k - 1  # beside the victim's own process
    counts = [
        c for c in (total // procs + (1 if i < total % procs else 0) for i in range(procs)) if c
    ]
    # the victim first: one agent in a process of its own
    kids = _spawn_children(
        ["--child-loss", endpoint, run_id, str(n)], [1, *counts], timeout, progress
    )
    client = EtcdV3Client(parse_endpoints(endpoint))
    key = f"/trainguard/rdzv/{run_id}/state"

    def state():  # type: ignore[no-untyped-def]
        try:
            found = client.get(key)
        except RendezvousConnectionError:  # an overloaded etcd: not known yet, read again
            return None
        return None if found is None else decode_state(_unpack(found[0]))

    def say(kid: subprocess.Popen, line: str) -> None:  # type: ignore[type-arg]
        kid.stdin.write(line + "\n")  # type: ignore[union-attr]
        kid.stdin.flush()  # type: ignore[union-attr]

    shown = [0.0]
    etcd_pid = [
        int(p)
        for p in subprocess.run(
            ["pgrep", "-x", "etcd"], capture_output=True, text=True
        ).stdout.split()
    ]

    def _busy() -> dict[str, float]:
        return {
            "etcd": sum(_cpu_s(p) for p in etcd_pid),
            "agents": sum(_cpu_s(k.pid) for k in kids),
        }

    last: list = [time.monotonic(), _busy()]

    def wait_for(cond, limit: float) -> object:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        end = t0 + limit
        while time.monotonic() < end:
            st = state()
            if st is not None and cond(st):
                return st
            if progress and st is not None and time.monotonic() - shown[0] >= 1.0:
                now, cpus = time.monotonic(), _busy()
                load = " ".join(
                    f"{k} {(cpus[k] - last[1][k]) / (now - last[0]) * 100:.0f}%" for k in cpus
                )
                last[:] = [now, cpus]
                shown[0] = time.monotonic()
                print(f"  [{load}]", end="")
                print(
                    f"  +{time.monotonic() - t0:5.1f} s round={st.round} complete={st.complete} "
                    "participants="
                    f"{len(st.participants)} wait={len(st.wait_list)} "
                    f"redundancy={len(st.redundancy_list)}",
                    flush=True,
                )
            time.sleep(0.1)
        return None

    try:
        victim_node = None
        for i, kid in enumerate(kids):
            line = kid.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith("ready "):
                return None, f"a child did not start: {line!r}"
            if i == 0:
                victim_node = json.loads(line[6:])[0]
        say(kids[0], "go")  # the victim joins first: it is a participant, not a spare
        if wait_for(lambda st: any(repr(p) == victim_node for p in st.participants), 60) is None:
            return None, "the victim did not join"
        for kid in kids[1:]:
            say(kid, "go")
        full = wait_for(
            lambda st: st.complete and len(st.participants) == n
            and len(st.redundancy_list) == spares_k,
            timeout,
        )  # fmt: skip
        if full is None:
            return None, f"no complete first round with {spares_k} spares in {timeout:.0f} s"
        round1 = full.round  # type: ignore[attr-defined]
        time.sleep(settle)  # the spares settle in the redundancy list (the round idle)
        os.killpg(kids[0].pid, signal.SIGKILL)
        t_kill = time.time()
        for kid in kids[1:]:
            say(kid, f"again {round1}")
        done = wait_for(
            lambda st: st.round > round1 and st.complete and len(st.participants) == n
            and all(repr(p) != victim_node for p in st.participants),
            timeout,
        )  # fmt: skip
        t_done = time.time()
        for kid in kids[1:]:
            say(kid, "report")
        results = [json.loads(kid.stdout.readline()) for kid in kids[1:]]  # type: ignore[union-attr]
        if done is None:
            errs = [e for r in results for e in r["errors"]]
            return None, f"no full round again in {timeout:.0f} s; errors: {errs[:2]}"
        ends = sorted(e - t_kill for r in results for e in r["ends"])
        requests: dict[str, int] = {}
        for r in results:
            for k, v in r["requests"].items():
                requests[k] = requests.get(k, 0) + v
        removed = [x for r in results for x in r["removed"]]
        late = sum(r.get("late", 0) for r in results)
        nbytes = requests.pop("bytes", 0)
        cpu = sum(r["cpu_s"] for r in results)
        per = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(requests.items()))
        stats = (
            f"ok ({len(ends)} agents back, the last at {ends[-1]:.1f} s"
            + (f" ({late} back from the first round only after the kill)" if late else "")
            + (
                f"; dead node removed by {len(removed)} write(s) {sorted(set(removed))}"
                if removed
                else "; the lost node out with the round a survivor ended"
            )
            + f"; agents' CPU {cpu:.1f} s; etcd "
            f"requests per agent: {sum(requests.values()) / n:.1f} ({per}); "
            f"{nbytes / n / 1024:.0f} KiB per agent)"
            if ends
            else "ok (no agent return seen)"
        )
        return t_done - t_kill, stats
    finally:
        for kid in kids:
            if kid.poll() is None:
                try:
                    os.killpg(kid.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kid.wait()


def _tail(xs: list[float | None]) -> tuple[float | None, float | None, float | None, int]:
    """Median, p90 (nearest rank) and max of ``xs`` and how many are None (not completed); a
    round not completed counts as infinitely slow, so a figure it reaches is null."""
    missed = sum(1 for x in xs if x is None)
    vals = sorted(x if x is not None else float("inf") for x in xs)
    if not vals:
        return None, None, None, missed

    def fig(v: float) -> float | None:
        return None if v == float("inf") else round(v, 2)

    p90 = vals[-(-len(vals) * 9 // 10) - 1]
    return fig(statistics.median(vals)), fig(p90), fig(vals[-1]), missed


class _External:
    """An etcd this benchmark did not start (``--etcd-endpoint``): never stopped by it."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.proc = None

    def kill(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="100,300,1000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--runs-large", type=int, default=None, help="rounds for N > 100 (default: --runs)"
    )
    ap.add_argument("--procs", type=int, default=4, help="processes the agents are spread over")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--only", choices=["etcd", "c10d"], default=None)
    ap.add_argument(
        "--node-loss", default="", help="node-loss case for these N (etcd-v3, spares attached)"
    )
    ap.add_argument("--spares", type=int, default=2, help="spares in the node-loss case")
    ap.add_argument("--loss-runs", type=int, default=5, help="node-loss runs per N")
    ap.add_argument("--no-rounds", action="store_true", help="only the node-loss case")
    ap.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="node loss: seconds the complete round idles before the kill (past the 15 s "
        "keep-alive threshold: no node may take the idle ones for dead)",
    )
    ap.add_argument(
        "--steady",
        type=float,
        default=30.0,
        help="etcd-v3: after the first round of each size, this many seconds of the complete "
        "round running (keep-alives, num_nodes_waiting, liveness checks) counting etcd's "
        "requests per agent per second (0: none)",
    )
    ap.add_argument(
        "--etcd-nice",
        type=int,
        default=None,
        help="the niceness of the etcd this bench starts (default: this process's): on a "
        "machine shared with other work, the store as the dedicated service it is in a job",
    )
    ap.add_argument("--progress", action="store_true", help="print the etcd round's progress")
    ap.add_argument(
        "--etcd-endpoint", default=None, help="use this running etcd instead of starting one"
    )
    args = ap.parse_args()
    sizes = [] if args.no_rounds else [int(s) for s in args.sizes.split(",")]
    loss_sizes = [int(s) for s in args.node_loss.split(",") if s]
    # a SIGTERM still runs the finally blocks that stop etcd and the agent processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from torch.distributed import TCPStore

    from trainguard.testing.etcd import Etcd

    names = {"etcd": "trainguard_etcd_rdzv_s", "c10d": "torch_c10d_rdzv_s"}
    backends = [args.only] if args.only else ["etcd", "c10d"]
    times: dict[tuple[str, int], list[float | None]] = {}
    steady: dict[int, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="rdzv-scale-") as d:
        etcd = _External(args.etcd_endpoint) if args.etcd_endpoint else Etcd(
            Path(d) / "etcd",
            extra_args=[
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000",
                "--quota-backend-bytes", str(8 * 1024**3),
            ],
        )  # fmt: skip
        if args.etcd_nice is not None and etcd.proc is not None:
            os.setpriority(os.PRIO_PROCESS, etcd.proc.pid, args.etcd_nice)
        print(
            f"machine: {os.cpu_count()} cores, load average "
            f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; this bench at nice "
            f"{os.nice(0)}, etcd at nice "
            f"{os.getpriority(os.PRIO_PROCESS, etcd.proc.pid) if etcd.proc else '?'}",
            flush=True,
        )
        try:
            for n in sizes:
                runs = args.runs if n <= 100 or args.runs_large is None else args.runs_large
                for r in range(runs):
                    for b in backends:
                        # c10d: a fresh store host per round, as a dedicated store node
                        store = None
                        if b == "c10d":
                            store = TCPStore(
                                "127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                multi_tenant=False,
                            )  # fmt: skip
                            endpoint = f"127.0.0.1:{store.port}"
                        else:
                            endpoint = etcd.endpoint
                        etcd_cpu0 = _cpu_s(etcd.proc.pid) if etcd.proc else 0.0
                        steady_s = args.steady if b == "etcd" and r == 0 else 0.0
                        dt, why, rate = one_round(
                            "c10d" if b == "c10d" else "etcd-v3", endpoint, n, args.procs,
                            args.timeout, args.progress, steady_s,
                        )  # fmt: skip
                        if steady_s:
                            steady[n] = None if rate is None else round(rate, 3)
                        del store
                        if b == "etcd" and etcd.proc:
                            why += f" etcd CPU {_cpu_s(etcd.proc.pid) - etcd_cpu0:.1f} s"
                        times.setdefault((b, n), []).append(dt)
                        shown = f"{dt:7.2f} s" if dt is not None else "   null"
                        print(f"N={n:<5} run {r + 1} {b:<5} {shown}  {why}", flush=True)
            for n in loss_sizes:
                for r in range(args.loss_runs):
                    dt, why = node_loss(
                        etcd.endpoint, n, args.spares, args.procs, args.timeout, args.progress,
                        args.settle,
                    )  # fmt: skip
                    times.setdefault(("loss", n), []).append(dt)
                    shown = f"{dt:7.2f} s" if dt is not None else "   null"
                    print(f"N={n:<5} node loss run {r + 1} {shown}  {why}", flush=True)
        finally:
            etcd.kill()

    def median(xs: list[float | None]) -> float | None:
        # a failed round counts as infinitely slow; null when most failed
        vals = sorted(x if x is not None else float("inf") for x in xs)
        m = statistics.median(vals) if vals else float("inf")
        return None if m == float("inf") else round(m, 2)

    print()
    print(f"{'agents':>7} | {'trainguard etcd-v3 (s)':>22} | {'torch c10d (s)':>15}")
    out: dict[str, float | None] = {}
    for n in sizes:
        row = []
        for b in ["etcd", "c10d"]:
            m = median(times.get((b, n), [])) if (b, n) in times else None
            out[f"{names[b]}_{n}"] = m
            row.append("null" if m is None else f"{m:.2f}")
        print(f"{n:>7} | {row[0]:>22} | {row[1]:>15}")
    print(
        f"(medians of {args.runs} rounds, {args.runs_large or args.runs} for N > 100; "
        f"{args.procs} processes of threads; {os.cpu_count()} cores)"
    )
    for n in sizes:  # the tail: every round must complete (null when one did not)
        xs = times.get(("etcd", n), [])
        if xs and "etcd" in backends:
            p50, p90, top, missed = _tail(xs)
            out[f"trainguard_etcd_rdzv_incomplete_{n}"] = missed
            out[f"trainguard_etcd_rdzv_p90_s_{n}"] = p90
            out[f"trainguard_etcd_rdzv_max_s_{n}"] = top
            print(
                f"{n:>7} agents, etcd-v3: {missed} of {len(xs)} rounds not completed in "
                f"{args.timeout:.0f} s; median {p50} s, p90 {p90} s, max {top} s"
            )
        if n in steady:
            out[f"trainguard_etcd_steady_requests_per_agent_s_{n}"] = steady[n]
            print(
                f"{n:>7} agents, etcd-v3, complete round running ({args.steady:.0f} s): "
                f"{steady[n]} etcd requests per agent per second"
            )
    for n in loss_sizes:
        xs = times[("loss", n)]
        p50, p90, top, missed = _tail(xs)
        out[f"trainguard_node_loss_rdzv_s_{n}"] = p50
        out[f"trainguard_node_loss_p90_s_{n}"] = p90
        out[f"trainguard_node_loss_max_s_{n}"] = top
        out[f"trainguard_node_loss_incomplete_{n}"] = missed
        print(
            f"{n:>7} agents + {args.spares} spares, node loss: full-size round again in "
            f"median {p50} s, p90 {p90} s, max {top} s over {len(xs)} runs ({missed} not "
            f"completed in {args.timeout:.0f} s)"
        )
    print(f"machine at the end: load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-loss":
        ep, rid, nt, nh, to = sys.argv[2:7]
        child_loss(ep, rid, int(nt), int(nh), int(to))
    elif len(sys.argv) > 1 and sys.argv[1] == "--child":
        b, ep, rid, nt, nh, to = sys.argv[2:8]
        child(b, ep, rid, int(nt), int(nh), int(to))
    else:
        main()
