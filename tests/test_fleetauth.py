"""The rollout fleet's job secret and request signatures (trainguard.core.fleetauth), as units;
the real servers and clients are checked in tests/test_rl_fleet.py, test_rl_reward.py and the
conformance suite."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from trainguard.core.fleetauth import (
    AUTH_HEADER,
    Authenticator,
    answer_ok,
    job_secret,
    replica_token,
    role_token,
    secret_path,
    sign,
)


def test_the_job_secret_is_made_once_private_and_unsafe_files_are_refused(tmp_path: Path) -> None:
    a = job_secret(tmp_path)
    assert job_secret(tmp_path) == a and len(a) == 64
    path = secret_path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret"]  # no temporary file left
    tokens = {role_token(a, r) for r in ("rollout", "reward", "fleet")}
    assert len(tokens) == 3 and not any(a.decode() in t for t in tokens)
    path.chmod(0o640)
    with pytest.raises(ValueError, match=r"readable by group or others \(mode 640\); delete it"):
        job_secret(tmp_path)
    path.unlink()
    other = tmp_path / "elsewhere"
    other.write_text("x" * 64)
    other.chmod(0o600)
    path.symlink_to(other)  # a link planted at the secret's name is never followed
    with pytest.raises(ValueError, match="cannot open it"):
        job_secret(tmp_path)


def test_a_replica_without_its_roles_token_is_one_line_naming_the_variable_and_the_fix() -> None:
    """The check every replica (the engine, the vLLM adapter, the reward server) runs at start."""
    token = "t" * 64
    assert replica_token("the engine", {"TRAINGUARD_AGENT_ROLE_TOKEN": f" {token}\n"}) == token
    for env in ({}, {"TRAINGUARD_AGENT_ROLE_TOKEN": "short"}, {"TRAINGUARD_AGENT_ROLE_TOKEN": " "}):
        with pytest.raises(ValueError) as e:
            replica_token("the adapter", env)
        msg = str(e.value)
        assert msg.startswith("no job token: TRAINGUARD_AGENT_ROLE_TOKEN is unset or too short")
        assert "run the adapter as a role of `trainguard run`" in msg and "\n" not in msg


def test_a_signature_is_good_once_for_its_request_port_and_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = "k" * 64
    auth = Authenticator("rollout", token)
    sig = sign(token, "POST", "/v1/completions", 8100, b'{"prompt": "x"}')
    header = sig[AUTH_HEADER]
    assert auth.verify("POST", "/v1/completions", 8100, header) is None
    assert auth.verify("POST", "/v1/completions", 8100, header).startswith("a replayed request")
    fresh = sign(token, "POST", "/v1/completions", 8100)[AUTH_HEADER]
    for method, path, port in (("GET", "/v1/completions", 8100), ("POST", "/health", 8100),
                               ("POST", "/v1/completions", 8101)):  # fmt: skip
        assert auth.verify(method, path, port, fresh).startswith("a wrong job signature")
    assert auth.verify("POST", "/v1/completions", 8100, None).startswith("no job signature")
    assert auth.verify("POST", "/v1/completions", 8100, "Bearer " + token).startswith("no job")
    other = sign("o" * 64, "POST", "/v1/completions", 8100)[AUTH_HEADER]
    assert auth.verify("POST", "/v1/completions", 8100, other).startswith("a wrong job signature")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - 300)
    old = sign(token, "GET", "/health", 8100)[AUTH_HEADER]
    monkeypatch.setattr(time, "time", lambda: now)
    assert "synchronise the nodes' clocks (NTP)" in auth.verify("GET", "/health", 8100, old)
    assert auth.refused == 0  # counted where a server refuses a request (authorize)
    # the answer: signed for that request's nonce, status and body only
    answer = auth.sign_answer(sig.nonce, 200, b"{}")
    assert answer_ok(token, sig, 200, b"{}", answer)
    assert not answer_ok(token, sig, 200, b"{ }", answer)
    assert not answer_ok(token, sig, 500, b"{}", answer)
    assert not answer_ok(token, sig, 200, b"{}", None)
    assert sign(None, "GET", "/health", 8100) == {} and answer_ok(None, sig, 200, b"", None)
