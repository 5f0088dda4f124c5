"""Hot spares: agents beyond ``--nnodes`` wait warm and take a dead node's place.

- The rendezvous alone (real c10d store, real torch handlers in threads, no workers): 2 active +
  2 spares, an active node dies without a word; its liveness beacon stops, a waiting node
  removes it from the round, exactly one spare takes the slot, the other goes back to the
  redundancy list (not the wait list, which would restart the job in a loop).
- Real jobs (agents and gloo workers as processes, kill -9 of an agent with its workers), 2
  active + 1 spare. etcd-v3: the agent that started first dies → the spare joins with no manual
  step, restores the lost shard from a survivor's memory copy, and the job finishes at full
  world size with the weights of a fault-free run, bitwise; the spare's and the survivor's new
  workers come from their warm processes. c10d (no warm processes for restarts): a node that
  does not host the store dies → the spare takes its place and training goes on at full size;
  then the agent that started first dies → the job dies with it (the rendezvous TCPStore is a
  server inside that agent process: state, keep-alives and the spare list are gone), and says
  so in one line.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from tests.launch_utils import REPO, base_env, free_port
from tests.mlp_reference import assert_same_as_reference
from tests.procs import kill_tree
from trainguard.core.config.spares import SparesConfig
from trainguard.runtime import etcd_v3, spares
from trainguard.runtime.rendezvous import AttemptRendezvousHandler
from trainguard.testing.etcd import Etcd

EXAMPLE = str(REPO / "examples" / "train_mlp.py")
STEPS = 40
KILL_AT = 10


# -- the rendezvous alone ---------------------------------------------------------------------
def test_reaper_judges_silence_on_its_own_clock() -> None:
    """A node whose beacon stands still for dead_after_s is removed from the round (real c10d
    store and state, a fake clock); a gap in our own reading restarts the window; a tombstone
    removes at once; a node without a beacon (a plain torchrun agent) is never judged."""
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{free_port()}", run_id="reap", min_nodes=2,
        max_nodes=3,
    )  # fmt: skip
    handler = rdzv_registry.get_rendezvous_handler(params)
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    me = handler._this_node  # type: ignore[attr-defined]
    quiet, foreign, leaving = (
        _NodeDesc("quiet", 1, 0),
        _NodeDesc("torchrun", 2, 0),
        _NodeDesc("leaving", 3, 0),
    )
    state = _RendezvousState()
    state.complete = True
    state.participants = {me: 0, quiet: 1, foreign: 2}
    state.wait_list = {leaving}
    backend.set_state(pickle.dumps(state))
    now = [100.0]
    events: list[tuple[str, dict[str, Any]]] = []
    prefix = "trainguard/liveness/reap/"
    reaper = spares.Reaper(
        handler, SparesConfig(), lambda kind, **f: events.append((kind, f)),
        beacon_prefix=prefix, clock=lambda: now[0],
    )  # fmt: skip
    store = handler._store  # type: ignore[attr-defined]
    store.set(prefix + repr(quiet), "7")
    store.set(prefix + repr(leaving), "3")

    def at(t: float) -> dict[str, Any]:
        now[0] = t
        reaper.tick()
        return pickle.loads(backend.get_state()[0]).__dict__

    at(100.0)
    at(101.0)
    store.set(prefix + repr(leaving), spares.LEFT)  # the agent exited: its tombstone
    st = at(102.0)
    assert leaving not in st["wait_list"] and quiet in st["participants"]
    assert [f["reason"] for k, f in events if k == "node_dead"] == ["left"]
    st = at(103.0)  # 3 s silent, but this observer saw it only since 100 ... and 103 - 100 > 2.5
    assert quiet not in st["participants"] and foreign in st["participants"]
    dead = [f for k, f in events if k == "node_dead"]
    assert dead[-1]["dead_node"] == repr(quiet) and dead[-1]["reason"] == "liveness_silent"
    assert dead[-1]["silent_s"] == 3.0
    # a gap in our own reading (store unreachable, agent starved) proves nothing
    store.set(prefix + repr(quiet), "8")
    st_before = len(events)
    state = pickle.loads(backend.get_state()[0])
    state.participants[quiet] = 1
    got = backend.get_state()
    backend.set_state(pickle.dumps(state), got[1])
    at(110.0)
    st = at(120.0)  # 10 s between our reads: the window starts again here
    assert quiet in st["participants"] and len(events) == st_before
    at(121.0)
    st = at(122.0)
    assert quiet in st["participants"]  # 2 s
    st = at(123.0)
    assert quiet not in st["participants"]  # silent 2.5 s+ in a window without a gap
    assert foreign in st["participants"]  # never judged: it has no beacon


def test_the_beacon_beats_while_the_agent_waits_in_torchs_exit_barrier() -> None:
    """An agent whose workers finished waits in torch's exit barrier (a blocking ``wait`` on
    the rendezvous store) for the slower nodes: its beacon still advances, so the spares do
    not take it for dead (on the shared TCPStore connection the beats queued behind the wait,
    and a spare removed a finishing node from the round: the job never ended)."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.utils.store import barrier

    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{free_port()}", run_id="exitb", min_nodes=1,
        max_nodes=2,
    )  # fmt: skip
    handler = rdzv_registry.get_rendezvous_handler(params)
    store = handler._store  # type: ignore[attr-defined]
    cfg = SparesConfig(beacon_interval_s=0.1, dead_after_s=0.5)
    ctl = spares.SpareController(handler, cfg, lambda kind, **f: None)
    assert ctl.beacon is not None
    other = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    errors: list[BaseException] = []

    def exit_barrier() -> None:  # what torch's agent runs after its workers succeeded
        try:
            barrier(PrefixStore("torch.rendezvous.exitb.0", store), 2, "terminal", 2.0)
        except BaseException as e:
            errors.append(e)

    waiter = threading.Thread(target=exit_barrier)
    try:
        waiter.start()
        time.sleep(0.4)  # the barrier's wait holds the shared connection now
        first = int(other.get(ctl.beacon.key))
        time.sleep(1.0)
        during = int(other.get(ctl.beacon.key))
        assert waiter.is_alive(), "the barrier returned early: nothing was measured"
        assert during >= first + 4, f"beacon stood still in the exit barrier: {first} -> {during}"
    finally:
        waiter.join(10)
        ctl.close()
    assert errors and "timeout" in str(errors[0]).lower()  # the barrier did wait (one node)
    assert other.get(ctl.beacon.key) == spares.LEFT.encode()


def test_a_participant_judged_in_a_filling_round_stays_in_it_once_it_completed() -> None:
    """A reaper judges a node dead in a round that is filling; before its write, another
    node's write completes the round (real c10d store and state). The node keeps its slot:
    taken out of the complete round, a live node (its liveness late under load) would wait
    for a next round while the others wait for its rank, and the round never completes."""
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{free_port()}", run_id="decided", min_nodes=3,
        max_nodes=3,
    )  # fmt: skip
    handler = rdzv_registry.get_rendezvous_handler(params)
    backend = handler._state_holder._backend  # type: ignore[attr-defined]
    me = handler._this_node  # type: ignore[attr-defined]
    late, other = _NodeDesc("late", 1, 0), _NodeDesc("other", 2, 0)
    state = _RendezvousState()
    state.participants = {me: 0, late: 0}
    backend.set_state(pickle.dumps(state))
    now = [100.0]
    events: list[tuple[str, dict[str, Any]]] = []
    prefix = "trainguard/liveness/decided/"
    reaper = spares.Reaper(
        handler, SparesConfig(), lambda kind, **f: events.append((kind, f)),
        beacon_prefix=prefix, clock=lambda: now[0],
    )  # fmt: skip
    handler._store.set(prefix + repr(late), "7")  # type: ignore[attr-defined]
    judge = reaper.dead_nodes
    verdicts: list[set[str]] = []

    def judge_then_complete(st: Any) -> Any:  # the third node's join lands meanwhile
        dead = judge(st)
        verdicts.append({repr(n) for n in dead})
        if dead:
            full = pickle.loads(backend.get_state()[0])
            full.participants = {me: 0, late: 1, other: 2}
            full.complete = True
            backend.set_state(pickle.dumps(full), backend.get_state()[1])
        return dead

    reaper.dead_nodes = judge_then_complete  # type: ignore[method-assign]
    for t in (100.0, 101.0, 102.0, 103.0):  # its beacon stands still past dead_after_s
        now[0] = t
        reaper.tick()
    assert verdicts[-1] == {repr(late)} and not any(verdicts[:-1])
    st = pickle.loads(backend.get_state()[0])
    assert st.complete and set(st.participants) == {me, late, other}
    assert not [f for k, f in events if k == "node_dead"]


def test_each_node_is_watched_by_a_few_waiting_agents_not_by_all() -> None:
    """The reapers share the beacons: while a round of 60 fills, every node is watched by
    exactly REAP_NEIGHBOURS others (each agent reads a few beacons, not 59); once it is complete,
    by the spares only (2 spares: both watch every participant and each other)."""
    k = spares.REAP_NEIGHBOURS
    nodes = [_NodeDesc(f"host{i // 8}", 100 + i, 0) for i in range(60)]
    state = _RendezvousState()
    state.participants = {n: 0 for n in nodes[:58]}
    state.redundancy_list = set(nodes[58:])

    def watchers(observers: list[_NodeDesc]) -> dict[str, int]:
        count: dict[str, int] = {}
        for o in observers:
            mine = spares._watched_by(repr(o), state)
            assert repr(o) not in mine and (state.complete or len(mine) <= 2 * k)
            for key in mine:
                count[key] = count.get(key, 0) + 1
        return count

    assert watchers(nodes) == {repr(n): k for n in nodes}
    state.complete = True
    seen = watchers(nodes[58:])
    assert seen == {repr(n): 2 for n in nodes[:58]} | {repr(n): 1 for n in nodes[58:]}


def test_a_thousand_waiting_agents_reap_through_a_few_observers() -> None:
    """With more waiting agents than REAP_OBSERVERS_MAX (every survivor of a node loss in a
    1000-node round), only that many read beacons, and every node still has exactly
    REAP_NEIGHBOURS watchers."""
    k, cap = spares.REAP_NEIGHBOURS, spares.REAP_OBSERVERS_MAX
    nodes = [_NodeDesc(f"host{i // 8}", 100 + i, 0) for i in range(1000)]
    state = _RendezvousState()
    state.round, state.complete = 4, True
    state.participants = {nodes[0]: 0}
    state.wait_list = set(nodes[1:998])
    state.redundancy_list = set(nodes[998:])
    count: dict[str, int] = {}
    readers = 0
    for o in nodes[1:]:
        mine = spares._watched_by(repr(o), state)
        readers += bool(mine)
        for key in mine:
            count[key] = count.get(key, 0) + 1
    assert readers == cap
    assert count == {repr(n): k for n in nodes}


def test_beacons_of_a_large_job_beat_slower_all_timings_by_one_factor() -> None:
    cfg = SparesConfig()
    assert cfg.for_nodes(2) is cfg and cfg.for_nodes(75) is cfg  # 75 x 2 beats/s = the cap
    big = cfg.for_nodes(300)  # 4 x as many: beats and polls 4 x slower, 150 beats/s in all
    assert (big.beacon_interval_s, big.dead_after_s, big.poll_s) == (2.0, 6.0, 1.0)
    assert 300 / big.beacon_interval_s == cfg.beacon_writes_per_s
    mid = cfg.for_nodes(100)  # dead after at least three beats, never sooner than configured
    assert mid.dead_after_s == cfg.dead_after_s and mid.beacon_interval_s * 3 <= mid.dead_after_s
    with pytest.raises(ValueError, match="beacon_writes_per_s"):
        SparesConfig(beacon_writes_per_s=0)
    # what a real agent's controller uses: its rendezvous's --nnodes maximum decides
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{free_port()}",
                                  run_id="big", min_nodes=1, max_nodes=225)  # fmt: skip
    h = AttemptRendezvousHandler(rdzv_registry.get_rendezvous_handler(params), node="n0")
    ctl = spares.attach(h, SparesConfig(), lambda *a, **k: None)
    assert ctl is not None
    try:
        assert ctl.cfg.beacon_interval_s == 1.5 and ctl.reaper._cfg.dead_after_s == 4.5
        assert ctl.beacon is not None and ctl.beacon._interval == 1.5
    finally:
        ctl.close()
        h.shutdown()


def test_two_spares_one_dead_node_one_takes_the_slot_no_wait_list() -> None:
    _two_spares_one_dead_node("c10d", f"127.0.0.1:{free_port()}")


@pytest.mark.etcd
def test_etcd_v3_two_spares_one_dead_node_removed_by_one_write(etcd: Etcd) -> None:
    """On etcd-v3 the reapers judge the state their handlers hold, without reading it per
    pass; the dead node is removed by one write, though several watch it, while the survivor's
    workers hang (it does not leave the round)."""
    _two_spares_one_dead_node("etcd-v3", etcd.endpoint)


def _two_spares_one_dead_node(backend: str, endpoint: str) -> None:
    """The dead node's beacon counter stands still and a waiting node removes it."""
    events: list[tuple[int, str, dict[str, Any]]] = []
    handlers: list[AttemptRendezvousHandler] = []
    for i in range(4):
        params = RendezvousParameters(
            backend=backend,
            endpoint=endpoint,
            run_id=f"race-{backend}",
            min_nodes=2,
            max_nodes=2,
            join_timeout="120",
        )
        h = AttemptRendezvousHandler(
            rdzv_registry.get_rendezvous_handler(params)
            if backend == "c10d"
            else etcd_v3.create_rdzv_handler(params),
            node=f"n{i}",
            member_timeout_s=5,
        )
        ctl = spares.attach(h, SparesConfig(), lambda kind, i=i, **f: events.append((i, kind, f)))
        assert ctl is not None
        handlers.append(h)
    joined: dict[int, list[int]] = {i: [] for i in range(4)}
    errors: list[BaseException] = []

    def join(i: int) -> None:
        try:
            joined[i].append(handlers[i].next_rendezvous().world_size)
        except BaseException as e:  # the spares left blocked end with the closed rendezvous
            errors.append(e)

    def start(i: int) -> threading.Thread:
        t = threading.Thread(target=join, args=(i,), daemon=True)
        t.start()
        return t

    def wait_for(cond: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}; events {events}"
            time.sleep(0.05)

    threads = [start(i) for i in range(4)]
    try:
        wait_for(lambda: sum(len(v) for v in joined.values()) == 2, "first round")
        active = [i for i in range(4) if joined[i]]
        spare_ids = [i for i in range(4) if not joined[i]]
        wait_for(
            lambda: {i for i, k, _ in events if k == "spare_waiting"} == set(spare_ids),
            "both spares wait in the redundancy list",
        )
        dead, survivor = active
        dead_key = repr(handlers[dead]._inner._this_node)  # type: ignore[attr-defined]
        # the node dies without a word: no keep-alive, no beacon, no tombstone
        handlers[dead]._inner._stop_heartbeats()  # type: ignore[attr-defined]
        handlers[dead].spares.close(left=False)
        if backend == "etcd-v3":
            # the survivor's exit would end the round for every node, the dead one with it
            # (test_rdzv_etcd); here its workers hang on the lost peer instead: the waiting
            # spares' reapers find the dead node, and the survivor is told nodes wait
            wait_for(lambda: any(k == "node_dead" for _, k, _ in events), "the dead node found")
            wait_for(lambda: handlers[survivor].num_nodes_waiting() > 0, "the survivor told")
        threads.append(start(survivor))  # its workers failed: its agent joins the next round
        live = [survivor, *spare_ids]

        def second_round() -> list[int]:
            return [i for i in live if len(joined[i]) == (2 if i == survivor else 1)]

        wait_for(lambda: len(second_round()) == 2, "two live nodes in the next round")
        winners = second_round()
        (loser,) = [i for i in live if i not in winners]
        assert all(joined[i][-1] == 2 for i in winners)
        removed = [f for _, k, f in events if k == "node_dead"]
        assert removed and {f["dead_node"] for f in removed} == {dead_key}
        assert removed[0]["reason"] == "liveness_silent"
        if backend == "etcd-v3":  # removed by one writer, though several watch it
            assert len(removed) == 1, removed
        assert {i for i, k, _ in events if k == "spare_joined"} == set(winners) & set(spare_ids)
        # the node that lost the race (a spare, or the survivor itself) waits in the redundancy
        # list, not the wait list: the active agents see nobody waiting and keep training
        # (torch alone leaves it in the wait list and every active agent restarts, in a loop)
        # Seen through the loser's handler: it waits in its rendezvous and follows the state's
        # writes, where a winner's handler, done with its rendezvous, may serve a cached read
        inner = handlers[loser]._inner  # type: ignore[attr-defined]
        loser_node = inner._this_node

        def settled() -> bool:
            st = inner._state_holder.state
            return st.complete and not st.wait_list and loser_node in st.redundancy_list

        wait_for(settled, "the surplus node back in the redundancy list")
        assert handlers[winners[0]].num_nodes_waiting() == 0
        assert not errors, errors
    finally:
        handlers[survivor].set_closed()
        for t in threads:
            t.join(30)
        for h in handlers:
            h._inner._stop_heartbeats()  # type: ignore[attr-defined]
            if h.spares is not None:
                h.spares.close()


# -- real jobs --------------------------------------------------------------------------------
class Job:
    """Three agents of one job (``--nnodes 2``): a and b train, c waits as a spare."""

    def __init__(
        self, tmp: Path, backend: str, endpoint: str, run_id: str, *, warm: tuple[str, ...] = ()
    ) -> None:
        # every agent starts its first start's warm process; those named in ``warm`` start the
        # ones for restarts at once too, the others never (base_env's default: a torch import
        # each, ~4 s of CPU, for nothing)
        self.warm = warm
        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.out = tmp / "final.pt"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id

    def start(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        args = [
            sys.executable, "-m", "trainguard", "run",
            "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", self.backend, "--rdzv-endpoint", self.endpoint,
            "--rdzv-id", self.run_id, "--max-restarts", "3", "--monitor-interval", "0.1",
            "--tg-run-dir", str(self.run_dir), *extra,
            EXAMPLE, "--no-ddp", "--steps", str(STEPS), "--step-sleep", "0.05",
            "--ckpt-every", "100000",  # memory tier only: the spare's shard comes from a peer
            "--out", str(self.out),
        ]  # fmt: skip
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        env = base_env(TRAINGUARD_TELEMETRY_ENABLED="false")
        if name in self.warm:
            env["TRAINGUARD_WARM_PRESTART_DELAY_S"] = "0"
        p = subprocess.Popen(
            args, cwd=self.tmp, env=env, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(
            f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:]
            for f in sorted(self.tmp.glob("*.log"))
        )

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        f = self.run_dir / "events.jsonl"
        if not f.exists():
            return []
        evs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        return [e for e in evs if kind is None or e["kind"] == kind]

    def steps(self) -> list[dict[str, Any]]:
        out = []
        for f in (self.run_dir / "metrics").glob("rank_*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("kind") == "step":
                    out.append(rec)
        return out

    def wait(self, cond: Any, what: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out: {what}\n{self.logs()}"
            for p in self.procs:
                if p.returncode is None and p.poll() is not None and p.returncode != 0:
                    raise AssertionError(f"an agent exited with {p.returncode}\n{self.logs()}")
            time.sleep(0.1)

    def start_three(self) -> list[subprocess.Popen[bytes]]:
        """a (started first; under c10d it hosts the rendezvous store) and b train, c is the
        spare (started once a and b completed their round)."""
        c10d = self.backend == "c10d"
        a = self.start("a", *(["--rdzv-conf", "is_host=true"] if c10d else []))
        time.sleep(0.5)  # a starts first
        b = self.start("b", *(["--rdzv-conf", "is_host=false"] if c10d else []))
        self.wait(lambda: len(self.events("rendezvous")) >= 2, "the first round")
        assert self.members() == {a.pid, b.pid}
        c = self.start("c", *(["--rdzv-conf", "is_host=false"] if c10d else []))
        self.wait(lambda: self.events("spare_waiting"), "the spare waits")
        self.wait(lambda: any(s["step"] >= KILL_AT for s in self.steps()), "training")
        return [a, b, c]

    def members(self) -> set[int]:
        rdzv = self.events("rendezvous")
        return {m["pid"] for m in rdzv[-1]["members"]}

    def close(self) -> None:
        for p in self.procs:
            kill_tree(p)


def _assert_spare_took_over(job: Job, victim: int, spare: int) -> int:
    """The spare replaced ``victim`` at full world size and restored the lost shard from a
    survivor's memory copy; returns the attempt it joined."""
    last = job.events("rendezvous")[-1]
    assert last["group_world_size"] == 2
    assert {m["pid"] for m in last["members"]} >= {spare} and victim not in job.members()
    # out of the rendezvous by its beacon's silence (node_dead), or with the round a survivor
    # ended for every node when it left it first (etcd-v3: rdzv_round_ended), not by torch's
    # keep-alive expiry
    dead = job.events("node_dead")
    ended = job.events("rdzv_round_ended")
    assert dead or ended, "the dead node was never removed from the rendezvous"
    assert {e["reason"] for e in dead} <= {"liveness_silent"}
    assert not ended or job.backend == "etcd-v3"
    assert all(e["left"] >= 1 for e in ended)
    joined = job.events("spare_joined")
    assert len(joined) == 1 and joined[0]["waited_s"] > 0
    attempt = last["attempt"]
    started = [e for e in job.events("workers_started") if e["attempt"] == attempt]
    assert len(started) == 2 and {e["world_size"] for e in started} == {2}
    restored = [
        e for e in job.events("checkpoint_restored") if e.get("step") and e["attempt"] == attempt
    ]
    assert {e["rank"] for e in restored} == {0, 1}
    assert "peer_memory" in {e["source"] for e in restored}
    assert len({e["step"] for e in restored}) == 1 and restored[0]["step"] >= KILL_AT
    return attempt


def _steps_at(job: Job, attempt: int) -> dict[int, int]:
    """Rank -> steps done in ``attempt``."""
    out: dict[int, int] = {}
    for s in job.steps():
        if s["attempt"] == attempt:
            out[s["rank"]] = out.get(s["rank"], 0) + 1
    return out


@pytest.mark.etcd
def test_etcd_v3_the_agent_that_started_first_dies_the_spare_takes_over_bitwise(
    tmp_path: Path, etcd: Etcd
) -> None:
    """With warm starts (``[warm]``, on by default): every agent starts its worker's warm
    process as it starts (the first start's), the survivor one more after its start, and the
    spare and the survivor start their new workers from them (one pool serves a first start,
    a spare's first start and a restart)."""
    job = Job(tmp_path, "etcd-v3", etcd.endpoint, "spare-etcd", warm=("b", "c"))
    try:
        a, b, c = job.start_three()
        kill_tree(a)  # the node is gone, agent and worker (kill -9); on c10d this ends the job
        for p in (b, c):
            assert p.wait(timeout=240) == 0, job.logs()
    finally:
        job.close()
    attempt = _assert_spare_took_over(job, a.pid, c.pid)
    # the job ran to its end at full world size
    assert max(s["step"] for s in job.steps()) == STEPS - 1
    assert set(_steps_at(job, attempt)) == {0, 1}
    assert_same_as_reference(job.out, STEPS)  # a fault-free run's weights
    # every start came from its node's warm process (handed its job while it may still be
    # importing: the job is short, the fault comes early): the first attempt's, then the
    # last attempt's, the spare's first and the survivor's restarted one
    first = [w["warm"] for e in job.events("workers_started") if e["attempt"] == 0
             for w in e["workers"]]  # fmt: skip
    assert first == [True, True], first
    last = [w["warm"] for e in job.events("workers_started") if e["attempt"] == attempt
            for w in e["workers"]]  # fmt: skip
    assert last == [True, True], last  # one agent each: the spare, the survivor


def test_c10d_spare_replaces_a_node_then_the_store_hosts_loss_ends_the_job(
    tmp_path: Path,
) -> None:
    port = free_port()
    job = Job(tmp_path, "c10d", f"127.0.0.1:{port}", "spare-c10d")
    try:
        a, b, c = job.start_three()
        kill_tree(b)  # a node that does not host the store: agent and worker, kill -9
        job.wait(lambda: job.events("spare_joined"), "the spare joins")
        attempt = job.events("spare_joined")[0]["attempt"] + 1
        # training goes on at full size: both ranks of the new attempt complete steps
        # (each rank's records reach the run dir on their own flush: wait for both)
        job.wait(
            lambda: set(s := _steps_at(job, attempt)) == {0, 1} and min(s.values()) >= 2,
            "steps of both ranks after",
        )
        assert _assert_spare_took_over(job, b.pid, c.pid) == attempt
        # now the agent that started first: under c10d it hosts the rendezvous store (a TCPStore
        # server thread inside that agent process), and with it go the rendezvous state, the
        # keep-alives and the spare list; nobody can take over, the job ends
        kill_tree(a)
        code = c.wait(timeout=240)
    finally:
        job.close()
    assert code != 0, job.logs()
    assert "the rendezvous store is gone" in (tmp_path / "c.log").read_text(), job.logs()
    assert max(s["step"] for s in job.steps()) < STEPS - 1
