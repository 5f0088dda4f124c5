"""Another local process that reaches a fleet server's port without the job's token (or signs
with a token of its own) and tries everything: health, versions, completions, a weight update
naming its own file or a missing one (a file-existence oracle), rewards, a body of 256 MiB
announced.

    python tests/workers/fleet_intruder.py PORT --version V --file F [--token T]

Prints one JSON list: ``{"request", "status", "body"}`` per attempt (``status`` None when the
server did not answer in 10 s).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket

from trainguard.core.fleetauth import sign


def _ask(port: int, method: str, path: str, body: object, token: str | None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **sign(token, method, path, port, data)}
    try:
        conn.request(method, path, data, headers)
        resp = conn.getresponse()
        return {"request": f"{method} {path}", "status": resp.status, "body": resp.read().decode()}
    except (OSError, http.client.HTTPException) as e:
        return {"request": f"{method} {path}", "status": None, "body": repr(e)}
    finally:
        conn.close()


def _huge(port: int, token: str | None) -> dict:
    """A request that announces 256 MiB and sends 2 bytes: answered at once, or never."""
    sig = sign(token, "POST", "/v1/completions", port, b"{}")
    auth = "".join(f"{k}: {v}\r\n" for k, v in sig.items())
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {256 << 20}\r\n\r\n{{}}"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode())
        chunks = []
        try:
            while chunk := s.recv(65536):  # until the server closes the connection
                chunks.append(chunk)
        except TimeoutError:
            return {"request": "POST /v1/completions (256 MiB)", "status": None, "body": ""}
        except ConnectionResetError:
            pass
        raw = b"".join(chunks).decode(errors="replace")
    status = int(raw.split(" ", 2)[1]) if raw.startswith("HTTP/") else None
    body = raw.split("\r\n\r\n", 1)[-1]
    return {"request": "POST /v1/completions (256 MiB)", "status": status, "body": body}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--file", required=True, help="an existing safetensors file of the intruder")
    p.add_argument("--token", default=None)
    a = p.parse_args()
    out = [
        _ask(a.port, "GET", "/health", None, a.token),
        _ask(a.port, "GET", "/v1/weights", None, a.token),
        _ask(a.port, "GET", "/v1/models", None, a.token),
        _ask(a.port, "POST", "/v1/completions", {"prompt": "write 7", "logprobs": 1}, a.token),
        _ask(a.port, "POST", "/v1/weights/update", {"version": a.version, "path": a.file}, a.token),
        _ask(
            a.port,
            "POST",
            "/v1/weights/update",
            {"version": a.version, "path": a.file + ".missing"},
            a.token,
        ),
        _ask(a.port, "POST", "/v1/rewards", {"prompts": ["p"], "completions": ["c"]}, a.token),
        _huge(a.port, a.token),
    ]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
