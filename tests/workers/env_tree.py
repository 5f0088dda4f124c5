"""Test worker: writes the environment the script sees and the one a Python it starts sees
(``$DUMP_DIR/tree_<rank>.json``), and its own initial environment (``/proc/self/environ``)."""

import json
import os
import subprocess
import sys


def main() -> None:
    rank = os.environ.get("RANK", "0")
    child = subprocess.run(
        [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
        capture_output=True,
        text=True,
        check=True,
    )
    with open("/proc/self/environ", "rb") as f:
        initial = dict(
            kv.decode(errors="replace").split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv
        )
    out = os.path.join(os.environ["DUMP_DIR"], f"tree_{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump(
            {"env": dict(os.environ), "child": json.loads(child.stdout), "initial": initial}, f
        )
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
