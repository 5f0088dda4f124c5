"""The engine contract as code: the replica lifecycle's one vocabulary, the endpoints, the
answer schemas, and the one guarded parser of every answer kind.

Every engine trainguard starts (the embedded engine :mod:`trainguard.rl.engine`, an adapter in
front of vLLM, a reward server) speaks this contract, and every reader of an answer (the role
supervisor's probes, the trainer's rollout and reward clients, the conformance tests) parses
it with the functions here, so that the engine, the supervisor, the client, telemetry and
the dashboards all spell a replica's state the same way (:class:`ReplicaStatus`).

Guarded parsing: a parser returns a checked, typed answer or raises :class:`MalformedAnswer`
(a ``ValueError``), whatever the bytes were: not JSON, too large (:data:`MAX_ANSWER_BYTES`),
nested beyond the interpreter's recursion limit, ``NaN``/``Infinity``, a field of the wrong
type or out of its range (a 400-digit version, ``1e999``), a token id outside the vocabulary,
a non-finite log-prob or reward, an absurd count. A caller counts it as a ``malformed``
failure and asks another server; nothing of a malformed answer is ever used.
"""

from __future__ import annotations

import enum
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from trainguard.core import jsonhttp
from trainguard.core.contracts import envvars

__all__ = [
    "CLIENT_STATES",
    "COMPLETIONS_PATH",
    "ENGINE_STATUSES",
    "HEALTH_PATH",
    "QUARANTINE_PATH",
    "VERIFIED_PATH",
    "MALFORMED",
    "READY_STATUSES",
    "REPLICA_STATES",
    "REWARDS_PATH",
    "STANDBY_STATES",
    "WEIGHTS_PATH",
    "WEIGHT_UPDATE_PATH",
    "Choice",
    "CompletionAnswer",
    "HealthAnswer",
    "Identity",
    "MalformedAnswer",
    "Probe",
    "PromptLogprobs",
    "ReplicaStatus",
    "RewardAnswer",
    "WeightUpdateAnswer",
    "error_message",
    "identity_mismatch",
    "own_identity",
    "parse_completion",
    "parse_health",
    "parse_prompt_logprobs",
    "parse_rewards",
    "parse_weight_update",
    "parse_weights",
    "weight_update_version",
    "probe_health",
]


class ReplicaStatus(str, enum.Enum):
    """The lifecycle states of an engine replica: the one vocabulary from the engine's health
    answer to the supervisor's state files and events, the rollout client and the dashboards.

    Which component uses which states: :data:`ENGINE_STATUSES` (what ``GET /health`` says),
    :data:`REPLICA_STATES` (the role supervisor's replicas, exported as
    ``trainguard.role.replica.state``), :data:`STANDBY_STATES` (a role's warm standbys),
    :data:`CLIENT_STATES` (the trainer's rollout client)."""

    UNKNOWN = "unknown"
    """The client has not had a good health answer yet."""
    STARTING = "starting"
    """The process runs; its model is being built (or its health has not answered yet)."""
    LOADING = "loading"
    """Built; waiting for or loading the trainer's current weight version."""
    SERVING = "serving"
    """Holds a published weight version and generates."""
    STANDBY = "standby"
    """A warm standby: built, not routed to, waiting to be promoted in place of a replica."""
    PROMOTED = "promoted"
    """A standby that has just been promoted in place of a dead replica."""
    STALE = "stale"
    """Serving a version outside the trainer's staleness bound (back after a refit)."""
    QUARANTINED = "quarantined"
    """Its refit failed a client's check (an update error, or log-probs other than the
    trainer's fingerprint): out of routing, answering no completion, refit again; counted
    against the role's restart budget (:mod:`trainguard.rl.verify`)."""
    SUSPECT = "suspect"
    """A probe or request failed after it had answered well."""
    DEAD = "dead"
    """Exited, refused a connection, or without a good answer for too long."""
    RESTARTING = "restarting"
    """Counted against the role's restart budget, being started again."""
    RETIRED = "retired"
    """Not restarted again (it died ``retire_after`` times, or its port stayed taken); the
    role goes on with the others while they keep its floor."""
    FAILED = "failed"
    """Not restarted (budget spent, policy ``never``, never ready, below the role's floor)."""
    STOPPED = "stopped"
    """Ended with the job."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


S = ReplicaStatus
ENGINE_STATUSES = (S.STARTING, S.LOADING, S.SERVING, S.STANDBY, S.QUARANTINED)
"""What an engine may answer in ``GET /health``'s ``status``."""
READY_STATUSES = (S.LOADING, S.SERVING)
"""Health statuses that count as ready (the process is up; ``loading`` waits for weights)."""
REPLICA_STATES = (
    S.STARTING,
    S.LOADING,
    S.SERVING,
    S.QUARANTINED,
    S.SUSPECT,
    S.DEAD,
    S.RESTARTING,
    S.RETIRED,
    S.FAILED,
    S.STOPPED,
)
"""A role replica's states as the role supervisor keeps them (state files, events,
``trainguard.role.replica.state``): starting → loading → serving → suspect → dead →
restarting (→ starting); quarantined (a refit that failed a client's check, counted against
the restart budget); retired; failed; stopped."""
STANDBY_STATES = (S.STARTING, S.STANDBY, S.SUSPECT, S.PROMOTED, S.DEAD, S.FAILED, S.STOPPED)
"""A role's warm standby slot as the role supervisor keeps it."""
CLIENT_STATES = (S.UNKNOWN, S.LOADING, S.SERVING, S.STALE, S.SUSPECT, S.DEAD, S.QUARANTINED)
"""An engine as the trainer's rollout client sees it: UNKNOWN → LOADING → SERVING ⇄ SUSPECT →
DEAD → (restarted) LOADING → SERVING; SERVING ⇄ STALE; LOADING → QUARANTINED (a refit that
failed its check) → LOADING (refit again) → SERVING once verified."""

# -- endpoints ---------------------------------------------------------------------------------
HEALTH_PATH = "/health"
COMPLETIONS_PATH = "/v1/completions"
WEIGHTS_PATH = "/v1/weights"
WEIGHT_UPDATE_PATH = "/v1/weights/update"
QUARANTINE_PATH = "/v1/weights/quarantine"
VERIFIED_PATH = "/v1/weights/verified"
MODELS_PATH = "/v1/models"
REWARDS_PATH = "/v1/rewards"

# -- bounds ------------------------------------------------------------------------------------
MALFORMED = "malformed"
"""The failure reason of every answer a parser refuses (``ROLLOUT_FAILURE_REASONS``)."""
MAX_ANSWER_BYTES = 64 << 20
"""The largest answer a client reads (a completion of 256 sequences × 256 tokens with
log-probs is about 5 MiB)."""
MAX_HEALTH_BYTES = 64 << 10
MAX_VERSION = 2**63 - 1
MAX_INFLIGHT = 1 << 20
MAX_PID = 1 << 22
"""Linux's ``pid_max`` limit."""
TOKEN_ID_LIMIT = 1 << 31
"""Token ids must be below this when the vocabulary size is not known."""
MAX_ABS_REWARD = 1e9
MAX_LOGPROB = 1e-3
"""Log-probs are <= 0; this much above it is rounding, more is not a log-prob."""
MAX_TEXT = 16 << 20


class MalformedAnswer(ValueError):
    """An answer that does not meet the contract (``detail`` says what and where)."""

    reason = MALFORMED

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# -- guarded JSON ------------------------------------------------------------------------------
def _bad_constant(name: str) -> NoReturn:
    raise MalformedAnswer(f"holds {name}, not a number the contract allows")


def loads(raw: bytes | str, *, max_bytes: int = MAX_ANSWER_BYTES) -> Any:
    """JSON within the contract's bounds: at most ``max_bytes``, no ``NaN``/``Infinity``,
    nesting within the interpreter's recursion limit; :class:`MalformedAnswer` otherwise,
    never another exception. (The parsers then read only the fields of their schema, each
    type- and range-checked: an integer of 400 digits or ``1e999`` in one of them is refused
    there; elsewhere it is ignored.)"""
    if len(raw) > max_bytes:
        raise MalformedAnswer(f"has {len(raw)} bytes, more than the {max_bytes} allowed")
    try:
        return json.loads(raw, parse_constant=_bad_constant)
    except MalformedAnswer:
        raise
    except RecursionError:
        raise MalformedAnswer("is nested too deep") from None
    except (ValueError, TypeError) as e:
        raise MalformedAnswer(f"is not JSON ({str(e)[:120]})") from None


_F = TypeVar("_F", bound=Callable[..., object])


def guarded(fn: _F) -> _F:
    """``fn`` raises :class:`MalformedAnswer` for any exception (a parser's bug or an answer
    nobody foresaw included): nothing else ever leaves a parser."""

    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except MalformedAnswer:
            raise
        except Exception as e:  # a parse must never take the caller down
            raise MalformedAnswer(f"{type(e).__name__}: {str(e)[:200]}") from None

    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    return wrapper  # type: ignore[return-value]


def _obj(raw: bytes | str | dict[str, Any], what: str, max_bytes: int) -> dict[str, Any]:
    try:
        obj = raw if isinstance(raw, dict) else loads(raw, max_bytes=max_bytes)
    except MalformedAnswer as e:
        raise MalformedAnswer(f"the {what} answer {e.detail}") from None
    if not isinstance(obj, dict):
        raise MalformedAnswer(f"the {what} answer is not a JSON object")
    return obj


def _int(v: object, what: str, lo: int, hi: int, *, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MalformedAnswer(f"{what} must be an integer in {lo}..{hi}, got {_short(v)}")
    return v


def _num(v: object, what: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MalformedAnswer(f"{what} must be a number, got {_short(v)}")
    if isinstance(v, int) and not -(10**18) <= v <= 10**18:
        raise MalformedAnswer(f"{what} must be a finite number in {lo:g}..{hi:g}, got {_short(v)}")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise MalformedAnswer(f"{what} must be a finite number in {lo:g}..{hi:g}, got {f!r}")
    return f


def _str(v: object, what: str, limit: int, *, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise MalformedAnswer(f"{what} must be a string of at most {limit} characters")
    return v


def _short(v: object) -> str:
    s = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else "a huge integer"
    return s[:60]


# -- schemas -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Identity:
    """Which process answers on a replica's port: its pid and the nonce it was given."""

    pid: int | None
    incarnation: str | None


def own_identity() -> Identity:
    """This process's identity, as its health answer reports it."""
    return Identity(os.getpid(), os.environ.get(envvars.ROLE_INCARNATION) or None)


@dataclass(frozen=True, slots=True)
class HealthAnswer:
    """``GET /health`` → 200 ``{"status", "weight_version", "inflight", "pid",
    "incarnation", "model", "vocab_size"}`` (only ``status`` required)."""

    status: ReplicaStatus
    weight_version: int | None = None
    inflight: int = 0
    pid: int | None = None
    incarnation: str | None = None
    model: str | None = None
    vocab_size: int | None = None

    @property
    def identity(self) -> Identity:
        return Identity(self.pid, self.incarnation)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "weight_version": self.weight_version,
            "inflight": self.inflight,
            "pid": self.pid,
            "incarnation": self.incarnation,
            "model": self.model,
            "vocab_size": self.vocab_size,
        }


@guarded
def parse_health(raw: bytes | str | dict[str, Any]) -> HealthAnswer:
    """The one parser of a health answer."""
    h = _obj(raw, "health", MAX_HEALTH_BYTES)
    status = h.get("status")
    if not isinstance(status, str):
        raise MalformedAnswer('the health answer has no "status"')
    try:
        st = ReplicaStatus(status)
    except ValueError:
        st = None
    if st not in ENGINE_STATUSES:
        allowed = ", ".join(s.value for s in ENGINE_STATUSES)
        raise MalformedAnswer(f"unknown status {status[:40]!r} (one of {allowed})")
    assert st is not None
    return HealthAnswer(
        status=st,
        weight_version=_int(
            h.get("weight_version"), "weight_version", 0, MAX_VERSION, optional=True
        ),
        inflight=_int(h.get("inflight", 0), "inflight", 0, MAX_INFLIGHT),
        pid=_int(h.get("pid"), "pid", 1, MAX_PID, optional=True),
        incarnation=_str(h.get("incarnation"), "incarnation", 128, optional=True),
        model=_str(h.get("model"), "model", 4096, optional=True),
        vocab_size=_int(h.get("vocab_size"), "vocab_size", 1, TOKEN_ID_LIMIT, optional=True),
    )


def identity_mismatch(got: Identity, expected: Identity | None) -> str | None:
    """Why an answer is not from the expected process (None: it is, or nothing is expected).
    A field the expectation leaves None is not checked; one it names must be answered."""
    if expected is None:
        return None
    if expected.incarnation is not None and got.incarnation != expected.incarnation:
        return f"incarnation {got.incarnation!r}, expected {expected.incarnation!r}"
    if expected.pid is not None and got.pid != expected.pid:
        return f"pid {got.pid}, expected {expected.pid}"
    return None


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str


@dataclass(frozen=True, slots=True)
class CompletionAnswer:
    """``POST /v1/completions`` → ``{"choices": [...], "weight_version": v}``; ``choices``
    sorted by index, exactly one per index ``0..expected-1``."""

    choices: list[Choice]
    weight_version: int
    incarnation: str | None = None
    """The answering process's nonce, where the engine names it (as in its health)."""


_INT = frozenset({int})
_NUMBER = frozenset({int, float})
"""Exact types (``bool`` is neither), checked with ``set(map(type, xs))`` at C speed."""


@guarded
def parse_completion(
    raw: bytes | str | dict[str, Any], *, expected: int, vocab_size: int | None = None
) -> CompletionAnswer:
    """The one parser of a completion answer to a request of ``expected`` sequences (prompts
    × n); token ids must be in ``0..vocab_size-1`` (``TOKEN_ID_LIMIT`` when unknown)."""
    a = _obj(raw, "completion", MAX_ANSWER_BYTES)
    version = _int(a.get("weight_version"), "weight_version", 0, MAX_VERSION)
    choices = a.get("choices")
    if not isinstance(choices, list) or len(choices) != expected:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise MalformedAnswer(f"{got} choices for {expected} requested")
    vocab = vocab_size if vocab_size is not None else TOKEN_ID_LIMIT
    out: list[Choice | None] = [None] * expected
    for k, c in enumerate(choices):
        if not isinstance(c, dict):
            raise MalformedAnswer(f"choice {k} is not an object")
        idx = _int(c.get("index"), f"choice {k}: index", 0, expected - 1)
        if out[idx] is not None:
            raise MalformedAnswer(f"choice index {idx} twice")
        text = _str(c.get("text"), f"choice {idx}: text", MAX_TEXT)
        ids = c.get("token_ids")
        if not isinstance(ids, list):
            raise MalformedAnswer(f"choice {idx} has no token_ids list")
        if not set(map(type, ids)) <= _INT or (ids and not 0 <= min(ids) <= max(ids) < vocab):
            bad = next(t for t in ids if type(t) is not int or not 0 <= t < vocab)
            raise MalformedAnswer(
                f"choice {idx}: token id {_short(bad)} outside the vocabulary 0..{vocab - 1}"
            )
        lps: list[float] | None = None
        lp = c.get("logprobs")
        if lp is not None:
            if not isinstance(lp, dict):
                raise MalformedAnswer(f"choice {idx}: logprobs is not an object")
            tl = lp.get("token_logprobs")
            if tl is not None:
                if not isinstance(tl, list) or len(tl) != len(ids):
                    raise MalformedAnswer(f"choice {idx}: not one log-prob per token id")
                if not set(map(type, tl)) <= _NUMBER:
                    raise MalformedAnswer(f"choice {idx}: a log-prob that is not a number")
                lps = list(map(float, tl))
                if lps and not (all(map(math.isfinite, lps)) and max(lps) <= MAX_LOGPROB):
                    raise MalformedAnswer(
                        f"choice {idx}: a log-prob that is not finite or above {MAX_LOGPROB:g}"
                    )
        finish = c.get("finish_reason")
        finish = _str(finish, f"choice {idx}: finish_reason", 64, optional=True) or ""
        out[idx] = Choice(idx, text, list(ids), lps, finish)
    incarnation = _str(a.get("incarnation"), "incarnation", 128, optional=True)
    return CompletionAnswer([c for c in out if c is not None], version, incarnation)


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A completion answer asked with ``prompt_logprobs``: per prompt, its token ids (None
    where the engine does not say) and the log-prob of each token given those before it
    (the first None)."""

    weight_version: int
    prompts: list[tuple[list[int] | None, list[float | None]]]


@guarded
def parse_prompt_logprobs(raw: bytes | str | dict[str, Any], *, expected: int) -> PromptLogprobs:
    """The one parser of a completion answer's prompt log-probs (``expected`` choices, n = 1):
    a list of numbers (the embedded engine) or of ``{token_id: {"logprob": x}}`` (vLLM) per
    choice, the first entry None; every log-prob finite and <= :data:`MAX_LOGPROB`."""
    a = _obj(raw, "completion", MAX_ANSWER_BYTES)
    version = _int(a.get("weight_version"), "weight_version", 0, MAX_VERSION)
    choices = a.get("choices")
    if not isinstance(choices, list) or len(choices) != expected:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise MalformedAnswer(f"{got} choices for {expected} requested")
    out: list[tuple[list[int] | None, list[float | None]]] = [([], [])] * expected
    for k, c in enumerate(choices):
        if not isinstance(c, dict):
            raise MalformedAnswer(f"choice {k} is not an object")
        idx = _int(c.get("index", k), f"choice {k}: index", 0, expected - 1)
        raw_lps = c.get("prompt_logprobs")
        if not isinstance(raw_lps, list) or len(raw_lps) > TOKEN_ID_LIMIT:
            raise MalformedAnswer(f"choice {idx} has no prompt_logprobs list")
        lps: list[float | None] = []
        for j, x in enumerate(raw_lps):
            if isinstance(x, dict) and x:
                x = next(iter(x.values()))
                x = x.get("logprob") if isinstance(x, dict) else x
            lps.append(None if x is None else _num(x, f"choice {idx}: prompt log-prob {j}",
                                                   -1e9, MAX_LOGPROB))  # fmt: skip
        ids = c.get("prompt_token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(type(t) is int for t in ids)):
            raise MalformedAnswer(f"choice {idx}: prompt_token_ids is not a list of integers")
        out[idx] = (list(ids) if ids is not None else None, lps)
    return PromptLogprobs(version, out)


@dataclass(frozen=True, slots=True)
class WeightUpdateAnswer:
    """``POST /v1/weights/update {"version": v}`` → ``{"version": v, "load_s": s}``."""

    version: int
    load_s: float | None


@guarded
def parse_weight_update(raw: bytes | str | dict[str, Any]) -> WeightUpdateAnswer:
    a = _obj(raw, "weight update", MAX_HEALTH_BYTES)
    load_s = a.get("load_s")
    return WeightUpdateAnswer(
        version=_int(a.get("version"), "version", 0, MAX_VERSION),
        load_s=None if load_s is None else _num(load_s, "load_s", 0.0, 1e7),
    )


@guarded
def weight_update_version(body: dict[str, object]) -> int:
    """The version a ``POST`` :data:`WEIGHT_UPDATE_PATH` request names (the server's side of the
    contract: one version of the job's weight store, nothing else, never a file); ``ValueError``
    with the 400's one line otherwise."""
    version = body.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
        raise ValueError(
            f"'version' (the weight version to load, an integer >= 0) is required, got {version!r}"
        )
    extra = sorted(set(body) - {"version"})
    if extra:
        raise ValueError(
            f"unknown fields {extra}: a weight update names only a version of the job's weight "
            'store ({"version": v}); publish the weights there first'
        )
    return version


def parse_weights(raw: bytes | str | dict[str, Any]) -> int | None:
    """``GET /v1/weights`` → ``{"version": v | null}``: the version held."""
    a = _obj(raw, "weights", MAX_HEALTH_BYTES)
    return _int(a.get("version"), "version", 0, MAX_VERSION, optional=True)


@dataclass(frozen=True, slots=True)
class RewardAnswer:
    """``POST /v1/rewards {"prompts", "completions"}`` → ``{"rewards": [float, ...]}``."""

    rewards: list[float]


@guarded
def parse_rewards(raw: bytes | str | dict[str, Any], *, expected: int) -> RewardAnswer:
    """The one parser of a reward answer: ``expected`` finite rewards within
    ±:data:`MAX_ABS_REWARD` (a NaN or infinite reward never reaches the loss)."""
    a = _obj(raw, "reward", MAX_ANSWER_BYTES)
    rewards = a.get("rewards")
    if not isinstance(rewards, list) or len(rewards) != expected:
        got = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
        raise MalformedAnswer(f"{got} rewards for {expected} completions")
    return RewardAnswer(
        [_num(r, f"reward {i}", -MAX_ABS_REWARD, MAX_ABS_REWARD) for i, r in enumerate(rewards)]
    )


def error_message(raw: bytes) -> str:
    """The message of an error answer ``{"error": {"message": ...}}`` (or the body's first
    characters); never raises."""
    try:
        obj = loads(raw, max_bytes=MAX_HEALTH_BYTES)
        msg = obj["error"]["message"]
        if isinstance(msg, str):
            return msg[:300]
    except Exception:  # any shape: the raw text is the message
        pass
    return raw[:200].decode(errors="replace")


error_body = jsonhttp.error_body
"""The error schema every server of the contract answers with."""


# -- the one health probe ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Probe:
    """One health probe's outcome."""

    outcome: str
    """``ok``, ``refused``, ``timeout``, ``http_error``, ``malformed``, ``error``."""
    health: HealthAnswer | None = None
    detail: str = ""

    @property
    def status(self) -> ReplicaStatus | None:
        return self.health.status if self.health is not None else None

    @property
    def weight_version(self) -> int | None:
        return self.health.weight_version if self.health is not None else None


def probe_health(
    port: int,
    path: str = HEALTH_PATH,
    timeout: float = 2.0,
    host: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
    *,
    token: str | None = None,
    verify_answer: bool = True,
) -> Probe:
    """``GET http://<host>:<port><path>`` parsed by :func:`parse_health`, signed with the
    role's ``token`` (and its answer checked, unless ``verify_answer`` is False); never
    raises."""
    try:
        resp = jsonhttp.request(
            host, port, "GET", path, timeout=timeout, max_bytes=MAX_HEALTH_BYTES,
            headers=headers, token=token, verify_answer=verify_answer,
        )  # fmt: skip
    except jsonhttp.TransportError as e:
        outcome = {"refused": "refused", "timeout": "timeout", "too_large": "malformed"}
        return Probe(outcome.get(e.reason, "error"), detail=e.detail)
    if resp.status != 200:
        return Probe("http_error", detail=f"HTTP {resp.status}: {error_message(resp.body)}")
    try:
        return Probe("ok", health=parse_health(resp.body))
    except MalformedAnswer as e:
        return Probe("malformed", detail=e.detail)
