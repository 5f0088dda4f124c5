"""The embedded rollout engine: a generation server for a Hugging Face causal LM.

    python -m trainguard.rl.engine [--port P] [--model tiny-gpt2|DIR] [--weights-dir D]

It runs on CPU (or one GPU) with ``transformers``' ``generate``; requests arriving together
are generated as one batch. Under ``trainguard run`` it runs as a ``rollout`` role replica:
it binds ``$TRAINGUARD_AGENT_ROLE_HOST:$TRAINGUARD_AGENT_ROLE_PORT`` (``127.0.0.1`` beside the trainer, the
node's address on nodes of its own) and reads the weights the trainer publishes in
``$TRAINGUARD_RUN_DIR/rl/weights`` (:mod:`trainguard.rl.weights`).

The engine contract
-------------------
What the launcher and :class:`trainguard.rl.RolloutClient` expect of any engine (this one, or
an adapter in front of vLLM or SGLang); the statuses, endpoints, answer schemas and parsers are
:mod:`trainguard.core.contracts.engine`, the HTTP server :mod:`trainguard.core.jsonhttp`:

``GET /health``
    200 ``{"status": "starting"|"loading"|"serving"|"standby"|"quarantined",
    "weight_version": int|null, "model": str, "inflight": int, "pid": int,
    "incarnation": str|null, "vocab_size": int}``.
    ``starting``: the process is up, the model is being built; ``loading``: waiting for /
    loading the trainer's current weight version; ``serving``: it holds a published version
    and generates; ``standby``: a role's warm standby, built, not routed to;
    ``quarantined``: a client's refit check failed, it answers no completion until a refit is
    verified. An engine reports
    ``serving`` only after it loaded the version the weight store's pointer names
    (refit-gated (re)join). ``incarnation``: the nonce the supervisor gave this process
    (``$TRAINGUARD_AGENT_ROLE_INCARNATION``).
``POST /v1/completions``
    OpenAI-compatible: ``prompt`` (a string or a list of strings), ``max_tokens``,
    ``temperature``, ``top_p``, ``n``, ``seed``, ``logprobs`` (``stream`` is refused). The
    answer holds ``choices`` (``index`` = prompt index × n + j, ``text``, ``finish_reason``,
    and the extensions ``token_ids``, with the EOS token when it stopped there, and, with
    ``logprobs``, ``logprobs.token_logprobs``, one per token id) and
    ``weight_version``, the version of the weights that generated every choice (a weight
    update waits for the batch in progress). 503 while not serving; 4xx with
    ``{"error": {"message": ...}}`` for bad input. ``seed``: an int, or a list with one seed
    per prompt; sample ``j`` of a prompt seeded ``s`` draws from a stream of its own seeded
    ``s + j`` (:mod:`trainguard.rl.sampling`), and the rows of seeded requests are batched
    only with rows of prompts of the same token length, so a seeded sample is the same
    whatever else the engine generates beside it.
    ``prompt_logprobs``: each choice also has ``prompt_token_ids`` and ``prompt_logprobs``
    (one per prompt token, the first None), under the weights of ``weight_version``.
``GET /v1/weights``
    ``{"version": v}``.
``POST /v1/weights/update``
    ``{"version": v}`` → loads version ``v`` of the job's weight store and confirms
    ``{"version": v, "load_s": ...}``; a version the store does not hold is a 404 naming it,
    any other field a 400 (an update never names a file). Any stored version is accepted,
    older ones too: a trainer that resumed from a checkpoint refits the fleet
    to its own version. Independently of updates, the engine polls the store's pointer and
    refits itself when the pointer names another version (an engine that missed an update,
    or restarted, catches up without the trainer). A version is loaded only when its file's
    SHA-256 is the one the trainer wrote (:meth:`WeightStore.check_digest`; HTTP 500 naming
    the version otherwise, the engine keeping what it holds).
``POST /v1/weights/quarantine`` ``{"version": v, "reason": ...}``
    a client's refit check found this engine's weights not to be ``v``: status
    ``quarantined``, completions answered 503 (except a client's check, marked
    ``"refit_check": true``), until ``POST /v1/weights/verified``
    ``{"version": v}`` (after a refit that a client checked) makes it serve again (409 when
    it holds another version). :mod:`trainguard.rl.verify` says what is checked.

Every request, health included, is signed with the job's ``rollout`` token
(``$TRAINGUARD_AGENT_ROLE_TOKEN``, set by the role supervisor; :mod:`trainguard.core.fleetauth`),
and every answer to a signed request is signed back; a request without a valid signature is
answered 401 with one line, whatever the endpoint.

vLLM fits this contract through the adapter ``python -m trainguard.rl.engines.vllm``
(:mod:`trainguard.rl.engines.vllm`), which starts vLLM's OpenAI server as its child and maps
health, completions and weight updates onto vLLM's own APIs; docs/rl.md says what SGLang's
mapping would be.

A role's warm standby (``standby = N`` of the ``rollout`` role; ``$TRAINGUARD_AGENT_ROLE_STANDBY``
names its promotion file): the engine serves ``/health`` on its own port
(``$TRAINGUARD_AGENT_ROLE_PORT``, never routed to) with status ``standby`` once the model is built;
when the supervisor writes the promotion file (``{"replica": i, "port": p, "port_wait_s": w}``)
it binds port ``p`` (free once the dead replica is gone; after ``w`` seconds of another process
holding it, it exits with one line naming the port), closes its own, loads the current weight
version (``loading``) and serves: the replica's rejoin without the start-up.

Every health answer names its process: ``"pid"`` and ``"incarnation"`` (the nonce the supervisor
gave this start in ``$TRAINGUARD_AGENT_ROLE_INCARNATION``); the supervisor counts no other answer.

Fault injection (tests and benchmarks only, ``--enable-fault-injection``), armed by
``trainguard chaos engine-fault`` (:func:`trainguard.chaos.ops.engine_fault`, which signs
``POST /v1/faults`` with the role's token):
``{"kind": "http_500"|"malformed"|"hang", "count": n}`` makes the next ``n`` completion
requests answer HTTP 500, a truncated JSON body, or nothing at all (``n`` = 0 disarms);
``"partial_refit"``: the next ``n`` weight loads load half of the tensors and claim the
version (a refit that stopped half-way).
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

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    QUARANTINE_PATH,
    VERIFIED_PATH,
    WEIGHT_UPDATE_PATH,
    WEIGHTS_PATH,
    HealthAnswer,
    own_identity,
    weight_update_version,
)
from trainguard.core.contracts.engine import ReplicaStatus as S
from trainguard.core.fleetauth import Authenticator, replica_token
from trainguard.core.jsonhttp import HTTPError, JSONHandler, JSONServer
from trainguard.core.procs import pause_gc, resume_gc
from trainguard.rl.sampling import SEED_MAX, SeededSampler, request_seed, sample_seed
from trainguard.rl.tiny import TINY_MODEL, load_model
from trainguard.rl.weights import WeightDigestError, WeightStore, default_weight_dir

__all__ = ["Engine", "EngineConfig", "main"]

logger = logging.getLogger(__name__)

PORT_ENV = envvars.ROLE_PORT
ROLE_STANDBY_ENV = envvars.ROLE_STANDBY
FAULT_KINDS = ("http_500", "malformed", "hang", "partial_refit")


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
    seeded_batch_rows: int = 32
    """Rows per batch of seeded (reproducible) generation, always this many (see
    ``Engine._seeded_rows``)."""
    max_tokens_limit: int = 256
    max_n: int = 64
    poll_interval_s: float = 0.5
    """How often the engine checks the weight store's pointer for another version."""
    fault_injection: bool = False
    token: str | None = field(default=None, repr=False)
    """The token every request must be signed with (the ``rollout`` role's); None: no check
    (an engine in a process of its own always has one: ``$TRAINGUARD_AGENT_ROLE_TOKEN``)."""

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
    seed: int | tuple[int, ...] | None
    """An int: prompt ``k`` of the request is seeded ``request_seed(seed, k)``; a list: one
    seed per prompt."""
    logprobs: int | None
    prompt_logprobs: int | None = None
    """Set: each choice also has ``prompt_token_ids`` and ``prompt_logprobs`` (the first
    None), computed under the same weights as the choice (what a refit check compares)."""

    def key(self) -> tuple[int, float, float, bool]:
        return (self.max_tokens, self.temperature, self.top_p, self.seed is None)

    def prompt_seeds(self, count: int) -> list[int] | None:
        if self.seed is None:
            return None
        if isinstance(self.seed, int):
            return [request_seed(self.seed, k) for k in range(count)]
        return list(self.seed)


_Row = tuple[str, list[int], list[float], str]
"""A generated row: text, token ids, log-probs, finish reason."""


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


def _seed_field(body: dict[str, Any], prompts: int) -> int | tuple[int, ...] | None:
    v = body.get("seed")
    if v is None or not isinstance(v, list):
        return _int_field(body, "seed", None, 0, SEED_MAX)
    ok = all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= SEED_MAX for x in v)
    if not ok or len(v) != prompts:
        raise BadRequest(
            f"'seed' as a list must hold {prompts} integers in 0..{SEED_MAX} (one per prompt)"
        )
    return tuple(v)


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
        self.auth = Authenticator("rollout", config.token) if config.token else None
        self._model_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._faults: dict[str, int] = {}
        self._stop = threading.Event()
        self.num_generated = 0
        self.quarantines = 0

    # -- startup and weights -----------------------------------------------------------------
    def build(self) -> None:
        """Import the model's libraries and build it (status ``starting``)."""
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

    def load_weights(self, version: int) -> float:
        """Load ``version`` from the job's weight store; the seconds it took.
        FileNotFoundError when the store does not hold it."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        file = str(self.store.path_of(version))
        self.store.check_digest(version)  # never load bytes the trainer did not write
        tensors = load_file(file)
        if self.config.fault_injection and self.take_fault("partial_refit"):
            keep = sorted(tensors)[: len(tensors) // 2]  # a refit that stopped half-way
            tensors = {k: tensors[k] for k in keep}
        with self._model_lock:
            missing, unexpected = self.model.load_state_dict(tensors, strict=False)
            if unexpected:
                raise ValueError(f"{file}: tensors this model does not have: {unexpected[:5]}")
            self.version = version
        return time.perf_counter() - t0

    def quarantine(self, version: int | None, reason: str) -> None:
        """A client found this engine's weights not to be ``version``: answer no completion
        (503, health ``quarantined``) until a client verified a version again."""
        if self.status in (S.SERVING, S.QUARANTINED):
            self.status = S.QUARANTINED
        self.quarantines += 1
        logger.warning("engine: quarantined at weight version %s: %s", version, reason)

    def verified(self, version: int) -> bool:
        """A client verified ``version``: serve again (False: this engine holds another)."""
        if self.version != version:
            return False
        if self.status is S.QUARANTINED:
            self.status = S.SERVING
            logger.info("engine: weight version %d verified; serving again", version)
        return True

    def _watch(self) -> None:
        refused: int | None = None
        while not self._stop.wait(self.config.poll_interval_s):
            try:
                cur = self.store.current()
                if cur is not None and cur.version != self.version:
                    if self._load_published(cur.version):
                        logger.info("engine: refit to weight version %d", cur.version)
            except WeightDigestError as e:  # told once per version: it is retried each poll
                if refused != (cur.version if cur is not None else None):
                    refused = cur.version if cur is not None else None
                    logger.warning("engine: %s", e)
            except Exception:  # a torn or bad store never stops serving the version we hold
                logger.exception("engine: weight store check failed")

    # -- generation --------------------------------------------------------------------------
    def parse(self, body: object) -> tuple[list[str], _Sampling]:
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
            seed=_seed_field(body, len(prompts)),
            logprobs=_int_field(body, "logprobs", None, 0, 5),
            prompt_logprobs=_int_field(body, "prompt_logprobs", None, 0, 5),
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
            groups: dict[tuple[int, float, float, bool], list[_Job]] = {}
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
        # no autograd graph (grad mode is per thread: set here, never for the whole process,
        # which may be a trainer's or a test's)
        with torch.no_grad(), self._model_lock:
            version = self.version
            if s.seed is None:
                texts = [p for job in jobs for p in job.prompts for _ in range(job.sampling.n)]
                rows, n_prompt = self._rows(texts, s, None)
            else:
                rows, n_prompt = self._seeded_rows(jobs)
            scored = [
                self._score(job.prompts) if job.sampling.prompt_logprobs is not None else None
                for job in jobs
            ]
        self._finish(jobs, rows, n_prompt, version, scored)

    def _score(self, prompts: list[str]) -> list[tuple[list[int], list[float | None]]]:
        """Each prompt's token ids and the log-prob of each token given those before it (the
        first None), the prompt alone (no padding)."""
        import torch

        out: list[tuple[list[int], list[float | None]]] = []
        for p in prompts:
            ids = self.tokenizer(p, return_tensors="pt")["input_ids"]
            logits = self.model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append((ids[0].tolist(), [None, *lp.tolist()]))
        return out

    def _seeded_rows(self, jobs: list[_Job]) -> tuple[list[_Row], int]:
        """Reproducible rows: sample ``j`` of a prompt seeded ``s`` draws from the stream
        ``s + j`` alone, and rows are batched only with rows of prompts of the same token
        length (no padding), ``seeded_batch_rows`` at a time (the last batch filled up with
        copies): every batch has the same shapes, so the kernels that compute a row, and
        its numbers, do not depend on what else is in the batch."""
        s = jobs[0].sampling
        todo: list[tuple[str, int]] = []
        for job in jobs:
            seeds = job.sampling.prompt_seeds(len(job.prompts)) or []
            for p, seed in zip(job.prompts, seeds, strict=True):
                todo += [(p, sample_seed(seed, j)) for j in range(job.sampling.n)]
        by_len: dict[int, list[int]] = {}
        for i, (p, _) in enumerate(todo):
            by_len.setdefault(len(self.tokenizer(p)["input_ids"]), []).append(i)
        rows: list[_Row | None] = [None] * len(todo)
        k = self.config.seeded_batch_rows
        for same_len in by_len.values():
            for at in range(0, len(same_len), k):
                idx = same_len[at : at + k]
                fill = [idx[0]] * (k - len(idx))  # always k rows: same shapes, same kernels
                texts = [todo[i][0] for i in idx + fill]
                got, _ = self._rows(texts, s, [todo[i][1] for i in idx + fill])
                for i, row in zip(idx, got, strict=False):
                    rows[i] = row
        return [r for r in rows if r is not None], sum(by_len) // max(1, len(by_len))

    def _rows(
        self, texts: list[str], s: _Sampling, seeds: list[int] | None
    ) -> tuple[list[_Row], int]:
        """Generate ``texts`` as one batch: ``(text, token_ids, logprobs, finish_reason)`` per
        row and the prompt tokens per row. With ``seeds``, row ``b`` samples from its own
        stream seeded ``seeds[b]`` (:class:`SeededSampler`)."""
        tok = self.tokenizer
        enc = tok(texts, return_tensors="pt", padding=True)
        kwargs: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
            "return_dict_in_generate": True,
            "output_scores": True,
            "do_sample": False,
        }
        sampler = None
        if s.temperature > 0 and seeds is not None:
            sampler = SeededSampler(seeds, s.temperature, s.top_p)
            kwargs["logits_processor"] = [sampler]
        elif s.temperature > 0:
            kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0)
        out = self.model.generate(**enc, **kwargs)
        if sampler is None:
            scores = self.model.compute_transition_scores(
                out.sequences, out.scores, normalize_logits=True
            ).tolist()
        else:
            scores = sampler.logprobs
        new = out.sequences[:, enc["input_ids"].shape[1] :]
        rows = []
        for i in range(new.shape[0]):
            ids = new[i].tolist()
            lps = scores[i][: len(ids)]
            finish, end = "length", len(ids)
            if tok.eos_token_id in ids:  # kept in token_ids (as vLLM does), not in the text
                end = ids.index(tok.eos_token_id)
                ids, lps, finish = ids[: end + 1], lps[: end + 1], "stop"
            text = tok.decode(ids[:end], skip_special_tokens=True)
            rows.append((text, ids, lps, finish))
        return rows, int(enc["attention_mask"].sum().item()) // max(1, len(texts))

    def _finish(
        self,
        jobs: list[_Job],
        rows: list[_Row],
        n_prompt: int,
        version: int | None,
        scored: list[list[tuple[list[int], list[float | None]]] | None],
    ) -> None:
        tok = self.tokenizer
        self.num_generated += len(rows)
        at = 0
        for job, prompt_lps in zip(jobs, scored, strict=True):
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
                if prompt_lps is not None:
                    p_ids, p_lps = prompt_lps[idx // job.sampling.n]
                    choice.update(prompt_token_ids=p_ids, prompt_logprobs=p_lps)
                choices.append(choice)
            at += len(choices)
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

    def take_fault(self, only: str | None = None) -> str | None:
        """The next armed fault (of kind ``only``; otherwise of any request-time kind)."""
        with self._count_lock:
            for fault, left in self._faults.items():
                if left > 0 and (fault == only if only else fault != "partial_refit"):
                    self._faults[fault] = left - 1
                    return fault
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
        QUARANTINE_PATH: "_verdict",
        VERIFIED_PATH: "_verdict",
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
        check = isinstance(body, dict) and body.get("refit_check") is True
        if e.status is not S.SERVING and not (check and e.status is S.QUARANTINED):
            raise HTTPError(503, f"engine is {e.status}, not serving")
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

    def _verdict(self) -> None:
        """``POST /v1/weights/quarantine`` ``{"version", "reason"}`` / ``/v1/weights/verified``
        ``{"version"}``: a client's refit check of this engine."""
        e = self.engine
        body = self.read_object()
        try:
            version = _int_field(body, "version", None, 0, 2**63 - 1)
        except BadRequest as err:
            raise HTTPError(400, str(err)) from None
        if version is None:
            raise HTTPError(400, "'version' (the weight version checked) is required")
        if self.path == QUARANTINE_PATH:
            e.quarantine(version, str(body.get("reason", ""))[:500])
        elif not e.verified(version):
            raise HTTPError(409, f"this engine holds weight version {e.version}, not {version}")
        self.send_json(200, {"status": e.status.value, "version": e.version})

    def _update(self) -> None:
        e = self.engine
        try:
            version = weight_update_version(self.read_object())
        except ValueError as err:
            raise HTTPError(400, str(err)) from None
        if e.status in (S.STARTING, S.STANDBY):
            raise HTTPError(503, f"engine is {e.status}; it loads the current version itself")
        try:
            load_s = e.load_weights(version)
        except WeightDigestError as err:
            raise HTTPError(500, str(err)) from None
        except FileNotFoundError:
            raise HTTPError(
                404,
                f"weight version {version} is not in the job's weight store ({e.store.root}): "
                "publish it there first (the trainer's WeightStore.publish), or name a version "
                "it holds",
            ) from None
        except Exception as err:
            raise HTTPError(500, f"could not load weight version {version}: {err}") from None
        self.send_json(200, {"version": version, "load_s": round(load_s, 6)})


def serve(engine: Engine) -> JSONServer:
    handler = type("Handler", (_Handler,), {"engine": engine, "authenticator": engine.auth})
    return JSONServer((engine.config.host, engine.config.port), handler)


def _parse(argv: list[str] | None) -> EngineConfig:
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
            token=replica_token("the engine"),
        )
    except ValueError as e:
        p.error(str(e))
    import torch

    torch.set_num_threads(max(1, a.threads))
    return cfg


def _bind_when_free(engine: Engine, wait_s: float) -> JSONServer:
    """A promoted standby's bind: retried while the dead replica's port is not free yet, at
    most ``wait_s`` seconds (then OSError naming the port)."""
    give_up = time.monotonic() + wait_s
    while True:
        try:
            return serve(engine)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > give_up:
                raise
            time.sleep(0.05)


def _await_promotion(engine: Engine, promote: Path) -> JSONServer:
    """A role's standby: serve health on its own port (``standby`` once built) until the
    promotion file names the port of the replica it replaces; returns the server on that port."""
    own = serve(engine)
    threading.Thread(target=own.serve_forever, name="engine-standby", daemon=True).start()
    logger.info("engine: standby, health on port %d", own.server_address[1])
    engine.build()
    resume_gc(freeze=False)  # main() held it off while torch and the model loaded
    # its own readiness record first, then the claim: no answer says standby before the log
    logger.info("engine: standby ready; waiting for %s", promote)
    engine.status = S.STANDBY
    while True:
        try:
            order = json.loads(promote.read_text())
            port = int(order["port"])
            wait_s = float(order.get("port_wait_s", 30.0))
        except FileNotFoundError:
            time.sleep(0.05)
            continue
        except (OSError, ValueError, KeyError, TypeError):  # written atomically: not yet whole
            time.sleep(0.05)
            continue
        break
    engine.config.port = port
    engine.status = S.STARTING  # until the current weights are loaded (boot: loading)
    server = _bind_when_free(engine, wait_s)
    own.shutdown()
    own.server_close()
    logger.info("engine: promoted to replica %s on port %d", order.get("replica"), port)
    return server


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine[%(process)d] %(message)s")
    pause_gc()  # torch, transformers and the model: imported and built with the collector off
    cfg = _parse(argv)
    engine = Engine(cfg)
    promote = os.environ.get(ROLE_STANDBY_ENV)
    try:
        if promote:
            server = _await_promotion(engine, Path(promote))
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
    finally:
        resume_gc(freeze=False)  # the model may be replaced later: nothing frozen
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
