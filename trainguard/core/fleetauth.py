"""Authentication of the rollout fleet: engines, reward servers and the fleet endpoint.

Every request to a role replica is signed with its role's token: ``HMAC-SHA256(job secret,
"trainguard fleet" || role)`` in hex. The request carries::

    Authorization: TG1 t=<unix time>,n=<random nonce>,b=<SHA-256 of the body>,m=<MAC>

with ``MAC = HMAC-SHA256(token, "TG1" | method | path | port | t | n | b)`` (fields joined by
newlines; ``port`` the server's). The server checks the MAC (:func:`hmac.compare_digest`)
before it reads the body, then that ``t`` is within :data:`WINDOW_S` of its clock and ``n``
was not seen in that window (no replay), then, once read, the body against ``b``. A request
without a valid signature is answered 401 with the same line whatever it asked (no health, no
version, no completions, no weight update, its body never read) and the connection closed. The
token itself never travels: a process that captures requests, or answers on a dead replica's
port, learns none that it can send elsewhere. Every answer of a server that checked a request
carries ``X-Trainguard-Answer: HMAC-SHA256(token, "TG1 answer" | n | status | SHA-256 of the
body)``: :func:`answer_ok` tells a client that the answer came from a holder of the token.

The replica knows only its own role's token (``TRAINGUARD_AGENT_ROLE_TOKEN`` in its environment),
the trainer's workers the tokens of the roles they call (``TRAINGUARD_ROLLOUT_TOKEN``,
``TRAINGUARD_REWARD_TOKEN``), and the job secret itself stays with the agents, in
``RUN_DIR/roles/secret`` (mode 0600, created by the first agent of the job, refused when
another user could read it or owns it). Why a MAC per request: docs/security.md ("The rollout
fleet").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.secretfile import Fixes, read_secret_file

__all__ = [
    "ANSWER_HEADER",
    "AUTH_HEADER",
    "MIN_SECRET_BYTES",
    "WINDOW_S",
    "Authenticator",
    "Signature",
    "answer_message",
    "answer_ok",
    "job_secret",
    "load_secret_file",
    "replica_token",
    "role_token",
    "secret_path",
    "sign",
    "token_from_env",
]

AUTH_HEADER = "Authorization"
ANSWER_HEADER = "X-Trainguard-Answer"
WINDOW_S = 60.0
"""How far a request's time may be from the server's clock (the clocks of a job's nodes are
kept by NTP; within this window a nonce is never accepted twice)."""
_SCHEME = "TG1"
_EMPTY_SHA = hashlib.sha256(b"").hexdigest()
MIN_SECRET_BYTES = 16
_MIN_TOKEN_CHARS = 16
"""A replica's token shorter than this is taken for a mistake (a role token is 64 hex digits)."""
_CONTEXT = b"trainguard fleet\0"


def secret_path(run_dir: str | os.PathLike[str]) -> Path:
    """``RUN_DIR/roles/secret``: the job secret of the fleet (the agents' only)."""
    return RunDir(run_dir).role_secret


_FLEET_SECRET_FIXES = Fixes(
    unopenable="delete it or fix its path",
    not_regular="delete it",
    owner="delete it",
    group_readable="delete it (the next agent makes a new one) or chmod 600 it",
    short="; delete it",
)
"""The job secret is trainguard's own file: a bad one is deleted and made again."""


def load_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path``; ``ValueError`` (one line: what, where, how to fix) if it is not a
    regular file of this user, is readable by group or others, or too short. Never follows a
    symlink."""
    return read_secret_file(
        path,
        where=f"fleet secret {str(path)!r}",
        min_bytes=MIN_SECRET_BYTES,
        nofollow=True,
        own=True,
        fixes=_FLEET_SECRET_FIXES,
    )


def job_secret(run_dir: str | os.PathLike[str]) -> bytes:
    """The job's fleet secret: read from ``RUN_DIR/roles/secret``, or created there (32 random
    bytes, hex, mode 0600) by the first agent that asks. Agents on other nodes of a run dir on
    a shared file system read the same file; the creation is atomic (``link``), so two agents
    starting together agree. ``ValueError`` (one line) when the file is unsafe."""
    path = secret_path(run_dir)
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_hex(32).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another agent was first: its secret is the job's
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return load_secret_file(path)


def role_token(secret: bytes, role: str) -> str:
    """The token of ``role`` (``rollout``, ``reward``, ``fleet``): hex HMAC-SHA256."""
    return hmac.new(secret, _CONTEXT + role.encode(), hashlib.sha256).hexdigest()


def token_from_env(role: str, env: Mapping[str, str] | None = None) -> str | None:
    """The token a trainer's worker holds for ``role`` (``TRAINGUARD_<ROLE>_TOKEN``), or None."""
    env = os.environ if env is None else env
    name = envvars.ROLE_TOKENS.get(role)
    return (env.get(name) or None) if name else None


def replica_token(what: str, env: Mapping[str, str] | None = None) -> str:
    """The token a role replica checks every request against (``TRAINGUARD_AGENT_ROLE_TOKEN``,
    set by the role supervisor). ValueError (one line: how to run ``what`` with one) when it is
    unset or too short."""
    env = os.environ if env is None else env
    token = env.get(envvars.ROLE_TOKEN, "").strip()
    if len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(
            f"no job token: {envvars.ROLE_TOKEN} is unset or too short; run {what} as a role "
            "of `trainguard run`, or set it to the token its clients send (docs/security.md)"
        )
    return token


def _mac(token: str, *fields: str) -> str:
    return hmac.new(token.encode(), "\n".join(fields).encode(), hashlib.sha256).hexdigest()


class Signature(dict[str, str]):
    """The headers that sign one request (a dict), and its nonce (to check the answer)."""

    nonce: str = ""


def sign(
    token: str | None, method: str, path: str, port: int, body: bytes | None = None
) -> Signature:
    """The headers that sign ``method path`` with ``body`` for the server on ``port``
    (none without a token: a server without authentication, e.g. a test's stub)."""
    sig = Signature()
    if not token:
        return sig
    t, n = str(int(time.time())), secrets.token_hex(16)
    b = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA
    m = _mac(token, _SCHEME, method, path, str(port), t, n, b)
    sig[AUTH_HEADER] = f"{_SCHEME} t={t},n={n},b={b},m={m}"
    sig.nonce = n
    return sig


def answer_ok(
    token: str | None, sig: Signature, status: int, body: bytes, header: str | None
) -> bool:
    """Whether an answer (``status``, ``body``, its ``X-Trainguard-Answer`` ``header``) to the
    request signed by ``sig`` came from a holder of ``token`` (True without a token)."""
    if not token:
        return True
    want = _mac(token, "TG1 answer", sig.nonce, str(status), hashlib.sha256(body).hexdigest())
    return header is not None and hmac.compare_digest(header.encode(), want.encode())


def _parse(header: str | None) -> dict[str, str] | None:
    if not header or not header.startswith(_SCHEME + " ") or len(header) > 512:
        return None
    fields = dict(kv.split("=", 1) for kv in header[4:].split(",") if "=" in kv)
    return fields if set(fields) == {"t", "n", "b", "m"} else None


class Authenticator:
    """The server side: checks each request of a ``role`` server against its ``token``
    (:meth:`authorize`, before the body is read; :meth:`body_ok`, after), remembers the nonces of
    the last :data:`WINDOW_S` (a replayed request is refused) and signs the answers
    (:meth:`answer_header`)."""

    def __init__(self, role: str, token: str, *, window_s: float = WINDOW_S) -> None:
        self.role, self.window_s = role, window_s
        self._token = token
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._next_prune = 0.0
        self.refused = 0
        """Requests refused (401) since the start."""

    def _fresh(self, nonce: str, t: float, now: float) -> bool:
        with self._lock:
            if now >= self._next_prune:
                self._seen = {k: v for k, v in self._seen.items() if v > now}
                self._next_prune = now + self.window_s / 4
            if nonce in self._seen:
                return False
            self._seen[nonce] = t + self.window_s
            return True

    def verify(self, method: str, path: str, port: int, header: str | None) -> str | None:
        """None when the signature is good, fresh and new; else the one-line reason."""
        f = _parse(header)
        if f is None:
            return (
                f"no job signature: every request to a {self.role} server must be signed with "
                f"the job's {self.role} token ({envvars.ROLE_TOKENS.get(self.role, 'its token')} "
                "in the trainer's workers; docs/security.md)"
            )
        want = _mac(self._token, _SCHEME, method, path, str(port), f["t"], f["n"], f["b"])
        if not hmac.compare_digest(f["m"].encode(), want.encode()):
            return (
                f"a wrong job signature: the request was not signed with this job's {self.role} "
                "token, or for another server or request (docs/security.md)"
            )
        now = time.time()
        t = float(f["t"])
        if abs(now - t) > self.window_s:
            return (
                f"the request was signed {now - t:+.0f} s from this server's clock (at most "
                f"{self.window_s:.0f} s allowed): synchronise the nodes' clocks (NTP)"
            )
        if not self._fresh(f["n"], t, now):
            return "a replayed request: its nonce was seen before; sign every request anew"
        return None

    def authorize(self, handler: BaseHTTPRequestHandler) -> str | None:
        """None when ``handler``'s request is signed, fresh and new (remembered for
        :meth:`body_ok` and :meth:`answer_header`); else the one-line reason (the caller
        answers 401 and closes the connection, the body unread)."""
        header = handler.headers.get(AUTH_HEADER)
        addr = handler.server.server_address
        port = int(addr[1]) if isinstance(addr, tuple) else 0
        why = self.verify(handler.command, handler.path, port, header)
        handler.tg_auth = (self, _parse(header) if why is None else None)  # type: ignore[attr-defined]
        if why is not None:
            with self._lock:
                self.refused += 1
        return why

    @staticmethod
    def body_ok(handler: BaseHTTPRequestHandler, body: bytes) -> bool:
        """Whether the body read is the one the request's signature names (True for a server
        without authentication)."""
        auth = getattr(handler, "tg_auth", None)
        if auth is None or auth[1] is None:
            return auth is None  # a server without authentication; else a refused request
        digest = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA
        return hmac.compare_digest(digest.encode(), auth[1]["b"].encode())

    @staticmethod
    def answer_header(handler: BaseHTTPRequestHandler, status: int, body: bytes) -> dict[str, str]:
        """The header that signs an answer to ``handler``'s checked request (none otherwise)."""
        auth = getattr(handler, "tg_auth", None)
        if auth is None or auth[1] is None:
            return {}
        me, f = auth
        return {ANSWER_HEADER: me.sign_answer(f["n"], status, body)}

    def sign_answer(self, nonce: str, status: int, body: bytes) -> str:
        """The signature of an answer to the request with ``nonce``."""
        return _mac(self._token, "TG1 answer", nonce, str(status), hashlib.sha256(body).hexdigest())


def answer_message(raw: bytes) -> str:
    """The one-line message of an error answer (``{"error": {"message": ...}}``), else its
    first bytes."""
    try:
        msg = json.loads(raw)["error"]["message"]
        if isinstance(msg, str):
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    return raw[:200].decode(errors="replace")
