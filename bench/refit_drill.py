"""Weight sync through an engine's death, as a drill: real engine processes
(bench/cheap_engine.py, generation is not the subject, each weight load ``load_delay_s`` long)
behind a :class:`~trainguard.rl.RolloutClient`; in each case one engine is killed -9 or
frozen (SIGSTOP) once it has loaded a chosen share of the version being pushed (the stub
holds its load there, so the point is exact whatever the machine's load). Measured: how long
the trainer's sync call waited against its timeout, which engines confirmed, and how long the
victim took to serve the current version again (killed: restarted on its port, as the role
supervisor does; frozen: continued)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._support import free_port  # noqa: E402
from trainguard.core import jsonhttp  # noqa: E402
from trainguard.core.contracts import envvars  # noqa: E402
from trainguard.rl import RolloutClient, RolloutConfig, SyncResult, WeightStore  # noqa: E402

__all__ = ["RefitDrill"]


class _Engine:
    def __init__(
        self,
        root: Path,
        name: str,
        weights: Path,
        token: str,
        delay: float,
        started: Callable[[int], object],
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self._started = started
        self._cmd = [sys.executable, str(REPO / "bench" / "cheap_engine.py"), "--port", str(self.port),
                     "--weights-dir", str(weights), "--load-delay-s", str(delay)]  # fmt: skip
        self._log = (root / f"{name}.log").open("ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        env = {**os.environ, envvars.ROLE_TOKEN: self.token}
        self.proc = subprocess.Popen(self._cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self._started(self.proc.pid)

    def control(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        r = jsonhttp.request("127.0.0.1", self.port, "POST" if body else "GET", "/control",
                             body, timeout=5, max_bytes=1 << 16, token=self.token)  # fmt: skip
        return dict(json.loads(r.body))

    def wait_control(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, "the stub engine exited"
            try:
                self.control()
                return
            except jsonhttp.TransportError:
                assert time.monotonic() < deadline, f"{self.url} did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen one ends too
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self._log.close()


class RefitDrill:
    """``engines`` stub engines and a client whose sync timeout is ``sync_timeout_s``."""

    def __init__(
        self,
        root: Path,
        *,
        engines: int = 3,
        load_delay_s: float = 0.4,
        sync_timeout_s: float = 3.0,
        started: Callable[[int], object] = lambda pid: None,
    ) -> None:
        """``started``: called with the PID of each engine process the drill starts (it ends
        them all in :meth:`close`)."""
        import torch

        self._torch = torch
        root.mkdir(parents=True, exist_ok=True)
        self.store = WeightStore(root / "weights")
        self.version = 0
        self.store.publish(0, {"w": torch.zeros(1)})
        token = secrets.token_hex(32)
        self.engines: list[_Engine] = []
        self.client: RolloutClient | None = None
        try:
            for i in range(engines):
                self.engines.append(
                    _Engine(root, f"e{i}", self.store.root, token, load_delay_s, started)
                )
            for e in self.engines:
                e.wait_control()
            cfg = RolloutConfig(sync_timeout_initial_s=sync_timeout_s,
                                sync_timeout_min_s=sync_timeout_s, sync_timeout_factor=1.0,
                                health_interval_s=0.2, health_timeout_s=1.0)  # fmt: skip
            self.client = RolloutClient([e.url for e in self.engines], config=cfg, token=token)
            self.client.wait_serving(engines, timeout=60)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for e in self.engines:
            e.close()

    def serving_at(self, url: str, version: int) -> bool:
        assert self.client is not None
        e = self.client.engines()[url]
        return bool(e["state"] == "serving" and e["version"] == version)

    def case(self, kind: str, fraction: float, victim: int = 0) -> dict[str, Any]:
        """Push the next version; ``kind`` (``kill`` or ``stop``) the engine ``victim`` once
        it has loaded ``fraction`` of it. The figures of the case."""
        assert kind in ("kill", "stop") and 0 < fraction < 1
        client = self.client
        assert client is not None
        self.version += 1
        v = self.version
        self.store.publish(v, {"w": self._torch.full((1,), float(v))})
        eng = self.engines[victim]
        eng.control({"hold_at": fraction})
        out: dict[str, Any] = {}

        def push() -> None:
            t0 = time.perf_counter()
            res: SyncResult = client.sync_weights(v)
            out["wait_s"] = time.perf_counter() - t0
            out["result"] = res

        pusher = threading.Thread(target=push, daemon=True)
        pusher.start()
        deadline = time.monotonic() + 60
        while True:  # the victim's own record of how much of version v it loaded
            c = eng.control()
            if c["held"] and c["loading"] == v:
                break
            assert time.monotonic() < deadline, f"the engine never reached {fraction}: {c}"
            time.sleep(0.01)
        at = c["progress"]
        assert eng.proc is not None
        t_fault = time.monotonic()
        os.kill(eng.proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        pusher.join(120)
        assert not pusher.is_alive(), "the trainer's sync call never returned"
        res = out["result"]
        if kind == "kill":  # its supervisor restarts it (here: this drill, on its port)
            eng.proc.wait()
            eng.start()
        else:
            os.kill(eng.proc.pid, signal.SIGCONT)
            eng.wait_control()
            eng.control({"hold_at": None})
        deadline = time.monotonic() + 60
        while not self.serving_at(eng.url, v):
            assert time.monotonic() < deadline, f"{eng.url} never served version {v} again"
            time.sleep(0.02)
        others = {e.url for e in self.engines if e is not eng}
        return {
            "kind": kind,
            "fraction": fraction,
            "loaded_at_fault": at,
            "version": v,
            "wait_s": out["wait_s"],
            "timeout_s": res.timeout_s,
            "others_confirmed": others <= set(res.confirmed),
            "victim_confirmed": eng.url in res.confirmed,
            "rejoin_s": time.monotonic() - t_fault,
            "all_at_version": all(self.serving_at(e.url, v) for e in self.engines),
        }
