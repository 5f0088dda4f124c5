"""The vLLM engine adapter: vLLM's OpenAI server behind trainguard's engine contract.

    TRAINGUARD_VLLM_PYTHON=.venv-vllm/bin/python \\
        python -m trainguard.rl.engines.vllm [--port P] [--model tiny-llama|DIR] \\
            [--weights-dir D] [-- VLLM_ARG ...]

A role command (``--tg-role "rollout=2:python -m trainguard.rl.engines.vllm -- --enforce-eager"``):
it serves the contract of :mod:`trainguard.rl.engine` on ``$TRAINGUARD_AGENT_ROLE_PORT`` and starts
``python -m vllm.entrypoints.openai.api_server`` as a child on a private loopback port (the
arguments after ``--`` go to vLLM as they are). What it maps:

- ``GET /health``: ``starting`` while vLLM starts, ``loading`` while it loads the store's
  current version, ``serving`` only after a real generation on that version succeeded (vLLM's
  ``/health`` 200 is not readiness: an engine can answer it and die on its first request),
  ``standby`` for a role's warm standby; with ``weight_version``, ``inflight`` and the
  numbers of refits, failed refits and re-queued requests.
- ``POST /v1/completions``: forwarded to vLLM's ``/v1/completions`` with
  ``return_token_ids``; ``seed`` is passed through per request; the answer's choices carry
  ``token_ids`` and ``logprobs.token_logprobs``, and ``weight_version`` names the version that
  generated all of it. A request that was in flight during a refit (frozen by
  ``/pause?mode=keep``, resumed on the new weights) is generated again on the new version,
  never answered with tokens of two versions and never lost.
- ``POST /v1/weights/update`` and the store watcher: version ``v`` of the weight store
  (:mod:`trainguard.rl.weights`) is copied into a Hugging Face checkpoint directory and the copy
  checked whole, every tensor at the model's shape (anything else is refused before vLLM sees
  it), then loaded by vLLM's own APIs:
  ``/pause?mode=keep``, ``/collective_rpc`` ``reload_weights``, ``/update_weight_version``,
  ``/resume``, then one generation on ``v``. A failed load restores the previous version (the
  engine keeps serving it and says so); when that fails too the engine leaves routing
  (``loading``) and reloads the store's current version.

Every request, health included, is signed with the job's ``rollout`` token
(``$TRAINGUARD_AGENT_ROLE_TOKEN``, set by the role supervisor; :mod:`trainguard.core.fleetauth`) and
every answer signed back, as the embedded engine does; anything else is 401 with one line.

Every error is one line naming the replica, the version and the fix. vLLM runs with
``VLLM_SERVER_DEV_MODE=1`` (its pause, reload and version endpoints) and, unless it is set or
``--kv-cache-memory-bytes`` is given, ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache on CPU).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import HealthAnswer, ReplicaStatus, own_identity
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.fleetauth import Authenticator, replica_token
from trainguard.core.jsonhttp import JSONServer
from trainguard.rl.engines._vllm_complete import Completions
from trainguard.rl.engines._vllm_http import AdapterError, make_server
from trainguard.rl.engines._vllm_refit import RefitGate, VerifiedRefit
from trainguard.rl.engines._vllm_server import (
    VllmServer,
    WeightFileError,
    model_shapes,
    vllm_python,
)
from trainguard.rl.tiny import HF_CONFIG, TINY_LLAMA, save_tiny_llama
from trainguard.rl.weights import WeightStore, default_weight_dir

__all__ = ["AdapterConfig", "VllmAdapter", "main"]

logger = logging.getLogger(__name__)

FAULT_KINDS = ("http_500", "malformed", "hang", "refit_500")


@dataclass(kw_only=True, slots=True)
class AdapterConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = TINY_LLAMA
    """``tiny-llama`` (built into ``RUN_DIR/rl/models/``) or a local Hugging Face model dir."""
    seed: int = 0
    weights_dir: Path
    vllm_python: str
    vllm_args: tuple[str, ...] = ()
    replica: str = "0"
    poll_interval_s: float = 0.5
    start_timeout_s: float = 900.0
    """vLLM not answering ``/health`` in this time: the adapter exits with one line."""
    request_timeout_s: float = 120.0
    probe_prompt: str = "please write 1 2 now"
    fault_injection: bool = False
    standby: bool = False
    """``--standby``: start vLLM, then take the port once it is free (the replica died)."""
    token: str | None = field(default=None, repr=False)
    """The token every request must be signed with (the ``rollout`` role's,
    ``$TRAINGUARD_AGENT_ROLE_TOKEN``); every answer is signed back. None: no check (in-process use)."""


class VllmAdapter:
    """One replica: the vLLM child and its lifecycle (start, load, watch the store, health),
    with the weight versions in :class:`VerifiedRefit` and the completions in
    :class:`Completions`."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.auth = Authenticator("rollout", config.token) if config.token else None
        self.status = S.STARTING
        self.store = WeightStore(config.weights_dir)
        rl_dir = config.weights_dir.parent
        self.work = rl_dir / "engines" / f"vllm-{config.replica}-{os.getpid()}"
        self.model_dir = self._model_dir(rl_dir)
        try:
            shapes = model_shapes(Path(self.model_dir))
        except WeightFileError as e:
            raise AdapterError(400, f"vLLM replica {config.replica}: {e}") from None
        self.vocab_size = self._vocab_size()
        self.server: VllmServer | None = None
        self.gate = RefitGate()
        self.weights = VerifiedRefit(self, self.gate, self.store, self.work, shapes)
        self.completions = Completions(self, self.gate)
        self._faults: dict[str, int] = {}
        self._faults_lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def version(self) -> int | None:
        """The weight version vLLM holds (None while a refit replaces it)."""
        return self.gate.version

    def who(self, version: int | None = None) -> str:
        v = self.version if version is None else version
        held = f"weight version {v}" if v is not None else "no weight version loaded"
        return f"vLLM replica {self.config.replica} ({held})"

    def _model_dir(self, rl_dir: Path) -> str:
        m = self.config.model
        if m == TINY_LLAMA:
            dest = rl_dir / "models" / TINY_LLAMA
            try:
                return str(save_tiny_llama(dest, self.config.seed))
            except Exception as e:  # no torch/transformers here, a read-only run directory
                raise AdapterError(
                    400,
                    f"vLLM replica {self.config.replica}: cannot build {TINY_LLAMA} in {dest} "
                    f"({type(e).__name__}: {e}); run the adapter with the trainer's Python "
                    "(torch, transformers), or give --model a model directory",
                ) from None
        if not (Path(m) / HF_CONFIG).is_file():
            raise AdapterError(
                400,
                f"vLLM replica {self.config.replica}: {m!r} is not a Hugging Face model "
                "directory (no config.json); give a local model directory or tiny-llama",
            )
        return m

    def _vocab_size(self) -> int | None:
        try:
            v = json.loads((Path(self.model_dir) / HF_CONFIG).read_text()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            return None
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    # -- start-up ----------------------------------------------------------------------------
    def start_vllm(self) -> None:
        """Start vLLM and wait until it answers ``/health`` and generated once (the first
        generation compiles and warms up; a standby does it before it is promoted)."""
        c = self.config
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            vport = s.getsockname()[1]
        self.server = VllmServer(
            c.vllm_python, self.model_dir, vport, c.vllm_args, log=None, seed=c.seed
        )
        logger.info("vllm: starting %s", " ".join(self.server.command()))
        self.server.start()
        deadline = time.monotonic() + c.start_timeout_s
        while True:
            self.check_alive("while starting")
            try:
                code, _ = self.server.request("GET", "/health", timeout=5)
                if code == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AdapterError(
                    503,
                    f"vLLM replica {c.replica}: vLLM did not answer /health within "
                    f"{c.start_timeout_s:g} s (--start-timeout-s) on model {self.model_dir}; "
                    "see the log above, or allow it more time",
                )
            time.sleep(0.5)
        logger.info("vllm: vLLM answers /health on port %d (pid %s)", vport, self.server.pid)
        try:  # on the model directory's weights: warm, not yet serving
            self.generate_probe()
        except AdapterError as e:
            raise AdapterError(
                503,
                f"vLLM replica {c.replica}: vLLM started on model {self.model_dir} but its first "
                f"generation failed ({e.message}); check the model (vLLM's CPU attention needs "
                "a head size of 32, 64, 80, 96, 112, 128, ...) and vLLM's arguments",
            ) from None

    def check_alive(self, when: str) -> None:
        """AdapterError (503, one line) when vLLM has exited."""
        assert self.server is not None
        rc = self.server.exit_code()
        if rc is not None:
            fix = (
                "see its last lines above (a model vLLM cannot load, an unsupported head size "
                "or argument)"
                if self.status == S.STARTING
                else "see its last lines above; the replica is restarted"
            )
            raise AdapterError(
                503,
                f"{self.who()}: vLLM exited with code {rc} {when} (model {self.model_dir}); {fix}",
            )

    def generate_probe(self) -> None:
        """One real generation through vLLM (AdapterError when it fails)."""
        body = {"prompt": self.config.probe_prompt, "max_tokens": 2, "temperature": 0.0,
                "logprobs": 0}  # fmt: skip
        self.completions.forward(body)

    def boot(self) -> None:
        """Load the store's current version (waiting for the first publish), then serve."""
        self.status = S.LOADING
        while not self._stop.is_set():
            cur = self.store.current()
            if cur is not None:
                try:
                    self.refit(cur.version)
                    break
                except AdapterError as e:
                    if self.weights.fatal is not None:
                        raise
                    if e.code not in (404, 422):  # 404: pruned meanwhile; 422: logged once
                        logger.error("%s", e.message)
                    self.check_alive("while loading weights")
            self._stop.wait(self.config.poll_interval_s / 2)
        self.status = S.SERVING
        logger.info("vllm: %s serving", self.who())
        threading.Thread(target=self._watch, name="vllm-weights", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self.check_alive("while serving")
                if self.weights.fatal is not None:
                    raise AdapterError(503, self.weights.fatal)
            except AdapterError as e:
                logger.error("%s", e.message)
                with self.weights.idle():  # a refit that failed answers its request first
                    time.sleep(0.5)
                self.close()
                print(e.message, file=sys.stderr, flush=True)  # the log's last line
                os._exit(3)  # the role supervisor restarts (or replaces) the replica
            try:
                cur = self.store.current()
                if cur is not None and (
                    cur.version != self.version or self.status not in (S.SERVING, S.QUARANTINED)
                ):
                    self.refit(cur.version)
            except AdapterError as e:
                if e.code not in (404, 422):  # 422: logged once, by VerifiedRefit
                    logger.error("%s", e.message)
            except Exception:  # a torn pointer never stops serving the version we hold
                logger.exception("vllm: weight store check failed")

    # -- the contract's requests (the HTTP side, _vllm_http) ---------------------------------
    def refit(self, version: int) -> float:
        return self.weights.refit(version)

    def quarantine(self, version: int | None, reason: str) -> None:
        self.weights.quarantine(version, reason)

    def verified(self, version: int) -> bool:
        return self.weights.verified(version)

    def complete(self, body: object) -> dict[str, Any]:
        return self.completions.complete(body)

    # -- faults and health -------------------------------------------------------------------
    def arm_fault(self, kind: str, count: int) -> None:
        if kind not in FAULT_KINDS:
            raise AdapterError(400, f"fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
        with self._faults_lock:
            self._faults[kind] = count

    def take_fault(self, *kinds: str) -> str | None:
        """The first of ``kinds`` armed (one of its count used), None when none is."""
        if not self.config.fault_injection:
            return None
        with self._faults_lock:
            for kind in kinds:
                if self._faults.get(kind, 0) > 0:
                    self._faults[kind] -= 1
                    return kind
        return None

    def health(self) -> dict[str, Any]:
        me = own_identity()
        w = self.weights
        h = HealthAnswer(
            status=ReplicaStatus(self.status),
            weight_version=self.version,
            inflight=self.gate.inflight,
            pid=me.pid,
            incarnation=me.incarnation,
            model=self.config.model,
            vocab_size=self.vocab_size,
        )
        return {
            **h.to_json(),
            "engine": "vllm",
            "engine_pid": self.server.pid if self.server else None,
            "refits": w.refits,
            "refits_failed": w.refits_failed,
            "requeued": self.gate.requeued,
            "quarantines": w.quarantines,
            "last_error": w.last_error,
        }

    def close(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def _parse(argv: list[str] | None) -> AdapterConfig:
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, vllm_args = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(
        prog="python -m trainguard.rl.engines.vllm",
        description=__doc__.split("\n")[0],
        epilog="Arguments after -- go to vLLM's OpenAI server as they are.",
    )
    p.add_argument("--host", default=os.environ.get(envvars.ROLE_HOST) or "127.0.0.1")
    p.add_argument("--port", type=int, default=None, help=f"default: ${envvars.ROLE_PORT}")
    p.add_argument("--model", default=TINY_LLAMA, help="tiny-llama or a local model directory")
    p.add_argument("--seed", type=int, default=0, help="vLLM's --seed and tiny-llama's weights")
    p.add_argument("--weights-dir", default=None, help="default: $TRAINGUARD_RUN_DIR/rl/weights")
    p.add_argument("--vllm-python", default=None, help=f"default: ${envvars.VLLM_PYTHON}")
    p.add_argument("--poll-interval-s", type=float, default=0.5)
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--probe-prompt", default="please write 1 2 now")
    p.add_argument("--enable-fault-injection", action="store_true", help="tests only")
    p.add_argument(
        "--standby",
        action="store_true",
        help="a warm replacement: start vLLM, then wait until the port is free, take it, load "
        "the current weights and serve",
    )
    a = p.parse_args(argv)
    port = a.port
    if port is None:
        env = os.environ.get(envvars.ROLE_PORT)
        if env is None or not env.isdigit():
            p.error(f"no port: pass --port or run as a rollout role ({envvars.ROLE_PORT})")
        port = int(env)
    try:
        weights = Path(a.weights_dir) if a.weights_dir else default_weight_dir()
        cfg = AdapterConfig(
            host=a.host, port=port, model=a.model, seed=a.seed, weights_dir=weights,
            vllm_python=vllm_python(a.vllm_python), vllm_args=tuple(vllm_args),
            replica=os.environ.get(envvars.ROLE_REPLICA, "0"),
            poll_interval_s=a.poll_interval_s, start_timeout_s=a.start_timeout_s,
            request_timeout_s=a.request_timeout_s, probe_prompt=a.probe_prompt,
            fault_injection=a.enable_fault_injection, token=replica_token("the adapter"),
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    cfg.standby = a.standby
    return cfg


def _bind_when_free(adapter: VllmAdapter, port: int) -> JSONServer:
    while True:
        try:
            return make_server(adapter, adapter.config.host, port)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            time.sleep(0.05)


def _serve(server: JSONServer) -> None:
    threading.Thread(target=server.serve_forever, name="vllm-adapter-http", daemon=True).start()


def _await_promotion(adapter: VllmAdapter, own: JSONServer, promote: Path) -> None:
    """A role's standby: vLLM started and warm, health ``standby`` on its own port, until the
    promotion file names the port of the replica it replaces; then serve there."""
    adapter.status = S.STANDBY
    logger.info("vllm: standby ready; waiting for %s", promote)
    while True:
        try:
            order = json.loads(promote.read_text())
            port = int(order["port"])
            break
        except (OSError, ValueError, KeyError, TypeError):  # absent, or not yet whole
            time.sleep(0.05)
    adapter.config.replica = str(order.get("replica", adapter.config.replica))
    adapter.status = S.LOADING
    _serve(_bind_when_free(adapter, port))
    own.shutdown()
    own.server_close()
    logger.info("vllm: promoted to replica %s on port %d", adapter.config.replica, port)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s vllm-adapter[%(process)d] %(message)s"
    )
    cfg = _parse(argv)
    promote = os.environ.get(envvars.ROLE_STANDBY)
    standby = cfg.standby
    try:
        adapter = VllmAdapter(cfg)
    except AdapterError as e:
        print(e.message, file=sys.stderr)
        return 2

    def _terminate(signum: int, frame: object) -> None:  # SIGTERM: vLLM ends its engine core too
        adapter.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, _terminate)
    own: JSONServer | None = None
    try:
        if not standby:  # health (starting) at once; a --standby binds only when promoted
            own = make_server(adapter, cfg.host, cfg.port)
            _serve(own)
    except OSError as e:
        print(f"vLLM replica {cfg.replica}: cannot bind {cfg.host}:{cfg.port}: {e.strerror}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        adapter.start_vllm()
        if promote and own is not None:
            _await_promotion(adapter, own, Path(promote))
        elif standby:
            adapter.status = S.LOADING
            _serve(_bind_when_free(adapter, cfg.port))
        adapter.boot()
        threading.Event().wait()
    except AdapterError as e:
        adapter.close()  # vLLM's last words before our line
        print(e.message, file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        pass
    finally:
        adapter.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
