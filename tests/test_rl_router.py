"""The fleet endpoint (trainguard.rl.router) as a real process in front of real engine
processes (tests/stub_engine.py: generation is not the subject): engines killed -9 and
restarted behind it with no client error, a re-placed replica followed from the published
placement, the job's fleet token required, and its settings checked."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.launch_utils import base_env
from trainguard.core import jsonhttp
from trainguard.core.atomicfile import write_atomic
from trainguard.core.config import load_config
from trainguard.core.config.roles import RolesConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import parse_completion
from trainguard.core.events import EventLog
from trainguard.core.fleetauth import job_secret, role_token
from trainguard.core.plugin import AgentContext
from trainguard.rl.rollout_types import RolloutConfig
from trainguard.rl.router import FleetRouter
from trainguard.rl.weights import WeightStore
from trainguard.roles.plugin import RolesPlugin
from trainguard.testing.ports import free_port

ROLLOUT_TOKEN = secrets.token_hex(32)
FLEET_TOKEN = secrets.token_hex(32)


class Proc:
    def __init__(self, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = log.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        self.kill9()
        self._log.close()


class Fleet:
    def __init__(self, root: Path) -> None:
        import torch

        self.root = root
        store = WeightStore(root / "weights")
        store.publish(0, {"w": torch.zeros(1)})
        self.weights = store.root
        self.run_dir = root / "run"
        (self.run_dir / "roles" / "rollout").mkdir(parents=True)
        self.engines = [self.engine(free_port(), f"e{i}") for i in range(2)]
        self.port = free_port()
        env = {
            **os.environ,
            envvars.ROLLOUT_URLS: ",".join(e.url for e in self.engines),
            envvars.ROLLOUT_TOKEN: ROLLOUT_TOKEN,
            envvars.FLEET_TOKEN: FLEET_TOKEN,
            envvars.ROLE_RUN_DIR: str(self.run_dir),
        }
        cmd = [sys.executable, "-m", "trainguard.rl.router", "--port", str(self.port),
               "--health-interval-s", "0.2"]  # fmt: skip
        self.router = Proc(cmd, self.port, root / "router.log", env)
        self.wait_serving(2, 60)

    def engine(self, port: int, name: str) -> Proc:
        env = {**os.environ, envvars.ROLE_TOKEN: ROLLOUT_TOKEN}
        cmd = [sys.executable, "-m", "tests.stub_engine", "--port", str(port),
               "--weights-dir", str(self.weights)]  # fmt: skip
        return Proc(cmd, port, self.root / f"{name}.log", env)

    def call(self, method: str, path: str, body: Any = None, token: str | None = FLEET_TOKEN):
        return jsonhttp.request(
            "127.0.0.1", self.port, method, path, body, timeout=10, max_bytes=1 << 20,
            token=token,
        )  # fmt: skip

    def health(self) -> dict[str, Any]:
        try:
            r = self.call("GET", "/health")
        except jsonhttp.TransportError:
            return {}
        return json.loads(r.body) if r.status == 200 else {}

    def wait_serving(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.health().get("serving_engines", 0) < n:
            assert self.router.proc.poll() is None, (self.root / "router.log").read_text()
            assert time.monotonic() < deadline, self.health()
            time.sleep(0.1)

    def close(self) -> None:
        for p in [self.router, *self.engines]:
            p.close()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A fleet per test: the engines a test kills and restarts end with it, by PID."""
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


class Looper:
    """A client calling the endpoint in a loop (one request at a time, as an environment
    does), counting its answers and errors."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 4, "logprobs": 0}
        while not self._stop.is_set():
            try:
                r = self.fleet.call("POST", "/v1/completions", body)
                if r.status != 200:
                    self.errors.append(f"HTTP {r.status}: {r.body[:200]!r}")
                else:
                    parse_completion(r.body, expected=4)
                    self.ok += 1
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}")

    def wait_answers(self, n: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        target = self.ok + n
        while self.ok < target and not self.errors:
            assert time.monotonic() < deadline, f"{self.ok} answers"
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def test_unsigned_or_other_role_requests_are_refused(fleet: Fleet) -> None:
    body = {"prompt": "a", "max_tokens": 2}
    for token in (None, ROLLOUT_TOKEN, secrets.token_hex(32)):
        r = fleet.call("POST", "/v1/completions", body, token=token)
        assert r.status == 401, r.body
        assert b"choices" not in r.body
        assert fleet.call("GET", "/health", token=token).status == 401
    models = json.loads(fleet.call("GET", "/v1/models").body)
    assert models["object"] == "list" and models["data"]
    bad = fleet.call("POST", "/v1/completions", {"prompt": 3})
    assert bad.status == 400 and b"prompt" in bad.body


def test_engines_killed_behind_the_endpoint_cost_no_client_error(fleet: Fleet) -> None:
    loop = Looper(fleet)
    try:
        loop.wait_answers(5)
        for k in range(2):  # each engine once: killed -9 mid-traffic, restarted on its port
            i = k % 2
            old = fleet.engines[i]
            old.kill9()
            loop.wait_answers(5)  # answered by the survivor meanwhile
            fleet.engines[i] = fleet.engine(old.port, f"e{i}-{k}")
            fleet.wait_serving(2, 60)
            loop.wait_answers(5)
    finally:
        loop.stop()
    assert loop.errors == [], loop.errors[:5]
    stats = json.loads(fleet.call("GET", "/stats").body)
    assert stats.get("failed", 0) == 0
    assert stats["answered"] >= loop.ok


def test_a_replaced_replica_is_followed_from_the_published_placement(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica 1 moves to another port (as a re-placement on another node does): the
    supervisor's state file names the new URL; the old process dies; no client error, at the
    endpoint nor in the trainer's rollout client (built from its job environment)."""
    from trainguard.rl.client import RolloutClient

    for var, value in ((envvars.RUN_DIR, str(fleet.run_dir)), (envvars.ROLLOUT_TOKEN, ROLLOUT_TOKEN),
                       (envvars.ROLLOUT_URLS, ",".join(e.url for e in fleet.engines))):  # fmt: skip
        monkeypatch.setenv(var, value)
    client = RolloutClient(config=RolloutConfig(health_interval_s=0.2))
    moved = fleet.engine(free_port(), "e1-moved")
    try:
        state = {"role": "rollout", "replica": 1, "url": moved.url, "state": "serving"}
        write_atomic(fleet.run_dir / "roles" / "rollout" / "1.json", json.dumps(state))
        loop = Looper(fleet)
        try:
            loop.wait_answers(3)
            fleet.engines[1].kill9()
            deadline = time.monotonic() + 30
            while fleet.health().get("engines") != 2 or fleet.health().get("serving_engines") != 2:
                assert time.monotonic() < deadline, fleet.health()
                time.sleep(0.1)
            loop.wait_answers(5)
        finally:
            loop.stop()
        assert loop.errors == [], loop.errors[:5]
        # the client left the dead URL for the published one, and generates on both engines
        assert sorted(client.table.engines) == sorted([fleet.engines[0].url, moved.url])
        for _ in range(4):
            assert len(client.generate(["a", "b"], n=2, max_tokens=4)) == 2
        assert client.failures.total() == 0, client.failures
    finally:
        client.close()
        (fleet.run_dir / "roles" / "rollout" / "1.json").unlink()
        fleet.engines[1].close()
        fleet.engines[1] = moved


def test_router_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"declare \[roles.rollout\]"):
        RolesConfig(router=True)
    with pytest.raises(ValueError, match="router_port 70000"):
        RolesConfig(router=True, router_port=70000, rollout={"command": "x"})


def test_the_roles_plugin_runs_the_endpoint_and_keeps_it_running(tmp_path: Path) -> None:
    """``[roles] router = true``: the plugin starts the endpoint with the engines, gives its
    URL and token to the workers and the replicas, restarts it when it is killed -9, and
    stops it with the job."""
    import torch

    WeightStore(tmp_path / "weights").publish(0, {"w": torch.zeros(1)})
    port = free_port()
    engine = [sys.executable, "-m", "tests.stub_engine", "--port", str(port),
              "--weights-dir", str(tmp_path / "weights")]  # fmt: skip
    ctx = AgentContext(config=load_config(env={}), run_dir=tmp_path, events=EventLog(tmp_path))
    ctx.config.roles = RolesConfig(
        rollout={"command": engine, "replicas": 1, "port": port},
        router=True,
        probe_interval_s=0.25,
        probe_timeout_s=1.0,
        stop_timeout_s=3.0,
    )
    with pytest.MonkeyPatch.context() as mp:
        for k, v in base_env().items():
            mp.setenv(k, v)
        plugin = RolesPlugin(ctx)
    try:
        env = plugin.worker_env(ctx)
        token = role_token(job_secret(tmp_path), "fleet")
        assert env[envvars.FLEET_TOKEN] == token
        url = env[envvars.FLEET_URL]
        fleet_port = int(url.rsplit(":", 1)[1])
        assert url == f"http://127.0.0.1:{fleet_port}"
        plugin.before_rendezvous(ctx)
        assert plugin.router is not None and plugin.router.proc is not None

        def answer() -> bool:
            try:
                r = jsonhttp.request(
                    "127.0.0.1", fleet_port, "POST", "/v1/completions",
                    {"prompt": "a", "max_tokens": 2}, timeout=5, max_bytes=1 << 20, token=token,
                )  # fmt: skip
            except jsonhttp.TransportError:
                return False
            return r.status == 200 and bool(parse_completion(r.body, expected=1).choices)

        def wait(what: str, cond: Any, timeout: float = 60) -> None:
            deadline = time.monotonic() + timeout
            while not cond():
                assert time.monotonic() < deadline, what
                plugin.on_monitor(ctx, None, None)  # type: ignore[arg-type]
                time.sleep(0.1)

        wait("an answer through the endpoint", answer)
        rep = plugin.supervisor.replicas["rollout"][0]
        assert rep.pid is not None
        environ = Path(f"/proc/{rep.pid}/environ").read_bytes().split(b"\0")
        assert f"{envvars.FLEET_URL}={url}".encode() in environ  # environments find it
        first = plugin.router.proc.pid
        os.kill(first, signal.SIGKILL)
        wait("the endpoint restarted", lambda: plugin.router.proc.pid != first and answer())
        assert plugin.router.starts == 2
    finally:
        plugin.close()
    assert plugin.router.proc is None
    with pytest.raises(jsonhttp.TransportError):
        jsonhttp.request("127.0.0.1", fleet_port, "GET", "/health", timeout=2, max_bytes=1 << 10)


def test_the_placement_follows_what_the_supervisors_published(tmp_path: Path) -> None:

    a, b = "http://127.0.0.1:9001", "http://127.0.0.1:9002"
    router = FleetRouter([a, b], RolloutConfig(), run_dir=str(tmp_path), node="n1")
    states = tmp_path / "roles" / "rollout"
    states.mkdir(parents=True)

    def publish(i: int, url: str, state: str = "serving", node: str = "n1") -> None:
        rep = {"role": "rollout", "replica": i, "url": url, "state": state, "node": node}
        write_atomic(states / f"{i}.json", json.dumps(rep))

    assert router.placement() == [a, b]  # nothing published yet: the configured URLs
    publish(1, "http://127.0.0.1:9003")  # replica 1 restarted elsewhere on this node
    assert router.placement() == [a, "http://127.0.0.1:9003"]
    publish(1, "http://127.0.0.1:9009", node="n2")  # another trainer node's own replica
    assert router.placement() == [a, b]
    publish(1, "http://10.0.0.7:8101", node="role-node-2")  # re-placed on a role node
    assert router.placement() == [a, "http://10.0.0.7:8101"]
    publish(0, a, state="failed")  # out of the role for good
    assert router.placement() == ["http://10.0.0.7:8101"]
    router.refresh()
    assert list(router.table.engines) == ["http://10.0.0.7:8101"]
    router.close()
