"""The assertion message of a launched job's log keeps the cause of the error it ended with."""

from __future__ import annotations

import traceback
from pathlib import Path

from tests.launch_utils import log_excerpt


class Wrapped(Exception):
    pass


def _deep(n: int) -> None:
    if n:
        _deeper(n - 1)  # two functions in turn: no frame is folded as a repetition
    raise Wrapped("The connection to the C10d store has failed. See inner exception.")


def _deeper(n: int) -> None:
    _deep(n)


def test_the_excerpt_keeps_a_wrapped_errors_cause_that_the_tail_cuts_off(tmp_path: Path) -> None:
    try:
        try:
            raise RuntimeError("wait timeout after 60000ms, keys: /torch.rendezvous.x")
        except RuntimeError as e:
            try:
                _deep(60)  # a deep outer traceback, as torch's agent has
            except Wrapped as w:
                raise w from e
    except Wrapped:
        chain = traceback.format_exc()
    log = tmp_path / "a.log"
    noise = "".join(f"step {i} done\n" for i in range(500))
    log.write_text(
        f"{noise}[W1207 TCPStore.cpp:120] recvVector failed on SocketImpl(fd=12)\n{chain}"
    )
    text = log.read_text()
    assert "wait timeout after 60000ms" not in text[-4000:]  # what the test printed before

    got = log_excerpt(log)
    assert "RuntimeError: wait timeout after 60000ms" in got  # the cause
    assert got.rstrip().endswith("See inner exception.")  # and the error itself
    assert "recvVector failed" in got and "step 499" not in got
    assert len(got) < 9000


def test_a_log_without_a_traceback_is_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    log.write_text("x" * 10 + "y" * 100)
    assert log_excerpt(log, limit=50) == "y" * 50
    assert "no such" in log_excerpt(tmp_path / "missing.log").lower()
