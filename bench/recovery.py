"""Recovery from node loss: torchrun vs trainguard, side by side, same example and fault.

Every run is one job of three agents on this machine (``--nnodes 2``, one worker each, gloo):
a and b train, c waits as a spare (torch's redundancy list). Agent a starts first and, on c10d,
hosts the rendezvous store (``is_host=true``). All run ``examples/train_mlp.py`` (disk
checkpoint every 5 steps; trainguard also keeps its memory tier, replicated to a peer). Faults:

- ``node_loss``: kill -9 of agent b (not the store host) and its worker; c10d for both.
  ``node_loss_elastic`` (torchrun): the same fault on torchrun's usual elastic set-up, two
  agents and ``--nnodes 1:2``, no spare (the survivor goes on alone).
- ``store_host_loss``: kill -9 of agent a and its worker: torchrun on c10d (the store dies with
  a), trainguard on etcd-v3 (a real etcd 3.4, started here).
- ``eviction`` (trainguard only; torchrun has no health checks): b's dcgm-exporter endpoint (a
  local HTTP server with dcgm-exporter's format, as in tests/health_fixtures) turns to XID 79;
  trainguard's in-job health monitor takes b out of the job (node_excluded) and the spare joins.

Measured from the fault (the kill, the XID flip): seconds to the next step completed by the
group that restarted after it (the first step recorded after the first checkpoint restore that
follows the fault), and the number of ranks training after it. ``null``: no step within
``--timeout`` s or every agent exited.

    python bench/recovery.py [--runs 3] [--timeout 90]

Prints a table and ends with one JSON line: torchrun_node_loss_resume_s,
trainguard_node_loss_resume_s, trainguard_store_host_loss_resume_s,
torchrun_store_host_loss_resume_s, trainguard_eviction_resume_s, trainguard_world_size_after
(medians; null when the job died or never resumed in most runs), plus
torchrun_node_loss_elastic_resume_s, torchrun_elastic_world_size_after and the same trainguard
figures with ``[warm] enabled = false`` (``tg-cold`` rows, ``trainguard_cold_*`` keys: every
worker starts cold). trainguard's default (``[warm] enabled``) starts the new workers from
processes that imported torch ahead (the spare's started while it waits, the survivors' after
their start); the fault comes once every node's warm processes are ready, as it would for a spare
that waited a while.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from trainguard.chaos.procs import kill_tree  # noqa: E402
from trainguard.testing.dcgm import ExporterServer, h100_node  # noqa: E402
from trainguard.testing.etcd import Etcd  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402

EXAMPLE = REPO / "examples" / "train_mlp.py"
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "trainguard": [sys.executable, "-m", "trainguard", "run"],
    "tg-cold": [sys.executable, "-m", "trainguard", "run"],  # [warm] enabled = false
}


def _records(run_dir: Path, name: str) -> list[dict[str, Any]]:
    out = []
    paths = [run_dir / "events.jsonl"] if name == "events" else (run_dir / "metrics").glob("*")
    for f in paths:
        try:
            text = f.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in _records(run_dir, "metrics") if r.get("kind") == "step"]


def _restores_after(run_dir: Path, t: float) -> list[float]:
    return sorted(
        float(e["time"])
        for e in _records(run_dir, "events")
        if e.get("kind") == "checkpoint_restored" and float(e["time"]) > t
    )


class Rdzv:
    """Reads the job's rendezvous state (who trains, who waits as a spare) by agent pid."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        self._etcd = backend != "c10d"
        if backend == "c10d":
            from torch.distributed import TCPStore
            from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
                C10dRendezvousBackend,
            )

            host, port = endpoint.rsplit(":", 1)
            self._store = TCPStore(host, int(port), is_master=False, timeout=_td(60))
            self._backend: Any = C10dRendezvousBackend(self._store, run_id)
        else:
            from trainguard.runtime import etcd_v3

            params = RendezvousParameters(
                backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=2, max_nodes=2
            )
            self._backend = etcd_v3.create_backend(params)[0]

    def roles(self) -> dict[str, set[int]]:
        got = self._backend.get_state()
        if got is None:
            return {"participants": set(), "spares": set(), "waiting": set()}
        if self._etcd:  # trainguard's JSON state (etcd_v3.codec)
            from trainguard.runtime.etcd_v3.codec import decode_state

            state = decode_state(got[0])
        else:  # torch's own (pickled) state in its c10d store
            state = pickle.loads(got[0])
        return {
            "participants": {n.pid for n in state.participants} if state.complete else set(),
            "spares": {n.pid for n in state.redundancy_list},
            "waiting": {n.pid for n in state.wait_list},
        }


def _td(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def _wait(cond: Callable[[], Any], timeout: float, procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if procs and all(p.poll() is not None for p in procs):
            return None
        time.sleep(0.05)
    return None


def once(
    which: str, fault: str, root: Path, *, timeout: float, etcd: Etcd | None
) -> tuple[float | None, int | None, str]:
    d = Path(tempfile.mkdtemp(prefix=f"{which}-{fault}-", dir=root))
    run_dir = d / "run"
    tg = which != "torchrun"
    backend = "etcd-v3" if fault == "store_host_loss" and tg else "c10d"
    if backend == "c10d":
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        assert etcd is not None
        endpoint = etcd.endpoint
    run_id = f"{which}-{fault}-{time.monotonic_ns()}"
    elastic = fault == "node_loss_elastic"
    names = "ab" if elastic else "abc"
    exporters: dict[str, ExporterServer] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    note = ""
    try:
        for name in names:
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("PET_", "TORCHELASTIC_", "TRAINGUARD_"))
            }
            env.pop("OMP_NUM_THREADS", None)
            env["PYTHONPATH"] = str(REPO)
            env["TRAINGUARD_RUNTIME_RUN_DIR"] = str(run_dir)
            env["TRAINGUARD_TELEMETRY_ENABLED"] = "false"
            if which == "tg-cold":
                env["TRAINGUARD_WARM_ENABLED"] = "false"
            if fault == "eviction":
                exporters[name] = ExporterServer(h100_node(hostname=f"node-{name}")).__enter__()
                env.update(
                    TRAINGUARD_HEALTH_DCGM_URL=exporters[name].url,
                    TRAINGUARD_HEALTH_PROBE_INTERVAL_S="0.5",
                    TRAINGUARD_HEALTH_PREFLIGHT_COMPUTE_S="0",
                    TRAINGUARD_HEALTH_MIN_FREE_DISK_GIB="0",
                    TRAINGUARD_HEALTH_MIN_FREE_MEMORY_GIB="0",
                )
            conf = []
            if backend == "c10d":
                conf = ["--rdzv-conf", f"is_host={'true' if name == 'a' else 'false'}"]
            cmd = [
                *LAUNCHERS[which], "--nnodes", "1:2" if elastic else "2", "--nproc-per-node", "1",
                "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                *conf, "--max-restarts", "3", "--monitor-interval", "0.1",
                str(EXAMPLE), "--steps", "100000", "--step-sleep", "0.05", "--ckpt-every", "5",
            ]  # fmt: skip
            if name == "c":  # the spare joins once a and b train
                if not _wait(lambda: len({s["rank"] for s in _steps(run_dir)}) == 2, 180, []):
                    return None, None, "the first round never trained"
            log = open(d / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            procs[name] = subprocess.Popen(
                cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            if name == "a":
                time.sleep(0.5)  # a starts first
        rdzv = Rdzv(backend, endpoint, run_id)
        a, b = procs["a"].pid, procs["b"].pid
        c = procs["c"].pid if "c" in procs else None
        ready = _wait(
            lambda: (
                (r := rdzv.roles())["participants"] == {a, b} and (c is None or c in r["spares"])
            ),
            120,
            list(procs.values()),
        )
        if not ready:
            return None, None, f"no spare in the redundancy list: {rdzv.roles()}"
        trained = _wait(
            lambda: len({s["rank"] for s in _steps(run_dir)}) == 2, 180, list(procs.values())
        )
        if not trained:
            return None, None, "the first round never trained"
        if which == "trainguard":  # a spare waits warm: the fault comes once every pool is ready
            nodes = len(procs)  # c's while it waits, a's and b's after their start
            _wait(
                lambda: (
                    len(
                        {
                            e.get("node")
                            for e in _records(run_dir, "events")
                            if e.get("kind") == "warm_ready"
                        }
                    )
                    >= nodes
                ),
                180,
                list(procs.values()),
            )
        time.sleep(1.0)  # a few steps with the spare waiting
        if fault == "eviction":
            t0 = time.time()
            exporters["b"].text = h100_node(
                hostname="node-b", faults={2: {"DCGM_FI_DEV_XID_ERRORS": 79}}
            )
        else:
            victim = procs["a" if fault == "store_host_loss" else "b"]
            t0 = time.time()
            kill_tree(victim, wait_s=10)
        rest = [p for n, p in procs.items() if fault == "eviction" or p is not victim]
        restored = _wait(lambda: _restores_after(run_dir, t0), timeout, rest)
        if not restored:
            alive = [n for n, p in procs.items() if p.poll() is None]
            return None, None, "job died" if not alive else "no restart"
        first_restore = restored[0]
        first = _wait(
            lambda: sorted(
                float(s["time"]) for s in _steps(run_dir) if float(s["time"]) > first_restore
            ),
            timeout,
            rest,
        )
        if not first:
            return None, None, "restarted, no step"
        resume = first[0] - t0
        time.sleep(2.0)  # let every rank of the new group record steps
        world = len({s["rank"] for s in _steps(run_dir) if float(s["time"]) > first_restore})
        if fault == "eviction":
            kinds = {e.get("kind") for e in _records(run_dir, "events")}
            note = "evicted" if "node_excluded" in kinds else "no node_excluded event"
        return resume, world, note
    finally:
        for p in procs.values():
            kill_tree(p, wait_s=10)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for srv in exporters.values():
            srv.__exit__(None, None, None)


CASES = [
    ("torchrun", "node_loss"),
    ("torchrun", "node_loss_elastic"),
    ("trainguard", "node_loss"),
    ("torchrun", "store_host_loss"),
    ("trainguard", "store_host_loss"),
    ("trainguard", "eviction"),
    ("tg-cold", "node_loss"),
    ("tg-cold", "store_host_loss"),
    ("tg-cold", "eviction"),
]


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    if len(got) * 2 <= len(xs):  # most runs never resumed
        return None
    return round(statistics.median(got), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for a resume")
    ap.add_argument("--cases", default="", help="comma-separated which:fault (default: all)")
    args = ap.parse_args()
    cases = CASES
    if args.cases:
        wanted = {tuple(c.split(":")) for c in args.cases.split(",")}
        cases = [c for c in CASES if c in wanted]
    root = Path(tempfile.mkdtemp(prefix="tg-bench-recovery-"))
    etcd = None
    results: dict[tuple[str, str], list[tuple[float | None, int | None, str]]] = {}
    try:
        if any(c[0] != "torchrun" and c[1] == "store_host_loss" for c in cases):
            etcd = Etcd(root / "etcd", no_fsync=True)
        for r in range(args.runs):
            for which, fault in cases:  # interleaved: both launchers see the same load
                got = once(which, fault, root, timeout=args.timeout, etcd=etcd)
                results.setdefault((which, fault), []).append(got)
                print(f"run {r + 1} {which:10s} {fault:17s} {got}", file=sys.stderr, flush=True)
    finally:
        if etcd is not None:
            etcd.kill()
    load = os.getloadavg()[0]
    print(f"\nrecovery after a fault, medians of {args.runs} (load average {load:.1f}):")
    print(f"{'launcher':10s}  {'fault':17s}  {'resume s':>9s}  {'world after':>11s}  runs")
    summary: dict[tuple[str, str], tuple[float | None, int | None]] = {}
    for (which, fault), runs in results.items():
        resume = _median([x[0] for x in runs])
        worlds = [x[1] for x in runs if x[1] is not None]
        world = int(statistics.median(worlds)) if worlds else None
        summary[(which, fault)] = (resume, world)
        detail = "; ".join(
            f"{x[0]:.1f}s/{x[1]}" if x[0] is not None else (x[2] or "none") for x in runs
        )
        shown = f"{resume:.2f}" if resume is not None else "null"
        print(f"{which:10s}  {fault:17s}  {shown:>9s}  {world!s:>11s}  {detail}")
    print(
        "\nnode_loss: kill -9 of a node that does not host the c10d store (agent + worker); "
        "store_host_loss: kill -9 of the agent that started first (torchrun: c10d, "
        "trainguard: etcd-v3); eviction: the node's dcgm-exporter turns to XID 79 "
        "(trainguard only). 3 agents, --nnodes 2 (one spare), 1 gloo worker each; "
        "node_loss_elastic: torchrun, 2 agents, --nnodes 1:2, no spare."
    )

    def get(which: str, fault: str, i: int = 0) -> Any:
        return summary.get((which, fault), (None, None))[i]

    print(
        json.dumps(
            {
                "torchrun_node_loss_resume_s": get("torchrun", "node_loss"),
                "trainguard_node_loss_resume_s": get("trainguard", "node_loss"),
                "trainguard_store_host_loss_resume_s": get("trainguard", "store_host_loss"),
                "torchrun_store_host_loss_resume_s": get("torchrun", "store_host_loss"),
                "trainguard_eviction_resume_s": get("trainguard", "eviction"),
                "trainguard_world_size_after": get("trainguard", "node_loss", 1),
                "torchrun_node_loss_elastic_resume_s": get("torchrun", "node_loss_elastic"),
                "torchrun_elastic_world_size_after": get("torchrun", "node_loss_elastic", 1),
                "trainguard_cold_node_loss_resume_s": get("tg-cold", "node_loss"),
                "trainguard_cold_store_host_loss_resume_s": get("tg-cold", "store_host_loss"),
                "trainguard_cold_eviction_resume_s": get("tg-cold", "eviction"),
                "trainguard_cold_world_size_after": get("tg-cold", "node_loss", 1),
            }
        )
    )


if __name__ == "__main__":
    main()
