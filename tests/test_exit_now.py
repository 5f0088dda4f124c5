"""``trainguard.core.procs.exit_now``: the code, the atexit handlers and the output survive the
skipped interpreter teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, logging, sys, threading, time
from trainguard.core.procs import exit_now

marker = sys.argv[1]
atexit.register(lambda: open(marker, "w").write("ran"))
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
sys.stdout.write("unflushed stdout")  # no newline, no flush
logging.getLogger("x").info("a log line")
# a non-daemon thread would hold a normal exit forever; exit_now does not wait for it
threading.Thread(target=time.sleep, args=(600,)).start()
exit_now(75)
"""


def test_exit_now_keeps_the_code_the_atexit_handlers_and_the_output(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 75, p.stderr
    assert p.stdout == "unflushed stdout"
    assert "a log line" in p.stderr and "Traceback" not in p.stderr
    assert marker.read_text() == "ran"
