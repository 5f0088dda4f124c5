"""Hostile servers, as real processes on loopback: an engine (and a reward server) answering
each malformed shape (a mixed-type index, non-numeric or out-of-range token ids, NaN and
infinite log-probs and rewards, a 400-digit number, JSON nested 100 000 deep, a truncated or
non-JSON body, an absurd ``inflight``), and a process squatting a replica's port. Each answer is
a counted ``malformed`` failure retried on the healthy server beside it (never an exception out
of ``generate()``/``score()``, never a sample or a reward taken from it); the squatter is never
routed to."""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stub_engine import SHAPES
from trainguard.core import jsonhttp
from trainguard.core.contracts import engine as ec
from trainguard.core.contracts import envvars
from trainguard.core.fleetauth import sign
from trainguard.rl import RolloutClient, RolloutConfig
from trainguard.rl.reward import RewardClient
from trainguard.rl.weights import WeightStore
from trainguard.testing.ports import free_port

pytestmark = pytest.mark.xdist_group("engine_hostile")

TOKEN = secrets.token_hex(32)
"""The job's token every server here checks (a hostile engine of the job holds it too)."""


class Proc:
    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("ab")
        env = {**os.environ, envvars.ROLE_INCARNATION: f"nonce-{port}", envvars.ROLE_TOKEN: TOKEN}
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while ec.probe_health(port, timeout=1.0, token=TOKEN).outcome in (
            "refused",
            "timeout",
            "error",
        ):
            assert self.proc.poll() is None, f"{argv} exited; see {log}"
            assert time.monotonic() < deadline, argv
            time.sleep(0.05)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        r = jsonhttp.request(
            "127.0.0.1", self.port, method, path, body, timeout=10, max_bytes=1 << 20,
            token=TOKEN,
        )  # fmt: skip
        return json.loads(r.body)

    def shape(self, shape: str) -> None:
        assert self.call("POST", "/control", {"shape": shape}) == {"shape": shape}

    def requests(self) -> int:
        return int(self.call("GET", "/control")["requests"])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


class Servers:
    def __init__(self, root: Path) -> None:
        import torch

        store = WeightStore(root / "weights")
        store.publish(0, {"w": torch.zeros(1)})
        stub = [sys.executable, "-m", "tests.stub_engine", "--weights-dir", str(store.root)]
        hp, gp, rp = free_port(), free_port(), free_port()
        self.hostile = Proc([*stub, "--port", str(hp), "--hostile"], hp, root / "hostile.log")
        self.healthy = Proc([*stub, "--port", str(gp)], gp, root / "healthy.log")
        self.reward = Proc(
            [sys.executable, "-m", "trainguard.rl.reward", "--port", str(rp),
             "--function", "trainguard.rl.tiny:digit_reward"],
            rp, root / "reward.log",
        )  # fmt: skip

    def close(self) -> None:
        for p in (self.hostile, self.healthy, self.reward):
            p.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("hostile"))
    try:
        yield s
    finally:
        s.close()


def client(servers: Servers, events: list[dict[str, Any]], **cfg: Any) -> RolloutClient:
    identities = cfg.pop("identities", None)
    settings = {
        "prompts_per_request": 1,
        "health_interval_s": 0.2,
        "failure_cooldown_s": 0.5,
        **cfg,
    }
    c = RolloutClient(
        [servers.hostile.url, servers.healthy.url],
        config=RolloutConfig(**settings),
        events=lambda kind, **f: events.append({"kind": kind, **f}),
        identities=identities,
        token=TOKEN,
    )
    c.set_policy_version(0)
    return c


PROMPTS = ["please write 1 now", "write 2", "please write 3 now", "now 4"]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_malformed_completion_is_counted_and_retried_on_the_healthy_engine(
    servers: Servers, shape: str
) -> None:
    servers.hostile.shape(shape)
    events: list[dict[str, Any]] = []
    with client(servers, events) as c:
        c.wait_serving(2, timeout=20)
        out = c.generate(PROMPTS, n=2, max_tokens=3, logprobs=True)
        asked = servers.hostile.requests()
        assert asked >= 1, "the hostile engine was never asked: the test proves nothing"
        assert c.failures == {"malformed": asked} and c.retries == asked
        assert [len(g) for g in out] == [2] * len(PROMPTS)
        assert {x.engine for g in out for x in g} == {servers.healthy.url}
        for g in out:
            for x in g:
                assert all(0 <= t < 17 for t in x.token_ids)
                assert x.logprobs is not None and all(math.isfinite(v) for v in x.logprobs)
        failed = [e for e in events if e["kind"] == "rollout_failed"]
        assert len(failed) == asked and all(e["reason"] == "malformed" for e in failed)
        assert all(e["engine"] == servers.hostile.url and e["retried"] for e in failed)


@pytest.mark.parametrize("shape", ["deep", "not_json", "huge_version"])
def test_a_malformed_weight_update_answer_is_not_a_confirmation(
    servers: Servers, shape: str
) -> None:
    servers.hostile.shape(shape)
    with client(servers, []) as c:
        c.wait_serving(2, timeout=20)
        result = c.sync_weights(0)
        # not confirmed (out of routing until its health reports the version), never raised
        assert result.confirmed == [servers.healthy.url] and result.missed == [servers.hostile.url]


def test_an_engine_reporting_an_absurd_load_attracts_nothing(servers: Servers) -> None:
    servers.hostile.shape("absurd_inflight")  # "inflight": -10**9, completions well-formed
    with client(servers, []) as c:
        c.wait_serving(1, timeout=20)
        out = c.generate(PROMPTS * 2, max_tokens=2)
        assert {x.engine for g in out for x in g} == {servers.healthy.url}
        assert servers.hostile.requests() == 0
        assert c.engines()[servers.hostile.url]["state"] in ("suspect", "dead")


def test_a_process_squatting_a_replicas_port_is_never_routed_to(servers: Servers) -> None:
    """Its answers are well-formed, but its health names another incarnation than the one the
    role supervisor published for that port."""
    servers.hostile.shape("wrong_incarnation")
    published = {servers.hostile.url: ec.Identity(None, "the-replica-started-there")}
    with client(servers, [], identities=lambda: published) as c:
        c.wait_serving(1, timeout=20)
        time.sleep(0.5)  # a few probe rounds: the squatter stays out
        out = c.generate(PROMPTS * 2, max_tokens=2)
        assert {x.engine for g in out for x in g} == {servers.healthy.url}
        assert servers.hostile.requests() == 0
        assert c.engines()[servers.hostile.url]["state"] in ("suspect", "dead")
    # the same answers without the identity check are taken: the check is what refuses it
    with client(servers, []) as c:
        c.wait_serving(2, timeout=20)
        c.generate(PROMPTS * 2, max_tokens=2)
        assert servers.hostile.requests() >= 1


def test_a_completion_from_another_process_than_the_probed_one_is_refused(
    servers: Servers,
) -> None:
    servers.hostile.shape("other_incarnation")
    with client(servers, []) as c:
        c.wait_serving(2, timeout=20)
        out = c.generate(PROMPTS, max_tokens=2)
        asked = servers.hostile.requests()
        assert asked >= 1 and c.failures == {"engine_dead": asked}
        assert {x.engine for g in out for x in g} == {servers.healthy.url}


@pytest.mark.parametrize("shape", ["nan_reward", "inf_reward", "huge_reward", "deep"])
def test_a_malformed_reward_is_counted_and_scored_by_the_next_server(
    servers: Servers, shape: str
) -> None:
    servers.hostile.shape(shape)
    events: list[dict[str, Any]] = []
    rc = RewardClient(
        [servers.hostile.url, servers.reward.url],
        retry_wait_s=0.0,
        events=lambda kind, **f: events.append({"kind": kind, **f}),
        token=TOKEN,
    )
    rewards = rc.score(["please write 3 now"] * 2, ["3 3", "4"])
    assert rewards == [1.0, 0.0]  # the real function's, never NaN / inf / a made-up value
    assert servers.hostile.requests() == 1
    assert rc.failures == {"malformed": 1} and rc.retries == 1
    assert [(e["kind"], e["reason"], e["server"]) for e in events] == [
        ("reward_failed", "malformed", servers.hostile.url)
    ]


def test_the_reward_server_caps_request_bodies_and_stays_small(servers: Servers) -> None:
    def rss_kib(pid: int) -> int:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    before = rss_kib(servers.reward.proc.pid)
    port = servers.reward.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # 256 MiB announced, none sent: the answer comes at once, the body is never read
        auth = "".join(f"{k}: {v}\r\n" for k, v in sign(TOKEN, "POST", "/v1/rewards", port).items())
        s.sendall(
            f"POST /v1/rewards HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 268435456\r\n\r\n".encode()
        )
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"limit" in answer
    assert rss_kib(servers.reward.proc.pid) - before < 32 << 10  # not the 256 MiB claimed
    assert ec.probe_health(servers.reward.port, token=TOKEN).outcome == "ok"
