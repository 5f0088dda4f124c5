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
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import (
    HealthAnswer,
    MalformedAnswer,
    ReplicaStatus,
    own_identity,
    parse_completion,
)
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.fleetauth import Authenticator
from trainguard.core.jsonhttp import JSONServer
from trainguard.rl.engines._vllm_http import AdapterError, make_server
from trainguard.rl.engines._vllm_server import (
    MODEL_FILE,
    VllmServer,
    WeightFileError,
    bad_shape_dir,
    check_safetensors,
    compare_shapes,
    hf_version_dir,
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
    """The adapter's state: the vLLM child, the version it holds, the refit gate."""

    def __init__(self, config: AdapterConfig) -> None:
        self.config = config
        self.auth = Authenticator("rollout", config.token) if config.token else None
        self.status = S.STARTING
        self.version: int | None = None
        self.inflight = 0
        self.refits = 0
        self.refits_failed = 0
        self.requeued = 0
        self.quarantines = 0
        self.last_error: str | None = None
        self.store = WeightStore(config.weights_dir)
        rl_dir = config.weights_dir.parent
        self.work = rl_dir / "engines" / f"vllm-{config.replica}-{os.getpid()}"
        self.model_dir = self._model_dir(rl_dir)
        try:
            self._shapes = model_shapes(Path(self.model_dir))
        except WeightFileError as e:
            raise AdapterError(400, f"vLLM replica {config.replica}: {e}") from None
        self.vocab_size = self._vocab_size()
        self.fatal: str | None = None
        """Set when vLLM holds no whole version and cannot be given one: the adapter exits."""
        self.server: VllmServer | None = None
        self._cv = threading.Condition()
        self._refitting = False
        self._epoch = 0
        self._refit_lock = threading.Lock()
        self._refused: tuple[int, int, int] | None = None
        """(version, size, mtime) of the last file refused: not checked again until it changes."""
        self._dirs: dict[int, Path] = {}
        self._faults: dict[str, int] = {}
        self._stop = threading.Event()

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
            self._check_alive("while starting")
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

    def _check_alive(self, when: str) -> None:
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
        self._forward(body, checked=True)

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
                    if self.fatal is not None:
                        raise
                    if e.code not in (404, 422):  # 404: pruned meanwhile; 422: logged once
                        logger.error("%s", e.message)
                    self._check_alive("while loading weights")
            self._stop.wait(self.config.poll_interval_s / 2)
        self.status = S.SERVING
        logger.info("vllm: %s serving", self.who())
        threading.Thread(target=self._watch, name="vllm-weights", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                self._check_alive("while serving")
                if self.fatal is not None:
                    raise AdapterError(503, self.fatal)
            except AdapterError as e:
                logger.error("%s", e.message)
                with self._refit_lock:  # a refit that failed answers its request first
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
                if e.code not in (404, 422):  # 422: logged once, by _failed
                    logger.error("%s", e.message)
            except Exception:  # a torn pointer never stops serving the version we hold
                logger.exception("vllm: weight store check failed")

    # -- refit -------------------------------------------------------------------------------
    def refit(self, version: int) -> float:
        """Load ``version`` into vLLM; the seconds it took. AdapterError (404: not in the
        store; 422: not a whole file; 500: vLLM failed) with one line naming what to fix."""
        with self._refit_lock:
            t0 = time.perf_counter()
            if version == self.version and self.status == S.SERVING:
                return 0.0  # already loaded (the store watcher was first)
            if self.fatal is not None:
                raise AdapterError(503, self.fatal)
            src = self.store.path_of(version)
            if not src.is_file():
                raise AdapterError(
                    404,
                    f"{self.who()}: weight version {version} is not in {self.store.root} "
                    f"(the store keeps the newest {self.store.keep}); publish it, or refit to "
                    "a version the store holds",
                )
            st = src.stat()
            key = (version, st.st_size, st.st_mtime_ns)
            if key == self._refused and self.last_error is not None:
                raise AdapterError(422, self.last_error)  # the same file: refused once, no retry
            d = hf_version_dir(self.work, version, src)  # the copy checked is the copy loaded
            try:
                why = self._digest_differs(version, d / MODEL_FILE) or compare_shapes(
                    check_safetensors(d / MODEL_FILE), self._shapes
                )
            except WeightFileError as e:
                why = str(e).replace(str(d / MODEL_FILE), str(src))
            if why is not None:
                shutil.rmtree(d, ignore_errors=True)
                self._refused = key
                self._failed(
                    f"{self.who()}: weight version {version} refused: {why}; republish it whole"
                )
                raise AdapterError(422, str(self.last_error))
            if self._take_fault("refit_500"):
                d = bad_shape_dir(self.work, version, src)
            prev = self.version
            try:
                self._load(d, version)
                self.generate_probe()
            except AdapterError as e:
                msg = f"{self.who(version)}: vLLM could not load it ({e.message})"
                if not self._restore(prev):
                    self.status = S.LOADING
                    msg += "; it holds no whole version: the replica restarts"
                    self.fatal = msg
                else:
                    msg += f"; it serves version {prev} again: republish or refit again"
                self._failed(msg)
                raise AdapterError(500, msg) from None
            self._dirs[version] = d
            self._prune()
            self.refits += 1
            if self.status not in (S.STANDBY, S.QUARANTINED):  # quarantined: until verified
                self.status = S.SERVING
            return time.perf_counter() - t0

    def quarantine(self, version: int | None, reason: str) -> None:
        """A client found this engine's weights not to be ``version``: answer no completion
        but a refit check (503, health ``quarantined``) until a client verified a version."""
        if self.status in (S.SERVING, S.QUARANTINED):
            self.status = S.QUARANTINED
        self.quarantines += 1
        logger.warning("vllm: %s quarantined: %s", self.who(version), reason)

    def verified(self, version: int) -> bool:
        """A client verified ``version``: serve again (False: this engine holds another)."""
        if self.version != version:
            return False
        if self.status == S.QUARANTINED:
            self.status = S.SERVING
            logger.info("vllm: %s verified; serving again", self.who(version))
        return True

    def _digest_differs(self, version: int, copy: Path) -> str | None:
        """What is wrong when the copy vLLM would load is not the bytes the trainer wrote for
        ``version`` (the SHA-256 in the store's metadata); None when they are, or when the
        metadata has no digest."""
        try:
            want = self.store.meta(version).get("sha256")
        except (OSError, ValueError):
            return None
        if not isinstance(want, str):
            return None
        h = hashlib.sha256()
        with open(copy, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        got = h.hexdigest()
        if got == want:
            return None
        return (
            f"its SHA-256 is {got[:12]}…, not the {want[:12]}… the trainer wrote (truncated or "
            "changed after it was published)"
        )

    def _load(self, d: Path, version: int) -> None:
        """pause(keep) → reload_weights → update_weight_version → resume, the gate closed:
        new requests wait, the ones in flight are frozen by vLLM and generated again after."""
        with self._cv:
            self._refitting = True
        try:
            self._admin("POST", "/pause?mode=keep", None)
            try:
                with self._cv:
                    self._epoch += 1  # whatever was in flight is re-run on the new version
                self.version = None
                self._admin("POST", "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": str(d)}})  # fmt: skip
                self._admin("POST", "/update_weight_version", {"new_version": str(version)})
                self.version = version
            finally:
                self._admin("POST", "/resume", None)
        finally:
            with self._cv:
                self._refitting = False
                self._cv.notify_all()

    def _restore(self, prev: int | None) -> bool:
        d = self._dirs.get(prev) if prev is not None else None
        if d is None or prev is None:
            return False
        try:
            self._load(d, prev)
            self.generate_probe()
            return True
        except AdapterError as e:
            logger.error("%s: restoring version %s failed: %s", self.who(), prev, e.message)
            return False

    def _admin(self, method: str, path: str, body: object) -> Any:
        assert self.server is not None
        try:
            code, ans = self.server.request(method, path, body, timeout=120)
        except OSError as e:
            raise AdapterError(503, f"{method} {path}: no answer from vLLM ({e})") from None
        if code != 200:
            raise AdapterError(502, f"{method} {path}: vLLM answered {code}: {str(ans)[:200]}")
        return ans

    def _failed(self, msg: str) -> None:
        self.refits_failed += 1
        self.last_error = msg
        logger.error("%s", msg)

    def _prune(self) -> None:
        keep = {self.version}
        for v in [v for v in self._dirs if v not in keep]:
            shutil.rmtree(self._dirs.pop(v), ignore_errors=True)

    # -- generation --------------------------------------------------------------------------
    def complete(self, body: object) -> dict[str, Any]:
        """The contract's completion answer for ``body`` (AdapterError otherwise)."""
        if not isinstance(body, dict):
            raise AdapterError(400, "the request body must be a JSON object")
        if body.get("stream"):
            raise AdapterError(400, "'stream' is not supported by this engine; leave it out")
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts:
            raise AdapterError(400, "'prompt' must be a string or a non-empty list of strings")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p.strip():
                raise AdapterError(400, f"prompt {i} must be a non-empty string, got {p!r:.80}")
        check = body.get("refit_check") is True  # a client's refit check: answered quarantined
        if self.status != S.SERVING and not (check and self.status == S.QUARANTINED):
            raise AdapterError(503, f"engine is {self.status}, not serving")
        fault = self._take_fault("http_500", "malformed", "hang")
        if fault == "http_500":
            raise AdapterError(500, "injected fault: internal error")
        if fault == "hang":
            threading.Event().wait()
        for _ in range(8):
            with self._cv:
                while self._refitting:
                    self._cv.wait()
                epoch, version = self._epoch, self.version
                self.inflight += 1
            try:
                ans = self._forward(body, checked=True)
            finally:
                with self._cv:
                    self.inflight -= 1
            with self._cv:
                if epoch == self._epoch and version is not None:
                    ans["weight_version"] = version
                    if fault == "malformed":
                        ans["truncate"] = True
                    return ans
                self.requeued += 1  # a refit ran under it: generate it again on the new one
        raise AdapterError(503, f"{self.who()}: refits kept interrupting the request; retry")

    def _forward(self, body: dict[str, Any], *, checked: bool) -> dict[str, Any]:
        assert self.server is not None
        req = {k: v for k, v in body.items() if k not in ("model", "refit_check")}
        req["model"] = self.model_dir
        req["return_token_ids"] = True
        prompts = req.get("prompt")
        n_prompts = len(prompts) if isinstance(prompts, list) else 1
        seeds = req.get("seed")
        if not isinstance(seeds, list):
            return self._convert(self._complete_once(req), n_prompts, body)
        # one seed per prompt (the contract): vLLM takes one seed a request, so each prompt is
        # a request of its own, sent together (vLLM batches them); choices in prompt order
        plist = prompts if isinstance(prompts, list) else [prompts]
        if len(seeds) != len(plist) or not all(type(x) is int and x >= 0 for x in seeds):
            raise AdapterError(400, "'seed' as a list must hold one integer >= 0 per prompt")
        n = req.get("n", 1) if isinstance(req.get("n"), int) else 1
        with ThreadPoolExecutor(max_workers=min(len(plist), 16)) as pool:
            parts = list(pool.map(
                lambda ps: self._complete_once({**req, "prompt": ps[0], "seed": ps[1]}),
                zip(plist, seeds, strict=True),
            ))  # fmt: skip
        choices: list[object] = []
        for k, part in enumerate(parts):
            got = part.get("choices") if isinstance(part, dict) else None
            if not isinstance(got, list) or len(got) != n:
                return self._convert(part, 1, body)  # names what is wrong with it
            for j, c in enumerate(got):
                if isinstance(c, dict):
                    c["index"] = k * n + j
                choices.append(c)
        first = parts[0] if isinstance(parts[0], dict) else {}
        return self._convert({**first, "choices": choices}, n_prompts, body)

    def _complete_once(self, req: dict[str, object]) -> object:
        """One ``/v1/completions`` request to vLLM: its answer, or AdapterError (4xx: vLLM's
        own message; 502/503 naming the replica)."""
        assert self.server is not None
        try:
            code, ans = self.server.request(
                "POST", "/v1/completions", req, timeout=self.config.request_timeout_s
            )
        except OSError as e:
            self._check_alive("during a generation")
            raise AdapterError(503, f"{self.who()}: no answer from vLLM ({e})") from None
        if 400 <= code < 500:
            err = ans.get("error", ans) if isinstance(ans, dict) else ans
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise AdapterError(code, str(msg)[:500])
        if code != 200:
            raise AdapterError(502, f"{self.who()}: vLLM answered HTTP {code}: {str(ans)[:200]}")
        return ans

    def _convert(self, ans: Any, n_prompts: int, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's answer in the contract's shape, checked; AdapterError(502) naming what is
        wrong with it (a malformed answer is never passed on)."""
        bad = f"{self.who()}: a malformed answer from vLLM"
        n = body.get("n", 1) if isinstance(body.get("n"), int) else 1
        choices = ans.get("choices") if isinstance(ans, dict) else None
        if not isinstance(choices, list) or len(choices) != n_prompts * n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise AdapterError(502, f"{bad}: {got} choices for {n_prompts * n}; check vLLM's log")
        out = []
        for c in choices:
            if not isinstance(c, dict):
                raise AdapterError(502, f"{bad}: a choice that is not an object")
            lp = c.get("logprobs")
            logprobs = None
            if isinstance(lp, dict):
                logprobs = {"tokens": lp.get("tokens"), "token_logprobs": lp.get("token_logprobs")}
            elif body.get("logprobs") is not None:
                raise AdapterError(502, f"{bad}: log-probs asked for and missing")
            if not c.get("token_ids"):
                raise AdapterError(502, f"{bad}: a choice without token ids (return_token_ids)")
            choice = {"index": c.get("index"), "text": c.get("text"),
                      "token_ids": c.get("token_ids"), "finish_reason": c.get("finish_reason"),
                      "logprobs": logprobs}  # fmt: skip
            if body.get("prompt_logprobs") is not None:  # {token id: {"logprob": x}} per token
                if not isinstance(c.get("prompt_logprobs"), list):
                    raise AdapterError(502, f"{bad}: prompt log-probs asked for and missing")
                choice["prompt_logprobs"] = c["prompt_logprobs"]
                choice["prompt_token_ids"] = c.get("prompt_token_ids")
            out.append(choice)
        answer = {"id": ans.get("id"), "object": "text_completion", "created": ans.get("created"),
                  "model": self.config.model, "choices": out, "usage": ans.get("usage"),
                  "weight_version": 0, "incarnation": own_identity().incarnation}  # fmt: skip
        try:  # the contract's own parser: what the trainer's client will accept
            parse_completion(answer, expected=n_prompts * n, vocab_size=self.vocab_size)
        except MalformedAnswer as e:
            raise AdapterError(502, f"{bad}: {e}; check vLLM's log") from None
        return answer

    # -- faults and health -------------------------------------------------------------------
    def arm_fault(self, kind: str, count: int) -> None:
        if kind not in FAULT_KINDS:
            raise AdapterError(400, f"fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
        with self._cv:
            self._faults[kind] = count

    def _take_fault(self, *kinds: str) -> str | None:
        if not self.config.fault_injection:
            return None
        with self._cv:
            for kind in kinds:
                if self._faults.get(kind, 0) > 0:
                    self._faults[kind] -= 1
                    return kind
        return None

    def health(self) -> dict[str, Any]:
        me = own_identity()
        h = HealthAnswer(
            status=ReplicaStatus(self.status),
            weight_version=self.version,
            inflight=self.inflight,
            pid=me.pid,
            incarnation=me.incarnation,
            model=self.config.model,
            vocab_size=self.vocab_size,
        )
        return {
            **h.to_json(),
            "engine": "vllm",
            "engine_pid": self.server.pid if self.server else None,
            "refits": self.refits,
            "refits_failed": self.refits_failed,
            "requeued": self.requeued,
            "quarantines": self.quarantines,
            "last_error": self.last_error,
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
            fault_injection=a.enable_fault_injection, token=_token(p),
        )  # fmt: skip
    except ValueError as e:
        p.error(str(e))
    cfg.standby = a.standby
    return cfg


def _token(p: argparse.ArgumentParser) -> str:
    token = os.environ.get(envvars.ROLE_TOKEN, "").strip()
    if len(token) < 16:
        p.error(
            f"no job token: {envvars.ROLE_TOKEN} is unset or too short; run the adapter as a "
            "role of `trainguard run`, or set it to the token its clients send (docs/security.md)"
        )
    return token


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
