"""The embedded rollout engine: a generation server for a Hugging Face causal LM.

    python -m trainguard.rl.engine [--port P] [--model tiny-gpt2|DIR] [--weights-dir D]

It runs on CPU (or one GPU) with ``transformers``' ``generate``; requests arriving together
are generated as one batch. Under ``trainguard run`` it runs as a ``rollout`` role replica:
it binds ``$TRAINGUARD_ROLE_HOST:$TRAINGUARD_ROLE_PORT`` (``127.0.0.1`` beside the trainer, the
node's address on nodes of its own) and reads the weights the trainer publishes in
``$TRAINGUARD_RUN_DIR/rl/weights`` (:mod:`trainguard.rl.weights`).

The engine contract
-------------------
What the launcher and :class:`trainguard.rl.RolloutClient` expect of any engine (this one, or
an adapter in front of vLLM or SGLang); the statuses, endpoints, answer schemas and parsers are
:mod:`trainguard.core.engine_contract`, the HTTP server :mod:`trainguard.core.jsonhttp`:

``GET /health``
    200 ``{"status": "starting"|"loading"|"serving"|"standby", "weight_version": int|null,
    "model": str, "inflight": int, "pid": int, "incarnation": str|null, "vocab_size": int}``.
    ``starting``: the process is up, the model is being built; ``loading``: waiting for /
    loading the trainer's current weight version; ``serving``: it holds a published version
    and generates; ``standby``: a role's warm standby, built, not routed to. An engine reports
    ``serving`` only after it loaded the version the weight store's pointer names
    (refit-gated (re)join). ``incarnation``: the nonce the supervisor gave this process
    (``$TRAINGUARD_ROLE_INCARNATION``).
``POST /v1/completions``
    OpenAI-compatible: ``prompt`` (a string or a list of strings), ``max_tokens``,
    ``temperature``, ``top_p``, ``n``, ``seed``, ``logprobs`` (``stream`` is refused). The
    answer holds ``choices`` (``index`` = prompt index × n + j, ``text``, ``finish_reason``,
    and the extensions ``token_ids``, with the EOS token when it stopped there, and, with
    ``logprobs``, ``logprobs.token_logprobs``, one per token id) and
    ``weight_version``, the version of the weights that generated every choice (a weight
    update waits for the batch in progress). 503 while not serving; 4xx with
    ``{"error": {"message": ...}}`` for bad input.
``GET /v1/weights``
    ``{"version": v}``.
``POST /v1/weights/update``
    ``{"version": v}`` (optionally ``"path"``: a safetensors file; default: version ``v`` of
    the weight store) → loads it and confirms ``{"version": v, "load_s": ...}``. Any version
    is accepted, older ones too: a trainer that resumed from a checkpoint refits the fleet
    to its own version. Independently of updates, the engine polls the store's pointer and
    refits itself when the pointer names another version (an engine that missed an update,
    or restarted, catches up without the trainer).

vLLM and SGLang fit this contract through an adapter process that forwards
``/v1/completions`` and maps health and weight updates onto their own APIs (vLLM's
weight-transfer endpoints ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``; SGLang's ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/update_weights_from_distributed``): docs/rl.md says what
each needs. trainguard ships no such adapter yet: they need a GPU to be tested.

A warm replacement (``--standby``): a second process per replica imports everything and
builds the model while the replica serves, binds the port the moment it is free (the replica
died or was killed), then loads the current version and serves: a rejoin without the start-up.

A role's warm standby (``standby = N`` of the ``rollout`` role; ``$TRAINGUARD_ROLE_STANDBY``
names its promotion file): the engine serves ``/health`` on its own port
(``$TRAINGUARD_ROLE_PORT``, never routed to) with status ``standby`` once the model is built;
when the supervisor writes the promotion file (``{"replica": i, "port": p}``) it binds port
``p`` (free once the dead replica is gone), closes its own, loads the current weight version
(``loading``) and serves: the replica's rejoin without the start-up.

Fault injection (tests and benchmarks only, ``--enable-fault-injection``): ``POST /v1/faults``
``{"kind": "http_500"|"malformed"|"hang", "count": n}`` makes the next ``n`` completion
requests answer HTTP 500, a truncated JSON body, or nothing at all (``n`` = 0 disarms).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core import envvars
from trainguard.core.engine_contract import (
    COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    WEIGHT_UPDATE_PATH,
    WEIGHTS_PATH,
    HealthAnswer,
    own_identity,
)
from trainguard.core.engine_contract import ReplicaStatus as S
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer
from trainguard.rl.tiny import TINY_MODEL, load_model
from trainguard.rl.weights import WeightStore, default_weight_dir

__all__ = ["Engine", "EngineConfig", "main"]

logger = logging.getLogger(__name__)

PORT_ENV = envvars.ROLE_PORT
ROLE_STANDBY_ENV = envvars.ROLE_STANDBY
FAULT_KINDS = ("http_500", "malformed", "hang")


class BadRequest(ValueError):
    """A request the engine refuses with HTTP 400 (the message says what to fix)."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = TINY_MODEL
    """``tiny-gpt2`` (built in) or a local Hugging Face model directory."""
    seed: int = 0
    weights_dir: Path | None = None
    """The weight store; None: ``$TRAINGUARD_RUN_DIR/rl/weights``."""
    batch_window_s: float = 0.01
    """How long the batcher waits for more requests after the first one of a batch."""
    max_batch_prompts: int = 256
    max_tokens_limit: int = 256
    max_n: int = 64
    poll_interval_s: float = 0.5
    """How often the engine checks the weight store's pointer for another version."""
    fault_injection: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port}: give a TCP port 0..65535")
        if self.batch_window_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("batch window must be >= 0 and the poll interval > 0")


@dataclass(slots=True)
class _Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    logprobs: int | None

    def key(self) -> tuple[Any, ...]:
        return (self.max_tokens, self.temperature, self.top_p, self.seed)


@dataclass(slots=True)
class _Job:
    prompts: list[str]
    sampling: _Sampling
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: str | None = None


def _int_field(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> Any:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _float_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be a number in {lo}..{hi}, got {v!r}")
    return float(v)


class Engine:
    """Model, batcher and weight watcher of one engine process (the HTTP layer is
    :class:`_Handler`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.status = S.STARTING
        self.version: int | None = None
        self.inflight = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self.store = WeightStore(config.weights_dir or default_weight_dir())
        self._model_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._faults: dict[str, int] = {}
        self._stop = threading.Event()
        self.num_generated = 0

    # -- startup and weights -----------------------------------------------------------------
    def build(self) -> None:
        """Import the model's libraries and build it (status ``starting``)."""
        import torch

        torch.set_grad_enabled(False)
        self.model, self.tokenizer = load_model(self.config.model, self.config.seed)
        self.model.eval()

    def boot(self) -> None:
        """Build the model (unless :meth:`build` ran), wait for and load the current published
        version, then serve."""
        if self.model is None:
            self.build()
        self.status = S.LOADING
        logger.info("engine: model built; waiting for a published weight version")
        while not self._stop.is_set():
            cur = self.store.current()
            if cur is not None and self._load_published(cur.version):
                break
            self._stop.wait(self.config.poll_interval_s / 2)
        threading.Thread(target=self._batcher, name="engine-batcher", daemon=True).start()
        threading.Thread(target=self._watch, name="engine-weights", daemon=True).start()
        self.status = S.SERVING
        logger.info("engine: serving weight version %s", self.version)

    def _load_published(self, version: int) -> bool:
        try:
            self.load_weights(version)
            return True
        except FileNotFoundError:  # pruned or not yet renamed: the pointer moved on
            return False

    def load_weights(self, version: int, path: str | None = None) -> float:
        """Load ``version`` (from ``path`` or the store); the seconds it took."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        file = path or str(self.store.path_of(version))
        tensors = load_file(file)
        with self._model_lock:
            missing, unexpected = self.model.load_state_dict(tensors, strict=False)
            if unexpected:
                raise ValueError(f"{file}: tensors this model does not have: {unexpected[:5]}")
            self.version = version
        return time.perf_counter() - t0

    def _watch(self) -> None:
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                cur = self.store.current()
                if cur is not None and cur.version != self.version:
                    if self._load_published(cur.version):
                        logger.info("engine: refit to weight version %d", cur.version)
            except Exception:  # a torn or bad store never stops serving the version we hold
                logger.exception("engine: weight store check failed")

    # -- generation --------------------------------------------------------------------------
    def parse(self, body: Any) -> tuple[list[str], _Sampling]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("'stream' is not supported by this engine; leave it out")
        prompt = body.get("prompt")
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest("'prompt' must be a string or a non-empty list of strings")
        for i, p in enumerate(prompts):
            if not isinstance(p, str) or not p.strip():
                raise BadRequest(f"prompt {i} must be a non-empty string, got {p!r}")
        c = self.config
        s = _Sampling(
            max_tokens=_int_field(body, "max_tokens", 16, 1, c.max_tokens_limit),
            temperature=_float_field(body, "temperature", 1.0, 0.0, 10.0),
            top_p=_float_field(body, "top_p", 1.0, 1e-6, 1.0),
            n=_int_field(body, "n", 1, 1, c.max_n),
            seed=_int_field(body, "seed", None, 0, 2**63 - 1),
            logprobs=_int_field(body, "logprobs", None, 0, 5),
        )
        if len(prompts) * s.n > c.max_batch_prompts:
            raise BadRequest(
                f"{len(prompts)} prompts x n={s.n} exceeds this engine's "
                f"{c.max_batch_prompts} sequences per request; split the request"
            )
        mc = self.model.config
        limit = getattr(mc, "n_positions", None) or getattr(mc, "max_position_embeddings", None)
        limit = limit if isinstance(limit, int) else 1 << 30
        for i, p in enumerate(prompts):
            n_tok = len(self.tokenizer(p)["input_ids"])
            if n_tok == 0:
                raise BadRequest(f"prompt {i} is empty after tokenization")
            if n_tok + s.max_tokens > limit:
                raise BadRequest(
                    f"prompt {i} has {n_tok} tokens; with max_tokens={s.max_tokens} it exceeds "
                    f"the model's {limit} positions"
                )
        return prompts, s

    def submit(self, prompts: list[str], sampling: _Sampling) -> _Job:
        job = _Job(prompts, sampling)
        self._jobs.put(job)
        return job

    def _batcher(self) -> None:
        while not self._stop.is_set():
            first = self._jobs.get()
            batch = [first]
            size = len(first.prompts) * first.sampling.n
            deadline = time.monotonic() + self.config.batch_window_s
            while size < self.config.max_batch_prompts:
                left = deadline - time.monotonic()
                try:
                    job = self._jobs.get(timeout=left) if left > 0 else self._jobs.get_nowait()
                except queue.Empty:
                    break
                batch.append(job)
                size += len(job.prompts) * job.sampling.n
            groups: dict[tuple[Any, ...], list[_Job]] = {}
            for job in batch:
                groups.setdefault(job.sampling.key(), []).append(job)
            for jobs in groups.values():
                try:
                    self._generate(jobs)
                except Exception as e:  # one bad batch fails its requests, not the engine
                    logger.exception("engine: generation failed")
                    for job in jobs:
                        job.error = f"generation failed: {e}"
                        job.done.set()

    def _generate(self, jobs: list[_Job]) -> None:
        import torch

        s = jobs[0].sampling
        texts = [p for job in jobs for p in job.prompts for _ in range(job.sampling.n)]
        tok = self.tokenizer
        enc = tok(texts, return_tensors="pt", padding=True)
        kwargs: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
            "return_dict_in_generate": True,
            "output_scores": True,
        }
        if s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False)
        with self._model_lock:
            version = self.version
            if s.seed is not None:
                torch.manual_seed(s.seed)
            out = self.model.generate(**enc, **kwargs)
            scores = self.model.compute_transition_scores(
                out.sequences, out.scores, normalize_logits=True
            )
        new = out.sequences[:, enc["input_ids"].shape[1] :]
        rows = []
        for i in range(new.shape[0]):
            ids = new[i].tolist()
            lps = scores[i].tolist()
            finish, end = "length", len(ids)
            if tok.eos_token_id in ids:  # kept in token_ids (as vLLM does), not in the text
                end = ids.index(tok.eos_token_id)
                ids, lps, finish = ids[: end + 1], lps[: end + 1], "stop"
            text = tok.decode(ids[:end], skip_special_tokens=True)
            rows.append((text, ids, lps, finish))
        self.num_generated += len(rows)
        at = 0
        for job in jobs:
            choices = []
            for idx in range(len(job.prompts) * job.sampling.n):
                text, ids, lps, finish = rows[at + idx]
                choice: dict[str, Any] = {
                    "index": idx,
                    "text": text,
                    "token_ids": ids,
                    "finish_reason": finish,
                    "logprobs": None,
                }
                if job.sampling.logprobs is not None:
                    choice["logprobs"] = {
                        "tokens": [tok.convert_ids_to_tokens(t) for t in ids],
                        "token_logprobs": lps,
                    }
                choices.append(choice)
            at += len(choices)
            n_prompt = int(enc["attention_mask"].sum().item()) // max(1, len(texts))
            job.result = {
                "id": f"cmpl-{os.getpid()}-{id(job):x}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.config.model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": n_prompt * len(choices),
                    "completion_tokens": sum(len(c["token_ids"]) for c in choices),
                },
                "weight_version": version,
                "incarnation": own_identity().incarnation,
            }
            job.done.set()

    # -- faults ------------------------------------------------------------------------------
    def arm_fault(self, kind: str, count: int) -> None:
        if kind not in FAULT_KINDS:
            raise BadRequest(f"fault kind {kind!r}: one of {', '.join(FAULT_KINDS)}")
        with self._count_lock:
            self._faults[kind] = count

    def take_fault(self) -> str | None:
        with self._count_lock:
            for kind, left in self._faults.items():
                if left > 0:
                    self._faults[kind] = left - 1
                    return kind
        return None

    def health(self) -> HealthAnswer:
        me = own_identity()
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return HealthAnswer(
            status=self.status,
            weight_version=self.version,
            inflight=self.inflight,
            pid=me.pid,
            incarnation=me.incarnation,
            model=self.config.model,
            vocab_size=vocab if isinstance(vocab, int) else None,
        )


class _Handler(JSONHandler):
    """The engine's HTTP routes (the contract's endpoints) on the shared JSON server."""

    server_version = "trainguard-engine"
    max_body_bytes = 8 << 20
    engine: Engine  # set on the subclass made by serve()
    get_routes = {
        HEALTH_PATH: "_health",
        WEIGHTS_PATH: "_weights",
        MODELS_PATH: "_models",
    }
    post_routes = {
        COMPLETIONS_PATH: "_completions",
        WEIGHT_UPDATE_PATH: "_update",
        "/v1/faults": "_faults",
    }

    def _health(self) -> None:
        self.send_json(200, self.engine.health().to_json())

    def _weights(self) -> None:
        self.send_json(200, {"version": self.engine.version})

    def _models(self) -> None:
        model = self.engine.config.model
        self.send_json(200, {"object": "list", "data": [{"id": model, "object": "model"}]})

    def _faults(self) -> None:
        if not self.engine.config.fault_injection:
            raise HTTPError(404, f"no such endpoint: POST {self.path}")
        body = self.read_object()
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise HTTPError(400, "'count' must be an integer >= 0")
        try:
            self.engine.arm_fault(str(body.get("kind")), count)
        except BadRequest as err:
            raise HTTPError(400, str(err)) from None
        self.send_json(200, {"armed": body.get("kind")})

    def _completions(self) -> None:
        e = self.engine
        body = self.read_json()
        if e.status is not S.SERVING:
            raise HTTPError(503, f"engine is {e.status}, not serving yet")
        try:
            prompts, sampling = e.parse(body)
        except BadRequest as err:
            raise HTTPError(400, str(err)) from None
        fault = e.take_fault() if e.config.fault_injection else None
        if fault == "http_500":
            raise HTTPError(500, "injected fault: internal error")
        if fault == "hang":
            threading.Event().wait()  # never answers; the client's timeout must act
        with e._count_lock:
            e.inflight += 1
        try:
            job = e.submit(prompts, sampling)
            job.done.wait()
        finally:
            with e._count_lock:
                e.inflight -= 1
        if job.error is not None:
            raise HTTPError(500, job.error)
        if fault == "malformed":
            data = json.dumps(job.result).encode()
            self.send_json(200, None, raw=data[: len(data) // 2])
        else:
            self.send_json(200, job.result)

    def _update(self) -> None:
        e = self.engine
        body = self.read_object()
        try:
            version = _int_field(body, "version", None, 0, 2**63 - 1)
        except BadRequest as err:
            raise HTTPError(400, str(err)) from None
        if version is None:
            raise HTTPError(400, "'version' (the weight version to load) is required")
        path = body.get("path")
        if path is not None and not isinstance(path, str):
            raise HTTPError(400, "'path' must be a string (a safetensors file)")
        if e.status in (S.STARTING, S.STANDBY):
            raise HTTPError(503, f"engine is {e.status}; it loads the current version itself")
        try:
            load_s = e.load_weights(version, path)
        except FileNotFoundError:
            raise HTTPError(404, f"weight version {version} is not in {e.store.root}") from None
        except Exception as err:
            raise HTTPError(500, f"could not load weight version {version}: {err}") from None
        self.send_json(200, {"version": version, "load_s": round(load_s, 6)})


def serve(engine: Engine) -> JSONServer:
    handler = type("Handler", (_Handler,), {"engine": engine})
    return JSONServer((engine.config.host, engine.config.port), handler)


def _parse(argv: list[str] | None) -> tuple[EngineConfig, bool]:
    p = argparse.ArgumentParser(
        prog="python -m trainguard.rl.engine", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--host",
        default=os.environ.get(envvars.ROLE_HOST) or "127.0.0.1",
        help=f"default: ${envvars.ROLE_HOST}, else 127.0.0.1",
    )
    p.add_argument("--port", type=int, default=None, help=f"default: ${PORT_ENV}")
    p.add_argument("--model", default=TINY_MODEL, help="tiny-gpt2 or a local model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights-dir", default=None, help="default: $TRAINGUARD_RUN_DIR/rl/weights")
    p.add_argument("--batch-window-ms", type=float, default=10.0)
    p.add_argument("--poll-interval-s", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--enable-fault-injection", action="store_true", help="tests only")
    p.add_argument(
        "--standby",
        action="store_true",
        help="a warm replacement: import and build the model, then wait until the port is free "
        "(the replica on it died), take it, load the current weights and serve",
    )
    a = p.parse_args(argv)
    port = a.port
    if port is None:
        env = os.environ.get(PORT_ENV)
        if env is None:
            p.error(f"no port: pass --port or run as a rollout role ({PORT_ENV} is unset)")
        try:
            port = int(env)
        except ValueError:
            p.error(f"{PORT_ENV}={env!r} is not a port number")
    try:
        weights = Path(a.weights_dir) if a.weights_dir else default_weight_dir()
        cfg = EngineConfig(
            host=a.host,
            port=port,
            model=a.model,
            seed=a.seed,
            weights_dir=weights,
            batch_window_s=a.batch_window_ms / 1000,
            poll_interval_s=a.poll_interval_s,
            fault_injection=a.enable_fault_injection,
        )
    except ValueError as e:
        p.error(str(e))
    import torch

    torch.set_num_threads(max(1, a.threads))
    return cfg, a.standby


def _bind_when_free(engine: Engine) -> JSONServer:
    """A standby's bind: retried while the replica it replaces still holds the port."""
    while True:
        try:
            return serve(engine)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            time.sleep(0.05)


def _await_promotion(engine: Engine, promote: Path) -> JSONServer:
    """A role's standby: serve health on its own port (``standby`` once built) until the
    promotion file names the port of the replica it replaces; returns the server on that port."""
    own = serve(engine)
    threading.Thread(target=own.serve_forever, name="engine-standby", daemon=True).start()
    logger.info("engine: standby, health on port %d", own.server_address[1])
    engine.build()
    engine.status = S.STANDBY
    logger.info("engine: standby ready; waiting for %s", promote)
    while True:
        try:
            order = json.loads(promote.read_text())
            port = int(order["port"])
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        except (OSError, ValueError, KeyError, TypeError):  # written atomically: not yet whole
            time.sleep(0.05)
            continue
        break
    engine.config.port = port
    engine.status = S.STARTING  # until the current weights are loaded (boot: loading)
    server = _bind_when_free(engine)
    own.shutdown()
    own.server_close()
    logger.info("engine: promoted to replica %s on port %d", order.get("replica"), port)
    return server


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(message)s")
    cfg, standby = _parse(argv)
    engine = Engine(cfg)
    promote = os.environ.get(ROLE_STANDBY_ENV)
    try:
        if promote:
            server = _await_promotion(engine, Path(promote))
        elif standby:  # warm: imports and model first, then take the port once it is free
            engine.build()
            logger.info("engine: standby for port %d", cfg.port)
            server = _bind_when_free(engine)
        else:
            server = serve(engine)
    except OSError as e:
        print(f"engine: cannot bind {cfg.host}:{cfg.port}: {e.strerror}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"engine: cannot load model {cfg.model!r}: {e}", file=sys.stderr)
        return 2
    threading.Thread(target=server.serve_forever, name="engine-http", daemon=True).start()
    logger.info("engine: listening on http://%s:%d", cfg.host, server.server_address[1])
    try:
        engine.boot()
    except Exception as e:
        print(f"engine: cannot load model {cfg.model!r}: {e}", file=sys.stderr)
        return 2
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
