"""SGLang's side of the engine contract's mapping (docs/rl.md "SGLang"), on a GPU machine with
SGLang installed: its server on the tiny Llama (built here, nothing downloaded), then each call
an adapter would make, checked.

    python bench/sglang_check.py        # run by bench/gpu_checks.sh where `import sglang` works

1. ``GET /health`` and ``GET /health_generate`` (one real generation): readiness;
2. ``POST /v1/completions`` with ``logprobs`` and a ``seed``: token ids and log-probs, and the
   same seed gives the same tokens;
3. a refit of version 1 written as a Hugging Face checkpoint directory: ``/pause_generation``,
   ``/update_weights_from_disk``, ``/update_weight_version``, ``/continue_generation``; the
   log-probs after it are version 1's (the trainer's own, to 1e-2 in bfloat16) and
   ``GET /model_info`` reports the version.

Ends with one JSON line: each check's outcome and the refit's seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainguard.rl.engines.launch import call, teacher_logprobs, tiny_model_dir  # noqa: E402
from trainguard.rl.tiny import load_model  # noqa: E402
from trainguard.testing.ports import free_port  # noqa: E402

PROMPT = "please write 3 4 now"


def main() -> int:
    import torch

    root = Path(tempfile.mkdtemp(prefix="sglang-check-"))
    base = tiny_model_dir(root)
    model, tok = load_model(str(base))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.3 * torch.randn(prm.shape, generator=g))
    v1 = root / "v00000001"
    model.save_pretrained(v1)
    tok.save_pretrained(v1)
    port = free_port()
    log = (root / "sglang.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(base), "--host",
         "127.0.0.1", "--port", str(port), "--weight-version", "0", "--mem-fraction-static",
         "0.3"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    out: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 600:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang exited {proc.returncode}; see {root}/sglang.log")
            try:
                if call(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        out["ready_s"] = round(time.monotonic() - t0, 1)
        out["health_generate"] = call(port, "GET", "/health_generate")[0] == 200
        body = {"model": str(base), "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
                "seed": 7, "logprobs": 0}  # fmt: skip
        a = call(port, "POST", "/v1/completions", body)[1]
        b = call(port, "POST", "/v1/completions", body)[1]
        ca, cb = a["choices"][0], b["choices"][0]
        out["completion_logprobs"] = len(ca["logprobs"]["token_logprobs"]) > 0
        out["seed_repeats"] = ca["text"] == cb["text"]
        t1 = time.monotonic()
        steps = [
            call(port, "POST", "/pause_generation", {})[0],
            call(port, "POST", "/update_weights_from_disk", {"model_path": str(v1)})[0],
            call(port, "POST", "/update_weight_version", {"new_version": "1"})[0],
            call(port, "POST", "/continue_generation", {})[0],
        ]
        out["refit_s"] = round(time.monotonic() - t1, 3)
        out["refit_calls_ok"] = steps == [200, 200, 200, 200]
        out["refit_statuses"] = steps
        info = call(port, "GET", "/model_info")[1]
        out["weight_version"] = info.get("weight_version") if isinstance(info, dict) else None
        greedy = {**body, "temperature": 0.0}
        c = call(port, "POST", "/v1/completions", greedy)[1]["choices"][0]
        got = c["logprobs"]["token_logprobs"]
        ids = [tok.convert_tokens_to_ids(t) for t in c["logprobs"]["tokens"]]
        ref = teacher_logprobs(model, tok, PROMPT, ids)
        out["refit_logprobs_max_diff"] = max(abs(x - y) for x, y in zip(ref, got, strict=False))
        out["refit_verified"] = out["refit_logprobs_max_diff"] < 1e-2
    except Exception as e:  # one line in the JSON, the log beside it
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    print(json.dumps(out), flush=True)
    return 0 if out.get("refit_verified") else 1


if __name__ == "__main__":
    sys.exit(main())
