"""JSON encoding of the non-tensor parts of a checkpoint (state skeletons, RNG states).

trainguard's own metadata is JSON, never pickle: a memory-tier snapshot can arrive from a peer
node over the network, and unpickling it would run whatever code it names. Supported values:
None, bool, int, float (also nan/inf), str, bytes, list, tuple, dict (any hashable keys of these
types), numpy arrays and scalars, torch tensors (small ones, e.g. RNG states), and the staging
placeholder for a tensor. Anything else raises ``TypeError`` naming the path and the fix.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

__all__ = ["DTYPE_SIZES", "dtype_of", "dumps", "loads", "register_ref"]

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
"""The torch dtypes a checkpoint's metadata may name (bytes per element); a name read from a
file or a peer never reaches ``getattr(torch, ...)`` unless it is one of these."""


def dtype_of(name: str) -> Any:
    """The ``torch.dtype`` called ``name`` (``"float32"`` or ``"torch.float32"``);
    ``ValueError`` for a name outside :data:`DTYPE_SIZES`."""
    import torch

    key = name.removeprefix("torch.") if isinstance(name, str) else name
    if key not in DTYPE_SIZES:
        raise ValueError(f"dtype {name!r} is not allowed in checkpoint metadata")
    return getattr(torch, key)


_REF_TYPES: dict[str, tuple[type, Any, Any]] = {}


def register_ref(tag: str, cls: type, to_json: Any, from_json: Any) -> None:
    """Let a placeholder class (e.g. staging's tensor reference) round-trip as ``{"$tag": ...}``."""
    _REF_TYPES[tag] = (cls, to_json, from_json)


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _path_text(path: Any) -> str:
    """``a.b[2].c`` from the chain ``(((None, "a"), "b"), 2), "c")`` built while encoding."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).removeprefix(".")


def _enc(o: Any, path: Any) -> Any:
    if o is None or isinstance(o, bool | str | int):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else {"$float": repr(o)}
    if isinstance(o, bytes | bytearray):
        return {"$bytes": _b64(bytes(o))}
    if isinstance(o, list | tuple):
        if all(type(v) is int for v in o):  # e.g. Python's RNG state: 625 ints, every snapshot
            items = list(o)
        else:
            items = [_enc(v, (path, i)) for i, v in enumerate(o)]
        return items if isinstance(o, list) else {"$tuple": items}
    if isinstance(o, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in o):
            return {k: _enc(v, (path, k)) for k, v in o.items()}
        return {"$dict": [[_enc(k, path), _enc(v, (path, k))] for k, v in o.items()]}
    for tag, (cls, to_json, _) in _REF_TYPES.items():
        if isinstance(o, cls):
            return {f"${tag}": to_json(o)}
    mod = type(o).__module__
    if mod == "torch" or mod.startswith("torch."):
        import torch

        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous()
            return {
                "$tensor": {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "data": _b64(t.view(torch.uint8).numpy().tobytes() if t.numel() else b""),
                }
            }
        if isinstance(o, torch.dtype | torch.device | torch.Size):
            return {
                "$torch": [type(o).__name__, str(o) if not isinstance(o, torch.Size) else list(o)]
            }
    if mod == "numpy" or mod.startswith("numpy."):
        import numpy as np

        if isinstance(o, np.ndarray):
            a = np.ascontiguousarray(o)
            return {
                "$ndarray": {
                    "dtype": a.dtype.str,
                    "shape": list(a.shape),
                    "data": _b64(a.tobytes()),
                }
            }
        if isinstance(o, np.generic):
            return _enc(o.item(), path)
    raise TypeError(
        f"checkpoint state at {_path_text(path) or '<root>'} holds a {type(o).__qualname__}, which trainguard "
        "does not store as metadata: put tensors, numbers, strings, bytes, lists and dicts in "
        "the state (convert other objects with their own state_dict()/to_dict())"
    )


def _dec(o: Any) -> Any:
    if isinstance(o, list):
        return [_dec(v) for v in o]
    if not isinstance(o, dict):
        return o
    if len(o) == 1:
        ((key, val),) = o.items()
        if key == "$float":
            return float(val)
        if key == "$bytes":
            return base64.b64decode(val)
        if key == "$tuple":
            return tuple(_dec(v) for v in val)
        if key == "$dict":
            return {_dec(k): _dec(v) for k, v in val}
        if key == "$tensor":
            import torch

            dtype = dtype_of(val["dtype"])
            raw = bytearray(base64.b64decode(val["data"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return flat.view(dtype).reshape(val["shape"]).clone()
        if key == "$torch":
            import torch

            kind, v = val
            if kind == "Size":
                return torch.Size(v)
            if kind == "device":
                return torch.device(v)
            if kind == "dtype":
                return dtype_of(v)
            raise ValueError(f"unknown torch value {kind!r} in checkpoint metadata")
        if key == "$ndarray":
            import numpy as np

            return (
                np.frombuffer(base64.b64decode(val["data"]), dtype=np.dtype(val["dtype"]))
                .reshape(val["shape"])
                .copy()
            )
        if key.startswith("$") and key[1:] in _REF_TYPES:
            return _REF_TYPES[key[1:]][2](val)
    return {k: _dec(v) for k, v in o.items()}


def dumps(obj: Any) -> str:
    """Encode ``obj`` as a JSON string; ``TypeError`` for types that are not supported."""
    return json.dumps(_enc(obj, None), separators=(",", ":"), allow_nan=False)


def loads(text: str | bytes) -> Any:
    """Decode what :func:`dumps` wrote; never executes code."""
    return _dec(json.loads(text))
