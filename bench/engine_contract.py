"""What the engine contract's guards cost, and what the request cap saves.

1. Parsing: ``json.loads`` alone vs the contract's guarded :func:`parse_completion` (types,
   ranges, token ids within the vocabulary, finite log-probs) on completion answers of the
   fleet bench's size (4 prompts × 8 samples × 32 tokens, with log-probs) and of the engine's
   largest (256 sequences × 256 tokens), alternating, median of ``--runs`` runs of
   ``--reps`` parses each, in CPU time (what a parse costs the trainer's process, steady
   on a loaded machine).
2. The request cap: a real reward server (``python -m trainguard.rl.reward``) sent a
   ``Content-Length`` of 256 MiB and as much of the body as it reads; its RSS before and after
   and the answer's status.

    python bench/engine_contract.py [--runs 7 --reps 30]

Prints one JSON line: parse_overhead_fleet (guarded/plain - 1), parse_overhead_large,
the medians in ms, reward_rss_growth_mib, body_sent_mib, answer_status.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainguard.core.contracts.engine import parse_completion

REPO = Path(__file__).resolve().parents[1]


def answer(seqs: int, tokens: int, vocab: int) -> bytes:
    rng = random.Random(0)
    choices = [
        {
            "index": i,
            "text": " ".join("w" for _ in range(tokens)),
            "token_ids": [rng.randrange(vocab) for _ in range(tokens)],
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["w"] * tokens,
                "token_logprobs": [-rng.random() * 5 for _ in range(tokens)],
            },
        }
        for i in range(seqs)
    ]
    return json.dumps({"choices": choices, "weight_version": 7}).encode()


def parse_cost(raw: bytes, seqs: int, vocab: int, runs: int, reps: int) -> tuple[float, float]:
    plain, guarded = [], []
    for _ in range(runs):  # alternating, so that load on the machine hits both alike
        t = time.process_time()
        for _ in range(reps):
            json.loads(raw)
        plain.append((time.process_time() - t) / reps)
        t = time.process_time()
        for _ in range(reps):
            parse_completion(raw, expected=seqs, vocab_size=vocab)
        guarded.append((time.process_time() - t) / reps)
    return statistics.median(plain), statistics.median(guarded)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def body_cap(port: int) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard.rl.reward", "--port", str(port),
         "--function", "trainguard.rl.tiny:digit_reward"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        before = rss_kib(proc.pid)
        total, sent, chunk = 256 << 20, 0, b" " * (1 << 20)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /v1/rewards HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {total}\r\n\r\n".encode()
            )
            try:
                while sent < total:
                    s.sendall(chunk)
                    sent += len(chunk)
            except OSError:  # the server stopped reading and closed
                pass
            time.sleep(0.5)
            after = rss_kib(proc.pid)
            try:
                head = s.recv(64)
            except OSError:
                head = b""
        status = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0
        return {
            "reward_rss_growth_mib": round((after - before) / 1024, 1),
            "body_sent_mib": sent >> 20,
            "answer_status": status,
        }
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--port", type=int, default=29641)
    a = p.parse_args()
    out: dict[str, float] = {}
    for name, seqs, tokens in (("fleet", 32, 32), ("large", 256, 256)):
        raw = answer(seqs, tokens, 50257)
        plain, guarded = parse_cost(raw, seqs, 50257, a.runs, max(1, a.reps // (seqs // 32)))
        out[f"parse_plain_ms_{name}"] = round(plain * 1e3, 3)
        out[f"parse_guarded_ms_{name}"] = round(guarded * 1e3, 3)
        out[f"parse_overhead_{name}"] = round(guarded / plain - 1, 3)
        print(
            f"{name}: {len(raw) >> 10} KiB answer, json.loads {plain * 1e3:.2f} CPU ms, "
            f"parse_completion {guarded * 1e3:.2f} CPU ms ({guarded / plain:.2f}x)",
            file=sys.stderr,
        )
    out.update(body_cap(a.port))
    print(f"reward server, 256 MiB announced: {out}", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
