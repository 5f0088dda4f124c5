"""Reward servers (``python -m trainguard.rl.reward``) as real processes on loopback and the
trainer's RewardClient: a killed server's requests go to another, both gone is an error after
the cap (never a made-up reward), bad input is one line."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet_engines import LocalEngines
from tests.ports import free_port
from trainguard.rl.reward import RewardClient, RewardError

FN = "trainguard.rl.tiny:digit_reward"


def test_reward_servers_fail_over_and_never_make_up_a_reward(tmp_path: Path) -> None:
    servers = LocalEngines(
        [free_port(), free_port()], run_dir=tmp_path, role="reward",
        module="trainguard.rl.reward", args=["--function", FN],
    )  # fmt: skip
    servers.start()
    try:
        servers.wait_serving(timeout=120)
        client = RewardClient(servers.urls, max_attempts=4, retry_wait_s=0.05)
        prompts, texts = ["please write 7 3 now", "please write 2 0 now"], ["7 7 3", "2"]
        assert client.score(prompts, texts) == pytest.approx([2 / 3, 1.0])
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
