"""Reward servers (``python -m trainguard.rl.reward``) as real processes on loopback and the
trainer's RewardClient: a killed server's requests go to another, both gone is an error after
the cap (never a made-up reward), bad input is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet_engines import LocalEngines
from tests.intruder import intrude, refusal
from trainguard.rl.reward import RewardClient, RewardError
from trainguard.testing.ports import free_port

FN = "trainguard.rl.tiny:digit_reward"


def test_reward_servers_fail_over_and_never_make_up_a_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_REWARD_TOKEN", raising=False)
    servers = LocalEngines(
        [free_port(), free_port()], run_dir=tmp_path, role="reward",
        module="trainguard.rl.reward", args=["--function", FN],
    )  # fmt: skip
    servers.start()
    try:
        servers.wait_serving(timeout=120)
        client = RewardClient(servers.urls, max_attempts=4, retry_wait_s=0.05, token=servers.token)
        prompts, texts = ["please write 7 3 now", "please write 2 0 now"], ["7 7 3", "2"]
        assert client.score(prompts, texts) == pytest.approx([2 / 3, 1.0])
        # another local process without the job's token, or signing with its own: 401, one line
        junk = tmp_path / "w.safetensors"
        for token, line in ((None, "no job signature: "), ("0" * 64, "a wrong job signature")):
            got = refusal(intrude(servers.ports[0], 0, junk, token))
            assert got.startswith(line) and "reward" in got
        unsigned = RewardClient(servers.urls, max_attempts=2, retry_wait_s=0.0)
        with pytest.raises(RewardError, match="refused this client's signature: no job sig") as e:
            unsigned.score(prompts, texts)
        assert "\n" not in str(e.value) and unsigned.failures["unauthorized"] == 2
        servers.kill(0, signal.SIGKILL)
        for _ in range(3):  # every other request goes to the dead one first
            assert client.score(prompts, texts) == pytest.approx([2 / 3, 1.0])
        assert client.failures["refused"] >= 1 and client.retries == client.failures["refused"]
        servers.kill(1, signal.SIGKILL)
        with pytest.raises(RewardError, match="no reward after 4 attempts"):
            client.score(prompts, texts)
    finally:
        servers.close()


@pytest.mark.parametrize(
    ("function", "words"),
    [("nope", "give MODULE:FUNCTION"), ("no_such_module:f", "cannot import it")],
)
def test_bad_reward_function_is_one_line_and_exit_2(function: str, words: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.reward", "--function", function, "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and words in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_reward_server_without_a_job_token_does_not_start() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD")}
    out = subprocess.run(
        [sys.executable, "-m", "trainguard.rl.reward", "--function", FN, "--port", "1"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2 and "no job token: TRAINGUARD_ROLE_TOKEN is unset" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
