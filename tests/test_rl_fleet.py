"""The rollout fleet with real engine processes: ``python -m trainguard.rl.engine`` replicas on
loopback, a real weight store, the real client. Faults are real: kill -9, SIGSTOP, an engine
answering HTTP 500 or a truncated body."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_engines import LocalEngines, engine_health
from tests.intruder import intrude, refusal
from tests.procs import FIXTURE_PIDS
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.fleetauth import sign
from trainguard.rl import RolloutClient, RolloutConfig, RolloutError, WeightStore
from trainguard.rl.groups import settle
from trainguard.rl.tiny import tiny_gpt2
from trainguard.testing.ports import free_port

# Two engine processes (a torch + transformers import each, ~7 CPU s), started once a run: the
# module is one xdist group, so its tests share one fleet. The killing tests come last, in an
# order where each kill is reused: the replica killed with requests in flight is the one the
# restart test starts again (with a warm standby beside it), the standby test promotes that
# standby, and the last test kills a replica for good (4 engine starts in all, not 7).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rl_fleet")]

PROMPTS = [f"please write {i % 10} now" for i in range(12)]


TOKENS: dict[int, str] = {}
"""Port → the job token of the engine on it (what the trainer's client sends)."""


def health(port: int, timeout: float = 2.0) -> dict[str, Any] | None:
    return engine_health(port, timeout, token=TOKENS.get(port))


def raw_post(port: int, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST", path, body=data, headers={"Content-Type": "application/json", **headers}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def post(port: int, path: str, body: Any, timeout: float = 30) -> tuple[int, Any]:
    """``POST`` as the trainer's client: with the job's token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode()
        sig = sign(TOKENS.get(port), "POST", path, port, data)
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **sig})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


class Fleet:
    def __init__(self, run_dir: Path, n: int) -> None:
        self.run_dir = run_dir
        self.store = WeightStore(run_dir / "rl" / "weights")
        self.model = tiny_gpt2(seed=0)
        self.version = 0
        self.engines = LocalEngines(
            [free_port() for _ in range(n)],
            run_dir=run_dir,
            args=["--enable-fault-injection", "--poll-interval-s", "0.3"],
        )
        TOKENS.update(dict.fromkeys(self.engines.ports, self.engines.token))
        self.engines.start()
        self.own()
        # (health, completion status, completion answer) of each replica before any version
        # was published, and the version each served first once version 0 was
        self.unpublished: list[tuple[dict[str, Any], int, Any]] = []
        self.first_served: list[Any] = []

    def first_publish(self) -> None:
        """The replicas, started before the trainer published anything, are asked for health
        and a completion; then version 0 is published and they serve it."""
        deadline = time.monotonic() + 180
        for port in self.engines.ports:
            while (h := health(port)) is None or h["status"] == "starting":
                assert time.monotonic() < deadline, h
                time.sleep(0.2)
            code, answer = post(port, "/v1/completions", {"prompt": "write"})
            self.unpublished.append((h, code, answer))
        self.store.publish(0, self.model.state_dict())
        self.engines.wait_serving(version=0, timeout=120)
        self.first_served = [(health(p) or {}).get("weight_version") for p in self.engines.ports]

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.engines.procs) if p is not None and p.poll() is None]

    def own(self) -> None:
        """The replicas running now belong to the module's fleet (stopped at its teardown),
        also those a test restarted, and their warm standbys."""
        procs = [*self.engines.procs, *self.engines.spares]
        FIXTURE_PIDS.update(p.pid for p in procs if p is not None)

    def start_with_standby(self, i: int) -> None:
        """Start replica ``i`` (dead) afresh, and a warm standby for it (the role's standby
        protocol), as ``LocalEngines(standby=True)`` does; later starts get none."""
        self.engines.standby = True
        try:
            self.engines.start(i)
        finally:
            self.engines.standby = False
        self.own()

    def drop_spare(self) -> None:
        """Stop the warm standbys (a promotion starts a new one): no test needs them later."""
        for i, spare in enumerate(self.engines.spares):
            if spare is not None:
                if spare.poll() is None:
                    os.kill(spare.pid, signal.SIGKILL)
                spare.wait()
                self.engines.spares[i] = None

    def publish(self) -> int:
        self.version += 1
        self.store.publish(self.version, self.model.state_dict())
        return self.version

    def heal(self, min_alive: int | None = None) -> None:
        """Every replica running and serving the current version (after a test's faults);
        ``min_alive``: a replica a previous test killed stays dead while that many others
        run."""
        self.drop_spare()
        keep_dead = min_alive is not None and len(self.alive()) >= min_alive
        for i, p in enumerate(self.engines.procs):
            assert p is not None
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                h = health(self.engines.ports[i], timeout=5)
                if h is None:
                    self.engines.restart(i)
            elif not keep_dead:
                self.engines.start(i)
        self.own()
        for i in self.alive():
            self.engines.wait_serving(i, version=self.version, timeout=120)
            for kind in ("http_500", "malformed", "hang", "partial_refit"):
                post(self.engines.ports[i], "/v1/faults", {"kind": kind, "count": 0})

    def client(self, **cfg: Any) -> RolloutClient:
        c = RolloutClient(self.engines.urls, config=RolloutConfig(**cfg), token=self.engines.token)
        c.set_policy_version(self.version)
        return c


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("rl"), 2)
    try:
        f.first_publish()
        yield f
    finally:
        f.engines.close()


@pytest.fixture
def healthy(fleet: Fleet) -> Fleet:
    """The module's fleet, every replica serving the current version (a replica a previous
    test killed or stopped is restarted or continued here, in setup)."""
    fleet.heal()
    return fleet


@pytest.fixture
def serving(fleet: Fleet) -> Fleet:
    """The module's fleet healed like ``healthy``, except that a replica a previous test
    killed stays dead while two others run: for the tests that kill one themselves."""
    fleet.heal(min_alive=2)
    return fleet


@pytest.fixture
def one_down(fleet: Fleet) -> tuple[Fleet, int]:
    """The module's fleet with one replica dead, the others serving the current version: the
    replica a previous test killed, else replica 0, killed here (kill -9)."""
    fleet.heal(min_alive=1)
    dead = [i for i in range(len(fleet.engines.ports)) if i not in fleet.alive()]
    if not dead:
        fleet.engines.kill(0, signal.SIGKILL)
        dead = [0]
    return fleet, dead[0]


def check_real(groups: list[list[Any]], n: int, version: int) -> None:
    """Every prompt has n completions, each generated by an engine with ``version``."""
    assert len(groups) % len(PROMPTS) == 0
    for i, group in enumerate(groups):
        assert len(group) == n
        for c in group:
            assert c.prompt_index == i
            assert c.weight_version == version and c.staleness == 0
            assert c.finish_reason in ("stop", "length")
            assert len(c.token_ids) <= 6 and c.engine.startswith("http://127.0.0.1:")


def test_engine_without_a_published_version_stays_loading(fleet: Fleet) -> None:
    """The module's replicas started before any version was published (``first_publish``):
    each reported ``loading`` and answered 503; each served version 0 once it was published."""
    assert len(fleet.unpublished) == 2
    for h, code, err in fleet.unpublished:
        assert h["status"] == "loading" and h["weight_version"] is None
        assert code == 503 and "loading" in err["error"]["message"]
    assert fleet.first_served == [0, 0]


def test_engine_api_and_bad_input(healthy: Fleet) -> None:
    port = healthy.engines.ports[0]
    h = health(port)
    assert h is not None and h["status"] == "serving" and h["weight_version"] == healthy.version
    code, out = post(port, "/v1/completions", {"prompt": ["please write 7 now", "write 3"], "n": 3,
                                               "max_tokens": 5, "logprobs": 1, "seed": 1})  # fmt: skip
    assert code == 200 and out["weight_version"] == healthy.version
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for c in out["choices"]:
        assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) <= 5
        assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])
    again = post(port, "/v1/completions", {"prompt": ["please write 7 now", "write 3"], "n": 3,
                                           "max_tokens": 5, "logprobs": 1, "seed": 1})[1]  # fmt: skip
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in out["choices"]]
    for body, words in (
        ({"max_tokens": 4}, "'prompt' must be"),
        ({"prompt": "write", "n": 0}, "'n' must be an integer"),
        ({"prompt": "write", "max_tokens": 100}, "exceeds the model's 64 positions"),
        ({"prompt": "write", "stream": True}, "'stream' is not supported"),
        ({"prompt": ["write", ""]}, "prompt 1 must be a non-empty string"),
        ([1, 2], "must be a JSON object"),
    ):
        code, err = post(port, "/v1/completions", body)
        assert code == 400 and words in err["error"]["message"], (body, err)
    code, err = post(port, "/v1/weights/update", {"version": 999})
    assert code == 404 and "999" in err["error"]["message"]


def test_an_engine_refuses_every_request_without_the_job_token(
    healthy: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another local process knows the port, the trainer's version and has weights of its own
    (the model's tensors, zeroed): without the job's token (or with another) every request is
    401 with the same line, health included, and the engine goes on generating with the
    trainer's weights. With the token, a weight update naming a file is refused too."""
    from safetensors.torch import save_file

    port = healthy.engines.ports[0]
    evil = tmp_path / "evil.safetensors"
    save_file({k: v.detach().clone().zero_() for k, v in healthy.model.state_dict().items()}, evil)
    ask = {"prompt": PROMPTS[:2], "max_tokens": 5, "seed": 3, "logprobs": 1}
    code, before = post(port, "/v1/completions", ask)
    assert code == 200
    none, wrong = (
        intrude(port, healthy.version, evil),
        intrude(port, healthy.version, evil, "0" * 64),
    )
    assert refusal(none).startswith("no job signature: every request to a rollout server must")
    assert refusal(wrong).startswith("a wrong job signature: ")
    # the trainer's own requests: a path is no part of a weight update, a version must be stored
    code, err = post(port, "/v1/weights/update", {"version": healthy.version, "path": str(evil)})
    assert code == 400 and "unknown fields ['path']" in err["error"]["message"]
    code, err = post(port, "/v1/weights/update", {"version": healthy.version + 50})
    msg = err["error"]["message"]
    assert code == 404 and f"weight version {healthy.version + 50} is not in the job's" in msg
    assert "publish it there first" in msg
    code, after = post(port, "/v1/completions", ask)
    assert code == 200 and after["weight_version"] == before["weight_version"] == healthy.version
    assert [c["token_ids"] for c in after["choices"]] == [c["token_ids"] for c in before["choices"]]
    # a request of the trainer's seen on the way: sent again, for another port, another body
    data = json.dumps({"prompt": "write 7", "max_tokens": 3}).encode()
    sig = sign(healthy.engines.token, "POST", "/v1/completions", port, data)
    assert raw_post(port, "/v1/completions", data, sig)[0] == 200
    code, err = raw_post(port, "/v1/completions", data, sig)
    assert code == 401 and err["error"]["message"].startswith("a replayed request")
    other = healthy.engines.ports[1]
    sig = sign(healthy.engines.token, "POST", "/v1/completions", port, data)
    code, err = raw_post(other, "/v1/completions", data, sig)
    assert code == 401 and err["error"]["message"].startswith("a wrong job signature")
    code, err = raw_post(port, "/v1/completions", data.replace(b"7", b"3"), sig)
    assert code == 400 and "not the one its signature names" in err["error"]["message"]
    # a client without the token: one line saying so, no engine counted as serving
    monkeypatch.delenv("TRAINGUARD_ROLLOUT_TOKEN", raising=False)
    cfg = RolloutConfig(health_interval_s=0.2, health_timeout_s=2.0)
    with RolloutClient([healthy.engines.urls[0]], config=cfg) as client:
        with pytest.raises(RolloutError, match="refused this client's token: no job sig") as e:
            client.wait_serving(1, timeout=2)
        assert "\n" not in str(e.value)


def test_http_500_and_malformed_answers_are_counted_and_retried(healthy: Fleet) -> None:
    port = healthy.engines.ports[1]
    post(port, "/v1/faults", {"kind": "http_500", "count": 2})
    post(port, "/v1/faults", {"kind": "malformed", "count": 2})
    with healthy.client(prompts_per_request=1, failure_cooldown_s=0.0) as client:
        groups = client.generate(PROMPTS * 2, n=2, max_tokens=6)
        check_real(groups, 2, healthy.version)
        assert client.failures["http_5xx"] >= 1 and client.failures["malformed"] >= 1
        assert client.retries == sum(client.failures.values())
        m = client.take_metrics()
        assert m["rollout_retries"] == client.retries and m["rollout_latency_p99_s"] > 0


def test_a_batch_that_cannot_be_generated_raises_or_drops_never_fabricates(healthy: Fleet) -> None:
    for port in healthy.engines.ports:
        post(port, "/v1/faults", {"kind": "http_500", "count": 1000})
    with healthy.client(max_attempts=3, failure_cooldown_s=0.0) as client:
        with pytest.raises(RolloutError, match="no real generation after 3 attempts"):
            client.generate(PROMPTS, n=2, max_tokens=6)
        # 3 requests in parallel, each up to 3 attempts; the first to run out ends the batch
        assert 3 <= client.failures["http_5xx"] <= 9
    # by setting, the groups of a request out of attempts come back empty, for the trainer to
    # drop whole (counted): never a made-up member
    with healthy.client(max_attempts=2, failure_cooldown_s=0.0, drop_failed_groups=True) as client:
        groups = client.generate(PROMPTS, n=2, max_tokens=6)
        assert groups == [[] for _ in PROMPTS]
        out = settle(groups, n=2, train_version=healthy.version, max_staleness=0)
        assert not out.kept and out.dropped == {"failed": len(PROMPTS)}


FINGERPRINT = ["please write 3 7 now 3 3", "write digits 1 2 now 9 0"]


def test_refits_are_verified_and_a_failed_one_quarantines_until_refit(
    healthy: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verified refit with the real engines: a version is routed only once the engine's
    prompt log-probs match the trainer's fingerprint. A refit that loads half of the tensors
    (the engine's ``partial_refit`` fault) is quarantined (503, out of routing) and refit
    again; a weight file truncated between write and load is never loaded, the engines are
    quarantined, the trainer writes it again and they refit to it."""
    import torch

    from trainguard.rl import weights as weights_mod
    from trainguard.rl.verify import fingerprint

    f, tok = healthy, __import__("trainguard.rl.tiny", fromlist=["x"]).tiny_tokenizer()
    events: list[tuple[str, dict[str, Any]]] = []

    def write(v: int) -> None:
        f.store.publish(v, f.model.state_dict(), fingerprint=fingerprint(f.model, tok, FINGERPRINT))

    def step() -> int:  # a new version: the weights move as a training step would
        with torch.no_grad():
            for p in f.model.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        f.version += 1
        return f.version

    client = RolloutClient(
        f.engines.urls, config=RolloutConfig(refit_attempts=3, failure_cooldown_s=0.0),
        events=lambda kind, **kw: events.append((kind, kw)),
        fingerprints=lambda v: f.store.meta(v).get("fingerprint"), token=f.engines.token,
    )  # fmt: skip
    a, b = f.engines.urls
    try:
        v = step()
        write(v)
        res = client.sync_weights(v)
        assert sorted(res.confirmed) == [a, b] and res.missed == []
        assert {e["engine"] for k, e in events if k == "rollout_refit_verified"} == {a, b}

        # a refit that stops half-way, every time: engine 0 stays quarantined, never serves
        post(f.engines.ports[0], "/v1/faults", {"kind": "partial_refit", "count": 100})
        events.clear()
        v = step()
        write(v)
        res = client.sync_weights(v)
        assert res.confirmed == [b] and res.missed == [a]
        quarantined = [e for k, e in events if k == "rollout_engine_quarantined"]
        assert {e["engine"] for e in quarantined} == {a} and len(quarantined) >= 3
        assert all(e["version"] == v and "log-probs differ" in e["reason"] for e in quarantined)
        assert health(f.engines.ports[0])["status"] == "quarantined"  # type: ignore[index]
        code, err = post(f.engines.ports[0], "/v1/completions", {"prompt": "write"})
        assert code == 503 and "quarantined" in err["error"]["message"]
        groups = client.generate(PROMPTS[:4], n=2, max_tokens=4)
        assert {c.engine for g in groups for c in g} == {b}  # never routed to the quarantined
        # the fault gone, the next sync refits it again and it serves once verified
        post(f.engines.ports[0], "/v1/faults", {"kind": "partial_refit", "count": 0})
        events.clear()
        res = client.sync_weights(v)
        assert sorted(res.confirmed) == [a, b]
        assert health(f.engines.ports[0])["status"] == "serving"  # type: ignore[index]

        # the file truncated between write and load (before the pointer names it)
        real = weights_mod.write_atomic
        truncated: list[Path] = []

        def corrupt_then_point(path: Path, data: str) -> None:
            if path.name == weights_mod.POINTER and not truncated:
                file = f.store.path_of(json.loads(data)["version"])
                file.write_bytes(file.read_bytes()[:-100])
                truncated.append(file)
            real(path, data)

        monkeypatch.setattr(weights_mod, "write_atomic", corrupt_then_point)
        v = step()
        write(v)
        monkeypatch.setattr(weights_mod, "write_atomic", real)
        assert truncated and f.store.current().version == v  # type: ignore[union-attr]
        rewrites: list[int] = []
        events.clear()
        res = client.sync_weights(v, rewrite=lambda: (rewrites.append(v), write(v)))
        assert sorted(res.confirmed) == [a, b] and rewrites == [v]
        quarantined = [e for k, e in events if k == "rollout_engine_quarantined"]
        assert {e["engine"] for e in quarantined} == {a, b}
        assert all("not what the trainer wrote" in e["reason"] for e in quarantined)
        assert {e["engine"] for k, e in events if k == "rollout_refit_verified"} == {a, b}
        # every version b was asked for was verified (by a sync, or a probe after a self-refit)
        assert client.refits_quarantined[a] >= 4 and client.refits_verified[b] >= 4
    finally:
        client.close()


def test_frozen_engine_leaves_routing_within_10s_and_requests_move(healthy: Fleet) -> None:
    frozen = healthy.engines.urls[-1]
    with healthy.client(prompts_per_request=1) as client:
        os.kill(healthy.engines.pid(len(healthy.engines.ports) - 1), signal.SIGSTOP)
        t0 = time.monotonic()
        groups = client.generate(PROMPTS, n=2, max_tokens=6)
        check_real(groups, 2, healthy.version)
        assert all(c.engine != frozen for g in groups for c in g)
        while client.engines()[frozen]["state"] != "dead":
            assert time.monotonic() - t0 < 10, client.engines()
            time.sleep(0.1)


def test_weight_sync_does_not_wait_for_a_frozen_engine_which_refits_later(healthy: Fleet) -> None:
    with healthy.client(sync_timeout_initial_s=3.0, sync_timeout_min_s=0.2) as client:
        os.kill(healthy.engines.pid(0), signal.SIGSTOP)
        v = healthy.publish()
        res = client.sync_weights(v)
        assert res.version == v and res.missed == [healthy.engines.urls[0]]
        assert sorted(res.confirmed) == sorted(healthy.engines.urls[1:])
        assert res.duration_s < res.timeout_s + 2
        groups = client.generate(PROMPTS, n=1, max_tokens=6)
        check_real(groups, 1, v)
        os.kill(healthy.engines.pid(0), signal.SIGCONT)  # it loads v from the store itself
        client.wait_serving(len(healthy.engines.ports), timeout=60)
        assert client.engines()[healthy.engines.urls[0]]["version"] == v
        for _ in range(3):  # the timeout follows the measured sync time
            assert client.sync_weights(healthy.publish()).missed == []
        assert client.sync_timeout_s() < 3.0  # 5 x the median measured sync, at least 0.2 s


def test_engine_killed_with_requests_in_flight_loses_them_to_the_others(serving: Fleet) -> None:
    """kill -9 of an engine mid-generation: its requests (held there by a 'hang' fault, so
    that they are surely in flight) fail as a reset connection or with the engine declared
    dead, and are generated again elsewhere; nothing of the dead engine's is in the batch."""
    v = serving.alive()[0]
    victim = serving.engines.urls[v]
    post(serving.engines.ports[v], "/v1/faults", {"kind": "hang", "count": 1000})
    with serving.client(prompts_per_request=1, failure_cooldown_s=0.0) as client:
        got: dict[str, Any] = {}

        def run() -> None:
            try:
                got["groups"] = client.generate(PROMPTS, n=2, max_tokens=6)
            except BaseException as e:  # reported by the assertions below
                got["error"] = e

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while client.engines()[victim]["inflight"] == 0:
            assert time.monotonic() < deadline and t.is_alive(), (got, client.engines())
            time.sleep(0.05)
        serving.engines.kill(v, signal.SIGKILL)
        t.join(timeout=120)
        assert not t.is_alive() and "error" not in got, got
        check_real(got["groups"], 2, serving.version)
        assert all(c.engine != victim for g in got["groups"] for c in g)
        lost = client.failures["connection"] + client.failures["engine_dead"]
        assert lost >= 1, client.failures
        assert client.retries == sum(client.failures.values())
        # out of routing at once (suspect), dead at its next health probe (refused)
        deadline = time.monotonic() + 10
        while client.engines()[victim]["state"] != "dead":
            assert client.engines()[victim]["state"] in ("suspect", "dead")
            assert time.monotonic() < deadline, client.engines()
            time.sleep(0.1)


def test_restarted_engine_serves_only_after_loading_the_current_version(
    one_down: tuple[Fleet, int],
) -> None:
    """A replica down (kill -9: here, or by the test before, whose kill is reused), a version
    published meanwhile; the replica started again joins the routing only once it holds that
    version, while the others keep the fleet busy. It is started with a warm standby beside
    it, for the next test."""
    fleet, down = one_down
    with fleet.client(prompts_per_request=1, health_interval_s=0.2) as client:
        v = fleet.publish()  # published while the replica is down
        client.sync_weights(v)
        fleet.start_with_standby(down)
        rejoined = fleet.engines.urls[down]
        seen: set[str] = set()
        deadline = time.monotonic() + 120
        while rejoined not in seen:  # keep the fleet busy while the replica boots
            assert time.monotonic() < deadline, client.engines()
            groups = client.generate(PROMPTS, n=1, max_tokens=4)
            check_real(groups, 1, v)
            seen.update(c.engine for g in groups for c in g)
        # never routed to it while it was loading, nor before it held the current version
        assert client.failures["not_serving"] == client.failures["stale"] == 0
        h = health(fleet.engines.ports[down])
        assert h is not None and h["weight_version"] == v


def test_warm_standby_takes_the_port_of_a_killed_replica(fleet: Fleet) -> None:
    """The warm standby the restart test started beside its replica (started here when this
    test runs alone): built, waiting for its promotion; kill -9 of the replica promotes it."""
    spares = fleet.engines.spares
    i = next((k for k, s in enumerate(spares) if s is not None and s.poll() is None), None)
    if i is None:
        fleet.heal()
        i = 0
        fleet.engines.kill(i, signal.SIGKILL)
        fleet.start_with_standby(i)
    spare = spares[i]
    assert spare is not None
    engines = fleet.engines
    engines.wait_serving(i, version=fleet.version, timeout=180)
    deadline = time.monotonic() + 180  # the standby has built its model: it waits for its order
    log = RunDir(fleet.run_dir).role_log("rollout", i)
    while not any(
        f"engine[{spare.pid}]" in ln and "standby ready" in ln
        for ln in log.read_text().splitlines()
    ):
        assert time.monotonic() < deadline and spare.poll() is None
        time.sleep(0.2)
    old = engines.pid(i)
    engines.restart(i)  # kill -9 the replica; the standby is promoted
    fleet.own()
    assert engines.pid(i) == spare.pid != old
    new_spare = engines.spares[i]
    assert new_spare is not None and new_spare.pid != spare.pid  # a new one
    fleet.drop_spare()  # (not needed later: stopped before it imports much)
    engines.wait_serving(i, version=fleet.version, timeout=60)
    h = health(engines.ports[i])
    assert h is not None and h["pid"] == spare.pid
    code, out = post(engines.ports[i], "/v1/completions", {"prompt": "write 7", "max_tokens": 3})
    assert code == 200 and out["weight_version"] == fleet.version


def test_dead_engine_request_is_retried_on_another(serving: Fleet) -> None:
    v = serving.alive()[0]  # the other running replicas answer in its place
    # probes rare: the client still believes the victim serves when it is already dead
    with serving.client(health_interval_s=600, prompts_per_request=1) as client:
        serving.engines.kill(v, signal.SIGKILL)
        groups = client.generate(PROMPTS, n=2, max_tokens=6)
        check_real(groups, 2, serving.version)
        dead = serving.engines.urls[v]
        refused = client.failures["refused"]
        assert refused >= 1  # the requests sent to it before it was known dead
        # each failed request was retried: refused by the dead engine, or in flight on it
        # when a refusal declared it dead (engine_dead), or slow on a loaded machine
        assert client.retries == sum(client.failures.values()), client.failures
        assert set(client.failures) <= {"refused", "engine_dead", "timeout"}, client.failures
        assert all(c.engine != dead for g in groups for c in g)
        assert client.engines()[dead]["state"] == "dead"
        check_real(client.generate(PROMPTS, n=2, max_tokens=6), 2, serving.version)
        assert client.failures["refused"] == refused  # out of routing at the first refusal
