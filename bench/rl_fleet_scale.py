"""The rollout fleet at scale: 8, 16, 32 and 64 engines (real processes speaking the engine
contract, bench/cheap_engine.py: no model, no torch) behind 4 trainer-rank clients
(:class:`trainguard.rl.RolloutClient`, each with its own health probes) and the fleet endpoint
(``python -m trainguard.rl.router``), every request signed with the job's tokens.

    python bench/rl_fleet_scale.py                  # 8, 16, 32, 64 engines (~5 min on 2 cores)
    python bench/rl_fleet_scale.py --sizes 8,16     # fewer
    python bench/rl_fleet_scale.py --router-only    # only router_client_errors (~1 min)

Figures, per fleet size (``"<figure>": {"8": ..., "16": ..., ...}``):

- ``probe_rps``: health probes per second the 4 clients and the endpoint send (counted by the
  engines); ``probe_cpu_frac``: CPU seconds per second of the clients' process while idle
  (probing only);
- ``route_overhead_client_ms`` / ``route_overhead_endpoint_ms``: the median latency of a
  one-prompt request through ``RolloutClient.generate`` / through the endpoint, minus the
  median of the same request sent straight to one engine, interleaved in rounds;
- ``refit_fanout_s``: ``sync_weights`` to every engine (median of 5 versions);
- ``death_to_unrouted_s``: kill -9 of an engine → out of the client's routing (median of 5
  kills); ``death_to_unrouted_endpoint_s``: the same seen from the endpoint's health.

``router_client_errors``: a client looping on the endpoint (one request at a time) while 5
engines in turn are killed -9 behind it and restarted on their ports: the requests that did not
get a valid answer (``router_requests`` answered, ``router_retries`` the endpoint's retries).
Ends with one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.core import jsonhttp  # noqa: E402
from trainguard.core.atomicfile import write_atomic  # noqa: E402
from trainguard.core.contracts import envvars  # noqa: E402
from trainguard.core.contracts.engine import (  # noqa: E402
    COMPLETIONS_PATH,
    parse_completion,
    probe_health,
)
from trainguard.core.contracts.engine import ReplicaStatus as S  # noqa: E402
from trainguard.rl.client import RolloutClient  # noqa: E402
from trainguard.rl.rollout_types import EngineState, RolloutConfig  # noqa: E402
from trainguard.rl.weights import POINTER, WeightStore  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402

ROLLOUT_TOKEN = secrets.token_hex(32)
FLEET_TOKEN = secrets.token_hex(32)
CLIENTS = 4
ROUTER_INTERVAL_S = 1.0
BODY = {"prompt": ["a"], "n": 1, "max_tokens": 8}


def publish(store: WeightStore, version: int) -> None:
    """A version in the store without torch (the cheap engines never read the tensors)."""
    store.root.mkdir(parents=True, exist_ok=True)
    path = store.path_of(version)
    write_atomic(path, f"cheap weights {version}\n")
    meta = {"version": version, "file": path.name, "bytes": path.stat().st_size, "time": 0}
    write_atomic(store.root / POINTER, json.dumps(meta))


class Engine:
    def __init__(self, root: Path, weights: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, envvars.ROLE_TOKEN: ROLLOUT_TOKEN, "PYTHONPATH": str(REPO)}
        self._log = (root / f"engine-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "bench" / "cheap_engine.py"), "--port", str(self.port),
             "--weights-dir", str(weights)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def serving(self) -> bool:
        p = probe_health(self.port, timeout=2.0, token=ROLLOUT_TOKEN)
        return p.health is not None and p.health.status is S.SERVING

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def wait_all(engines: list[Engine], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    left = list(engines)
    while left:
        left = [e for e in left if not e.serving()]
        if left and time.monotonic() > deadline:
            raise SystemExit(f"{len(left)} engines not serving after {timeout:.0f} s")
        if left:
            time.sleep(0.3)


class Router:
    def __init__(self, root: Path, urls: list[str], interval: float = 1.0) -> None:
        self.port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            envvars.ROLLOUT_URLS: ",".join(urls),
            envvars.ROLLOUT_TOKEN: ROLLOUT_TOKEN,
            envvars.FLEET_TOKEN: FLEET_TOKEN,
        }
        self._log = (root / f"router-{self.port}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.rl.router", "--port", str(self.port),
             "--health-interval-s", str(interval)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def call(self, method: str, path: str, body: Any = None) -> jsonhttp.Response:
        return jsonhttp.request(
            "127.0.0.1", self.port, method, path, body, timeout=30, max_bytes=1 << 22,
            token=FLEET_TOKEN,
        )  # fmt: skip

    def health(self) -> dict[str, Any]:
        try:
            r = self.call("GET", "/health")
            return json.loads(r.body) if r.status == 200 else {}
        except jsonhttp.TransportError:
            return {}

    def wait_serving(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.health().get("serving_engines", 0) < n:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the endpoint has not {n} engines serving: {self.health()}")
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _direct(e: Engine) -> float:
    t0 = time.perf_counter()
    r = jsonhttp.request(
        "127.0.0.1", e.port, "POST", COMPLETIONS_PATH, BODY, timeout=30, max_bytes=1 << 22,
        token=ROLLOUT_TOKEN,
    )  # fmt: skip
    parse_completion(r.body, expected=1)
    return time.perf_counter() - t0


def _via_router(router: Router) -> float:
    t0 = time.perf_counter()
    r = router.call("POST", COMPLETIONS_PATH, BODY)
    parse_completion(r.body, expected=1)
    return time.perf_counter() - t0


def _via_client(c: RolloutClient) -> float:
    t0 = time.perf_counter()
    c.generate(["a"], n=1, max_tokens=8)
    return time.perf_counter() - t0


def _count_probes(tables: list[Any]) -> list[list[int]]:
    """Wrap each table's probe to count the probes it sends."""
    counts: list[list[int]] = []
    for t in tables:
        box = [0]
        orig = t.probe

        def counted(eng: Any, expected: Any = None, _o: Any = orig, _b: list[int] = box) -> None:
            _b[0] += 1
            _o(eng, expected)

        t.probe = counted
        counts.append(box)
    return counts


def one_size(root: Path, n: int, rounds: int, kills: int) -> dict[str, float]:
    d = root / f"n{n}"
    d.mkdir()
    store = WeightStore(d / "weights")
    publish(store, 0)
    engines = [Engine(d, store.root) for _ in range(n)]
    router: Router | None = None
    clients: list[RolloutClient] = []
    try:
        wait_all(engines)
        urls = [e.url for e in engines]
        cfg = RolloutConfig(health_interval_s=1.0, health_timeout_s=2.0, prompts_per_request=1)
        clients = [RolloutClient(urls, config=cfg, token=ROLLOUT_TOKEN) for _ in range(CLIENTS)]
        for c in clients:
            c.wait_serving(n, timeout=120)
        router = Router(d, urls, ROUTER_INTERVAL_S)
        router.wait_serving(n)
        # probe load: probes counted over a quiet window, and the clients' CPU meanwhile
        counts = _count_probes([c.table for c in clients])
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(5.0)
        cpu, dt = time.process_time() - c0, time.monotonic() - t0
        client_probes = sum(b[0] for b in counts)
        probe_rps = client_probes / dt + n / ROUTER_INTERVAL_S  # the endpoint's, by design
        # routing overhead: direct / client / endpoint, interleaved
        direct, via_c, via_r = [], [], []
        for i in range(rounds):
            direct.append(_direct(engines[i % n]))
            via_c.append(_via_client(clients[i % CLIENTS]))
            via_r.append(_via_router(router))
        base = statistics.median(direct)
        # refit fan-out
        fanout = []
        for v in range(1, 6):
            publish(store, v)
            res = clients[0].sync_weights(v)
            if res.missed:
                raise SystemExit(f"refit to {v}: {len(res.missed)} engines missed it")
            fanout.append(res.duration_s)
            for c in clients[1:]:
                c.table.set_policy_version(v)
        # death → out of routing (client and endpoint)
        to_client, to_router = [], []
        rng = random.Random(n)
        for k in range(kills):
            victim = engines[k]
            rec = clients[0].table.engines[victim.url]
            time.sleep(rng.uniform(0.0, 1.0))  # out of phase with the probes
            serving_before = router.health().get("serving_engines", n)
            t_kill = time.monotonic()
            victim.kill9()
            got_c = got_r = None
            while (got_c is None or got_r is None) and time.monotonic() - t_kill < 30:
                now = time.monotonic()
                if got_c is None and rec.state in (EngineState.DEAD, EngineState.SUSPECT):
                    got_c = now - t_kill
                if got_r is None and router.health().get("serving_engines", n) < serving_before:
                    got_r = now - t_kill
                time.sleep(0.005)
            if got_c is not None:
                to_client.append(got_c)
            if got_r is not None:
                to_router.append(got_r)
        out = {
            "probe_rps": round(probe_rps, 1),
            "probe_cpu_frac": round(cpu / dt, 4),
            "route_overhead_client_ms": round((statistics.median(via_c) - base) * 1e3, 3),
            "route_overhead_endpoint_ms": round((statistics.median(via_r) - base) * 1e3, 3),
            "direct_request_ms": round(base * 1e3, 3),
            "refit_fanout_s": round(statistics.median(fanout), 4),
            "death_to_unrouted_s": round(statistics.median(to_client), 3) if to_client else None,
            "death_to_unrouted_endpoint_s": round(statistics.median(to_router), 3)
            if to_router
            else None,
        }
        print(f"  {n} engines: {out}", flush=True)
        return out  # type: ignore[return-value]
    finally:
        for c in clients:
            c.close()
        if router is not None:
            router.close()
        for e in engines:
            e.kill9()


def router_client_errors(root: Path, kills: int = 5, engines_n: int = 3) -> dict[str, Any]:
    """A client looping on the endpoint while ``kills`` engines in turn are killed -9 and
    restarted behind it: its errors, answers and the endpoint's retries."""
    d = root / "router"
    d.mkdir(parents=True)
    store = WeightStore(d / "weights")
    publish(store, 0)
    engines = [Engine(d, store.root) for _ in range(engines_n)]
    router = Router(d, [e.url for e in engines], interval=0.5)
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def loop() -> None:
        body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 8}
        while not stop.is_set():
            try:
                r = router.call("POST", COMPLETIONS_PATH, body)
                if r.status != 200:
                    errors.append(f"HTTP {r.status}: {r.body[:200]!r}")
                    continue
                parse_completion(r.body, expected=4)
                answered[0] += 1
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    try:
        wait_all(engines)
        router.wait_serving(engines_n)
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        for k in range(kills):
            time.sleep(1.0)
            i = k % engines_n
            port = engines[i].port
            engines[i].kill9()
            time.sleep(1.0)
            engines[i] = Engine(d, store.root, port)
            wait_all([engines[i]])
            router.wait_serving(engines_n)
        time.sleep(1.0)
        stop.set()
        t.join(60)
        stats = json.loads(router.call("GET", "/stats").body)
    finally:
        stop.set()
        router.close()
        for e in engines:
            e.kill9()
    for line in errors[:5]:
        print(f"  router client error: {line}", flush=True)
    return {
        "router_client_errors": len(errors),
        "router_requests": answered[0],
        "router_kills": kills,
        "router_retries": stats.get("retries", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8,16,32,64")
    p.add_argument("--rounds", type=int, default=60, help="requests per path and size")
    p.add_argument("--kills", type=int, default=5, help="engine deaths per size")
    p.add_argument("--router-only", action="store_true")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rl-fleet-scale-"))
    print(f"runs in {root}", flush=True)
    out: dict[str, Any] = router_client_errors(root)
    print(f"  endpoint under engine kills: {out}", flush=True)
    if not args.router_only:
        per = {
            n: one_size(root, n, args.rounds, args.kills) for n in map(int, args.sizes.split(","))
        }
        for key in next(iter(per.values())):
            out[key] = {str(n): per[n][key] for n in per}
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
