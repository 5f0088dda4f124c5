"""Refits of a real vLLM engine under faults: ``python -m trainguard.rl.engines.vllm`` with two
warm standbys, ``--refits`` weight versions published and pushed while a client generates
without pause, faults injected during the refits in turn:

- ``kill``: kill -9 the adapter mid-refit (its vLLM dies with it); the standby is promoted on
  its port and a new standby started behind it;
- ``freeze``: SIGSTOP the adapter mid-refit for ``--freeze-s``, then SIGCONT;
- ``http_500``: vLLM fails the load half-way and answers HTTP 500 (``refit_500``: a tensor of
  a wrong shape past the adapter's check); its engine dies, the adapter answers with one line
  and exits, and the standby is promoted as after a kill;
- ``truncated``: the version's file is published truncated, then republished whole.

Figures: ``refit_s`` (median and p99 of the adapter's whole refit: pause, reload, version,
resume, one generation), ``stale_served`` (completions whose log-probs are not those of the
version they report, checked against the trainer's own model: must be 0), ``completions``
(checked), ``refit_faults`` (by kind), ``engine_ready_s`` (``cold``: start → serving;
``standby``: promotion → serving). Run on its own or from ``bench/rl_fleet.py --engine vllm``.

    TRAINGUARD_VLLM_PYTHON=.venv-vllm/bin/python python bench/vllm_refits.py --refits 20

``engines_lost``: engines that died of a fault they must survive (a truncated file, a freeze):
0 expected.
"""

from __future__ import annotations

import argparse
import json
import os
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

from bench._support import base_env  # noqa: E402
from trainguard.rl.engines.launch import (  # noqa: E402
    adapter_command,
    adapter_env,
    call,
    teacher_logprobs,
    tiny_model_dir,
)
from trainguard.rl.tiny import load_model  # noqa: E402
from trainguard.rl.weights import WeightStore  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402

CYCLE = ("none", "truncated", "freeze", "none")


def fault_of(v: int, refits: int) -> str:
    """The fault of refit ``v`` of ``refits``: an HTTP 500 mid-update at the middle one, a kill
    at the last, otherwise truncated files and freezes in turn (20 refits: 5 truncated, 4
    frozen, 1 HTTP 500, 1 kill; each kill and HTTP 500 ends the replica: a standby, started
    warm at the beginning, is promoted)."""
    if v == refits:
        return "kill"
    if v == refits // 2:
        return "http_500"
    return CYCLE[v % len(CYCLE)]


PROMPT = "please write 3 4 now"
TOL = 1e-3
VLLM_PYTHON = os.environ.get("TRAINGUARD_VLLM_PYTHON") or str(REPO / ".venv-vllm/bin/python")
TOKEN = secrets.token_hex(32)
"""The drill's ``rollout`` token: every request signed, every answer checked."""


def _http(
    port: int, method: str, path: str, body: Any = None, timeout: float = 60
) -> tuple[int, Any]:
    return call(port, method, path, body, token=TOKEN, timeout=timeout)


class Engine:
    """One adapter process: a replica on ``port``, or a role-style standby on a port of its
    own, promoted by its promotion file."""

    def __init__(self, root: Path, port: int, *, standby: bool) -> None:
        self.root, self.port = root, (free_port() if standby else port)
        self.promote = root / f"promote-{self.port}.json" if standby else None
        env = adapter_env(root, TOKEN, port=self.port, standby=self.promote, base=base_env(),
                          vllm_python=VLLM_PYTHON)  # fmt: skip
        self.log = (root / "engines.log").open("ab")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            adapter_command("--enable-fault-injection", "--poll-interval-s", "0.3"),
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def health(self) -> dict[str, Any] | None:
        try:
            code, h = _http(self.port, "GET", "/health", timeout=3)
        except OSError:
            return None
        return h if code == 200 else None

    def wait(self, status: str, version: int | None = None, timeout: float = 1800) -> float:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h and h["status"] == status and (version is None or h["weight_version"] == version):
                return time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited {self.proc.returncode}; see {self.root}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not {status} in {timeout} s: {h}")
            time.sleep(0.1)

    def kill(self) -> None:
        """kill -9 of the adapter's process group, as the role supervisor ends a replica (the
        adapter alone: vLLM's API server dies with it, its engine core would not)."""
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
        self.proc.wait()
        self.log.close()


class Client(threading.Thread):
    """Greedy completions without pause, each recorded with the version it reports."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.answers: list[tuple[int, list[int], list[float]]] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "logprobs": 0}
        while not self.stop.is_set():
            try:
                code, ans = _http(self.port, "POST", "/v1/completions", body, timeout=30)
            except OSError:
                code, ans = 0, None
            if code == 200 and isinstance(ans, dict):
                c = ans["choices"][0]
                self.answers.append(
                    (ans["weight_version"], c["token_ids"], c["logprobs"]["token_logprobs"])
                )
            else:
                self.errors += 1
                time.sleep(0.05)


def drill(root: Path, refits: int, freeze_s: float = 2.0) -> dict[str, Any]:
    import torch

    root.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model_dir(root)
    model, tok = load_model(str(model_dir))
    store = WeightStore(root / "rl" / "weights", keep=refits + 2)
    states = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    store.publish(0, states[0])
    port = free_port()
    primary = Engine(root, port, standby=False)
    spares = [Engine(root, port, standby=True) for _ in range(2)]
    ready: dict[str, list[float]] = {"cold": [], "standby": []}
    ready["cold"].append(primary.wait("serving", 0) - primary.t0)
    print(f"  vLLM engine serving after {ready['cold'][0]:.1f} s", flush=True)
    for sp in spares:
        sp.wait("standby")
    client = Client(port)
    client.start()
    refit_s: list[float] = []
    faults: dict[str, int] = {}
    answers: dict[str, list[int]] = {}  # the push's HTTP statuses by fault
    lost: dict[str, int] = {}
    g = torch.Generator().manual_seed(0)
    for v in range(1, refits + 1):
        fault = fault_of(v, refits)
        states[v] = {k: t + 0.2 * torch.randn(t.shape, generator=g) for k, t in states[0].items()}
        if fault == "http_500":
            _http(port, "POST", "/v1/faults", {"kind": "refit_500", "count": 1})
        store.publish(v, states[v])
        if fault == "truncated":  # the file torn after the pointer moved: refused, then fixed
            f = store.path_of(v)
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
        pushed: dict[str, Any] = {}

        def push(v: int = v, pushed: dict[str, Any] = pushed) -> None:
            try:
                pushed["answer"] = _http(port, "POST", "/v1/weights/update", {"version": v}, 120)
            except OSError as e:
                pushed["answer"] = (0, str(e))

        t = threading.Thread(target=push)
        t.start()
        if fault == "freeze":
            time.sleep(0.01)
            os.kill(primary.proc.pid, signal.SIGSTOP)
            time.sleep(freeze_s)
            os.kill(primary.proc.pid, signal.SIGCONT)
        elif fault == "kill":
            time.sleep(0.01)
            primary.kill()
        t.join()
        if fault == "http_500":  # the adapter answered 500 and exits: vLLM's engine died
            primary.proc.wait(120)
        gone = primary.proc.poll() is not None
        if gone and fault not in ("kill", "http_500"):
            lost[fault] = lost.get(fault, 0) + 1  # an engine lost to a fault it should survive
        if gone or fault == "kill":  # promote a standby onto the replica's port
            t0 = time.monotonic()
            primary.kill()
            if not spares:
                spares.append(Engine(root, port, standby=True))
                spares[0].wait("standby")
            spare = spares.pop(0)
            assert spare.promote is not None
            spare.promote.write_text(json.dumps({"replica": 0, "port": port}))
            primary = spare
            primary.port = port
            ready["standby"].append(primary.wait("serving", v) - t0)
        if fault == "truncated":
            store.publish(v, states[v])  # republished whole: the watcher loads it
        primary.wait("serving", v, timeout=600)
        code, ans = pushed["answer"]
        answers[fault] = sorted({*answers.get(fault, []), code})
        if fault == "none" and code == 200:
            refit_s.append(ans["load_s"])
        if fault != "none":
            faults[fault] = faults.get(fault, 0) + 1
        time.sleep(0.3)  # completions on this version
    client.stop.set()
    client.join(60)
    stale = 0
    for version, ids, lps in client.answers:
        model.load_state_dict(states[version])
        ref = teacher_logprobs(model, tok, PROMPT, ids)
        if max((abs(a - b) for a, b in zip(ref, lps, strict=True)), default=0.0) > TOL:
            stale += 1
    h = primary.health() or {}
    primary.kill()
    for sp in spares:
        sp.kill()
    # every clean refit is timed inside the adapter too; a p99 of a few values is their max
    q = sorted(refit_s)
    out = {
        "refits": refits,
        "refit_s": {
            "median": round(statistics.median(q), 4) if q else None,
            "p99": round(q[min(len(q) - 1, int(0.99 * len(q)))], 4) if q else None,
            "n": len(q),
        },
        "stale_served": stale,
        "completions": len(client.answers),
        "client_errors": client.errors,
        "refit_faults": faults,
        "refit_answers": answers,
        "engines_lost": lost,
        "requeued": h.get("requeued"),
        "engine_ready_s": {
            "cold": round(statistics.median(ready["cold"]), 2),
            "standby": round(statistics.median(ready["standby"]), 3) if ready["standby"] else None,
        },
    }
    print(f"  refit drill: {json.dumps(out)}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--refits", type=int, default=20)
    p.add_argument("--freeze-s", type=float, default=2.0)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vllm-refits-"))
    print(f"runs in {root}", flush=True)
    print(json.dumps(drill(root, a.refits, a.freeze_s)), flush=True)


if __name__ == "__main__":
    main()
