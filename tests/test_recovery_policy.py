"""The failure → action policy, the job ledger and the blocklist (unit): every test runs against
an in-memory fake store and against a real torch TCPStore (two clients, as two agents)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from trainguard.core.config.recovery import RecoveryConfig
from trainguard.core.failures import WorkerFailure, classify_exit
from trainguard.recovery import JobLedger, RecoveryAction, RecoveryPolicy, backoff_s
from trainguard.recovery.policy import config_error, own_failure


class FakeStore:
    """The part of torch's Store the ledger uses, with TCPStore's semantics."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.data[key]

    def add(self, key: str, value: int) -> int:
        with self.lock:
            n = int(self.data.get(key, b"0")) + value
            self.data[key] = str(n).encode()
            return n

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        with self.lock:
            cur = self.data.get(key)
            if (cur is None and expected_value == "") or cur == expected_value.encode():
                self.data[key] = desired_value.encode()
                return desired_value.encode()
            return cur if cur is not None else expected_value.encode()

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None


@pytest.fixture(params=["fake", "tcpstore"])
def stores(request: pytest.FixtureRequest) -> Iterator[tuple[object, object]]:
    """Two store handles on one key space (two agents' clients)."""
    if request.param == "fake":
        s = FakeStore()
        yield s, s
        return
    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    yield server, client
    del client, server


def crash(rank: int, code: int = -9, message: str | None = None) -> WorkerFailure:
    data = {"message": {"message": message}} if message else None
    return classify_exit(rank=rank, local_rank=rank, exitcode=code, error_file_data=data)


PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"


def cfg(**kw: object) -> RecoveryConfig:
    base: dict[str, object] = {"backoff_base_s": 1.0, "backoff_cap_s": 5.0}
    return RecoveryConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_backoff_doubles_from_the_second_restart_up_to_the_cap() -> None:
    got = [backoff_s(n, base_s=1.0, cap_s=5.0) for n in range(1, 7)]
    assert got == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff_s(3, base_s=0.0, cap_s=5.0) == 0.0


def test_own_failures_and_configuration_errors() -> None:
    c = RecoveryConfig()
    assert own_failure([crash(0)]) and own_failure([crash(0, -11)])
    assert own_failure([crash(0, 1, "ValueError: nan loss")])
    assert not own_failure([crash(0, 1, PEER)])  # a survivor's view of a peer's loss
    assert not own_failure([crash(0, 1)])  # exit 1, no error file: ambiguous
    assert not own_failure([crash(0, -15)])  # torch's teardown SIGTERM
    assert config_error([crash(0, 2)], c) == "configuration error: rank 0 exited with 2"
    why = config_error([crash(1, 1, "trainguard.core.config.ConfigError: [x] bad: y")], c)
    assert why is not None and why.startswith("configuration error on rank 1: trainguard")
    assert config_error([crash(0, 1, "ModuleNotFoundError: No module named 'foo'")], c)
    assert config_error([crash(0, 1, "ValueError: nan")], c) is None
    assert config_error([crash(0, -2)], c) is None  # SIGINT, not exit code 2


def test_budget_is_job_wide_one_decision_per_failed_round(stores: tuple) -> None:
    """Two agents see every round fail; the budget counts rounds, not agents."""
    a = RecoveryPolicy(cfg(job_restart_budget=2), JobLedger(stores[0], "job"), node="a")
    b = RecoveryPolicy(cfg(job_restart_budget=2), JobLedger(stores[1], "job"), node="b")
    seen = []
    for attempt in range(3):
        da = a.decide(attempt, [crash(0, 1)], now=100.0 + attempt)
        db = b.decide(attempt, [crash(1, 1, PEER)], now=100.0 + attempt)
        assert da == db  # the same decision on both nodes
        seen.append((da.action, da.job_restarts, da.backoff_s))
    assert seen == [
        (RecoveryAction.RESTART, 1, 0.0),
        (RecoveryAction.RESTART, 2, 1.0),
        (RecoveryAction.STOP, 2, 0.0),
    ]
    stop = JobLedger(stores[1], "job").stopped()
    assert stop is not None and stop["reason"].startswith("job restart budget spent: 2 of 2")
    # a later failure anywhere reads the stop; another run id is not affected
    assert a.decide(7, [crash(0)]).action is RecoveryAction.STOP
    other = RecoveryPolicy(cfg(job_restart_budget=2), JobLedger(stores[0], "other"), node="a")
    assert other.decide(0, [crash(0)]).action is RecoveryAction.RESTART


def test_concurrent_agents_take_one_decision(stores: tuple) -> None:
    policies = [
        RecoveryPolicy(cfg(), JobLedger(stores[i % 2], "race"), node=f"n{i}") for i in range(4)
    ]
    out: list = [None] * 4

    def run(i: int) -> None:
        out[i] = policies[i].decide(0, [crash(i, 1)], now=1.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len({(d.action, d.job_restarts, d.decided_by) for d in out}) == 1
    assert JobLedger(stores[0], "race").restarts() == 1


def test_crash_loop_without_checkpoint_progress_stops_early(stores: tuple) -> None:
    led = JobLedger(stores[0], "loop")
    p = RecoveryPolicy(cfg(crash_loop_restarts=2, job_restart_budget=10), led, node="a")
    # no checkpoint ever committed: not armed
    assert p.decide(0, [crash(0)], evictable=False).action is RecoveryAction.RESTART
    assert led.record_checkpoint(4) == 4
    assert JobLedger(stores[1], "loop").record_checkpoint(2) == 4  # a max, from any agent
    assert p.decide(1, [crash(0)], evictable=False).action is RecoveryAction.RESTART  # progress
    assert p.decide(2, [crash(0)], evictable=False).action is RecoveryAction.RESTART  # 1 without
    led.record_checkpoint(6)
    assert (
        p.decide(3, [crash(0)], evictable=False).action is RecoveryAction.RESTART
    )  # progress again
    assert p.decide(4, [crash(0)], evictable=False).action is RecoveryAction.RESTART
    d = p.decide(5, [crash(0)], evictable=False)
    assert d.action is RecoveryAction.STOP
    assert d.reason.startswith("crash loop: 2 restarts without checkpoint progress")
    assert "newest committed step 6" in d.reason


def test_config_error_stops_at_once_and_the_other_node_learns_it(stores: tuple) -> None:
    a = RecoveryPolicy(cfg(), JobLedger(stores[0], "cfg"), node="a")
    b = RecoveryPolicy(cfg(), JobLedger(stores[1], "cfg"), node="b")
    d = a.decide(0, [crash(0, 1, "ModuleNotFoundError: No module named 'tokenizers'")])
    assert d.action is RecoveryAction.STOP and "tokenizers" in d.reason
    assert b.decide(0, [crash(1, 1, PEER)]).action is RecoveryAction.STOP
    assert JobLedger(stores[1], "cfg").restarts() == 0


def test_node_failing_n_times_in_the_window_is_evicted(stores: tuple) -> None:
    c = cfg(node_failure_limit=2, node_failure_window_s=60.0)
    a = RecoveryPolicy(c, JobLedger(stores[0], "ev"), node="a")
    b = RecoveryPolicy(c, JobLedger(stores[1], "ev"), node="b")
    assert a.decide(0, [crash(0)], now=0.0).action is RecoveryAction.RESTART
    assert b.decide(0, [crash(1, 1, PEER)], now=0.0).action is RecoveryAction.RESTART
    assert a.decide(1, [crash(0)], now=100.0).action is RecoveryAction.RESTART  # first one expired
    d = a.decide(2, [crash(0)], now=130.0)
    assert d.action is RecoveryAction.EVICT and "node a failed 2 times within 60 s" in d.reason
    # the survivor's view of the same round: a restart (without a)
    assert b.decide(2, [crash(1, 1, PEER)], now=130.0).action is RecoveryAction.RESTART
    assert b.decide(3, [crash(1, 1, PEER)], now=131.0).action is RecoveryAction.RESTART


def test_preemption_requeues_without_counting(stores: tuple) -> None:
    led = JobLedger(stores[0], "pre")
    p = RecoveryPolicy(cfg(job_restart_budget=0), led, node="a")
    d = p.decide(0, [crash(0, 75), crash(1, -15)])
    assert d.action is RecoveryAction.REQUEUE and led.restarts() == 0


def test_blocklist_entry_and_cooldown(stores: tuple) -> None:
    led, other = JobLedger(stores[0], "bl"), JobLedger(stores[1], "bl")
    assert other.blocked("n1") is None
    e = led.block("n1", "XID 79", now=1000.0, cooldown_s=30.0)
    got = other.blocked("n1")
    assert got == e and got.active(1029.9) and not got.active(1030.0)
    other.unblock("n1")
    assert led.blocked("n1") is None


def test_decision_taken_over_when_the_deciding_agent_is_gone(stores: tuple) -> None:
    led = JobLedger(stores[0], "gone")
    assert led.claim(0)  # an agent claimed the round and died before deciding
    p = RecoveryPolicy(cfg(decision_timeout_s=0.3), JobLedger(stores[1], "gone"), node="b")
    d = p.decide(0, [crash(1, 1, PEER)])
    assert d.action is RecoveryAction.RESTART and d.decided_by == "b" and d.job_restarts == 1


def test_a_hang_or_a_single_node_job_never_evicts() -> None:
    c = cfg(node_failure_limit=1)
    p = RecoveryPolicy(c, JobLedger(FakeStore(), "h"), node="a")
    assert p.decide(0, [crash(0)], hang=True).action is RecoveryAction.RESTART
    assert p.decide(1, [crash(0)], evictable=False).action is RecoveryAction.RESTART
    assert p.decide(2, [crash(0)]).action is RecoveryAction.EVICT


# -- the agent plugin, on a fake store ------------------------------------------------------------


def plugin_ctx(tmp_path, store: FakeStore, *, node: str = "n1", **recovery: object):
    from trainguard.core.config import TrainGuardConfig
    from trainguard.core.events import EventLog
    from trainguard.core.plugin import AgentContext

    config = TrainGuardConfig(recovery=RecoveryConfig(**recovery))  # type: ignore[arg-type]
    events = EventLog(tmp_path, node=node)
    return AgentContext(config=config, run_dir=tmp_path, events=events, job_store=store)


def test_plugin_evicts_on_health_then_refuses_then_readmits(tmp_path) -> None:
    from trainguard.core.events import read_events
    from trainguard.core.plugin import NodeEvictedError, NodeUnhealthyError
    from trainguard.recovery.plugin import RecoveryPlugin

    store, clock = FakeStore(), [1000.0]
    ctx = plugin_ctx(tmp_path, store, eviction_cooldown_s=60.0)
    plugin = RecoveryPlugin(ctx, clock=lambda: clock[0])
    # excluded before it ever joined (preflight): not an eviction
    ctx.events.emit("node_excluded", reason="health", action="drain", reasons=["XID 79"])
    assert plugin.on_exit(ctx, "excluded", NodeUnhealthyError("preflight")) is None
    ctx.attempt = 3
    ctx.events.emit("node_excluded", reason="straggler", reasons=["slow"])  # stays exclusion
    assert plugin.on_exit(ctx, "excluded", NodeUnhealthyError("straggler")) is None
    ctx.events.emit("node_excluded", reason="health", action="drain", reasons=["XID 79"])
    err = plugin.on_exit(ctx, "excluded", NodeUnhealthyError("node n1 must be drained: XID 79"))
    assert isinstance(err, NodeEvictedError) and err.exit_code == 94 and err.state == "evicted"
    assert "node n1 evicted from job" in str(err) and "XID 79" in str(err)
    entry = JobLedger(store, ctx.run_id).blocked("n1")
    assert entry is not None and entry.until == 1060.0
    # the node's agent started again within the cooldown: refused before any rendezvous
    ctx2 = plugin_ctx(tmp_path, store)
    clock[0] = 1059.0
    with pytest.raises(NodeEvictedError, match="blocklisted in job .* until .*not joining"):
        RecoveryPlugin(ctx2, clock=lambda: clock[0]).before_rendezvous(ctx2)
    clock[0] = 1060.0
    RecoveryPlugin(ctx2, clock=lambda: clock[0]).before_rendezvous(ctx2)  # admitted
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds[-4:] == ["recovery_decision", "node_evicted", "node_refused", "node_readmitted"]
    assert JobLedger(store, ctx.run_id).blocked("n1") is None


def test_plugin_learns_a_stop_and_publishes_checkpoints(tmp_path) -> None:
    from trainguard.core.events import EventLog
    from trainguard.core.plugin import JobStopError
    from trainguard.recovery.plugin import RecoveryPlugin

    store = FakeStore()
    ctx = plugin_ctx(tmp_path, store)
    plugin = RecoveryPlugin(ctx)
    EventLog(tmp_path, node="n0").emit("checkpoint_committed", step=40)
    assert plugin.on_monitor(ctx, None, None) is None  # type: ignore[arg-type]
    ledger = JobLedger(store, ctx.run_id)
    assert ledger.checkpoint_step() == 40
    ledger.stop("job restart budget spent: 2 of 2", by="n0")
    # the rendezvous was closed by the stopping agent: this one ends with the stop too
    err = plugin.on_exit(ctx, "failed", RuntimeError("rendezvous closed"))
    assert isinstance(err, JobStopError) and err.exit_code == 93
    assert "budget spent" in str(err) and "do not requeue" in str(err)
    with pytest.raises(JobStopError):
        plugin.before_rendezvous(ctx)


def test_committed_steps_counts_checkpoints_ft_heals_and_restores(tmp_path) -> None:
    from trainguard.recovery.plugin import CommittedSteps

    events = tmp_path / "events.jsonl"
    seen = CommittedSteps(tmp_path)
    assert seen.poll() == -1  # no file yet
    events.write_text(
        '{"kind": "checkpoint_committed", "step": 20}\n{"kind": "step", "step": 90}\n'
    )
    assert seen.poll() == 20  # a plain step is no progress
    with events.open("a") as f:
        f.write('{"kind": "ft_healed", "replica_group": 1, "step": 57}\n{"kind": "ft_he')
    assert seen.poll() == 57  # a replica group healed from its peers: progress
    with events.open("a") as f:
        f.write('aled", "step": 61}\n')
    assert seen.poll() == 61  # the half-written line was read once it was whole
    with events.open("a") as f:  # a restore from the memory tier, past any disk commit
        f.write('{"kind": "checkpoint_restored", "rank": 0, "step": null, "source": "none"}\n')
        f.write('{"kind": "checkpoint_restored", "rank": 0, "step": 75, "source": "memory"}\n')
    assert seen.poll() == 75


def test_backoff_resets_when_the_job_made_checkpoint_progress(stores: tuple) -> None:
    led = JobLedger(stores[0], "reset")
    p = RecoveryPolicy(cfg(crash_loop_restarts=0), led, node="a")
    waits = []
    for attempt, ckpt in enumerate([10, 10, 10, 30, 50, 50]):
        led.record_checkpoint(ckpt)
        waits.append(p.decide(attempt, [crash(0, 1)], now=100.0 + attempt).backoff_s)
    # progress before restarts 1, 4 and 5: immediate; without: 1 s, then 2 s (base 1, cap 5)
    assert waits == [0.0, 1.0, 2.0, 0.0, 0.0, 1.0]


def test_an_attempt_that_ran_long_restarts_at_once(stores: tuple) -> None:
    led = JobLedger(stores[0], "ranlong")
    p = RecoveryPolicy(cfg(crash_loop_restarts=0, backoff_reset_s=60.0), led, node="a")
    waits = [
        p.decide(attempt, [crash(0, 1)], now=100.0 + attempt, ran_s=ran).backoff_s
        for attempt, ran in enumerate([5.0, 5.0, 600.0, 5.0, None])
    ]
    # no checkpoint ever: short attempts escalate; one that ran 10 min restarts at once
    assert waits == [0.0, 1.0, 0.0, 4.0, 5.0]
