"""Trainer worker of the role tests (torch-free: it starts in milliseconds).

Each step it asks every engine in $TRAINGUARD_ROLLOUT_URLS who it is (``/whoami``) and appends
one JSON line to $OUT_DIR/rank_<rank>.jsonl: its pid, restart count, and what each engine
answered (pid or the error). It runs until $OUT_DIR/stop exists, then exits 0.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request


def main() -> None:
    out = os.environ["OUT_DIR"]
    rank = int(os.environ["RANK"])
    urls = [u for u in os.environ.get("TRAINGUARD_ROLLOUT_URLS", "").split(",") if u]
    path = os.path.join(out, f"rank_{rank}.jsonl")
    step = 0
    while not os.path.exists(os.path.join(out, "stop")):
        engines = []
        for url in urls:
            try:
                with urllib.request.urlopen(url + "/whoami", timeout=1.0) as r:
                    engines.append(json.loads(r.read())["pid"])
            except Exception as e:  # noqa: BLE001 - recorded, not raised
                engines.append(type(e).__name__)
        rec = {
            "step": step,
            "pid": os.getpid(),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "urls": urls,
            "engines": engines,
            "role_env": os.environ.get("TRAINGUARD_AGENT_ROLE"),
        }
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        step += 1
        time.sleep(0.2)


if __name__ == "__main__":
    main()
