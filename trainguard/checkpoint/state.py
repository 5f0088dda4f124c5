"""Turning a user's ``state`` mapping into a flat-able state dict and back.

``state`` maps names to: ``nn.Module`` (through ``get_model_state_dict``, so DDP/FSDP2/DTensor
models give FQN-keyed, reshardable state), ``torch.optim.Optimizer`` (``get_optimizer_state_dict``
against the one module in ``state``), objects with ``state_dict``/``load_state_dict`` (data
loaders, schedulers), and plain values (dicts, tensors, numbers), which are restored in place.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from trainguard.checkpoint import jsoncodec

__all__ = ["apply_state", "build_state_dict", "optimizer_tensor_ptrs", "rng_key", "rng_state"]


def _model_of(state: Mapping[str, Any]) -> nn.Module | None:
    models = [v for v in state.values() if isinstance(v, nn.Module)]
    if len(models) > 1:
        raise ValueError(
            "checkpoint state holds several nn.Modules next to an optimizer: wrap them in one "
            "nn.ModuleDict so optimizer state can be keyed by parameter name"
        )
    return models[0] if models else None


class _Infos:
    """torch's per-call option checks for ``get_model_state_dict`` and
    ``get_optimizer_state_dict`` (``_verify_options``: a walk over every parameter building
    name maps, most of a small model's snapshot time), kept while the model's and optimizers'
    parameters are the same objects. The memory tier snapshots every step; torch's public
    functions do exactly this check and call, so where its private helpers are not there
    (another torch), the public ones are used."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], tuple[tuple[int, ...], Any]] = {}
        try:
            from torch.distributed.checkpoint import state_dict as dsd

            self._dsd: Any = dsd
            for name in ("_verify_options", "_get_model_state_dict", "_get_optim_state_dict"):
                getattr(dsd, name)
        except (ImportError, AttributeError):
            self._dsd = None

    def _info(self, model: nn.Module, optims: tuple[Any, ...]) -> Any:
        key = (id(model), *map(id, optims))
        sig = tuple(id(p) for p in model.parameters()) + tuple(
            id(p) for o in optims for g in o.param_groups for p in g["params"]
        )
        hit = self._cache.get(key)
        if hit is not None and hit[0] == sig:
            return hit[1]
        info = self._dsd._verify_options(
            model, optims, optim_only=bool(optims), submodules=None, options=None
        )
        if len(self._cache) > 8:
            self._cache.clear()
        self._cache[key] = (sig, info)
        return info

    def model(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self._dsd is None:
            return get_model_state_dict(model)
        with self._dsd._gc_context():
            return self._dsd._get_model_state_dict(model, self._info(model, ()))

    def optimizer(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self._dsd is None:
            return get_optimizer_state_dict(model, opt)
        with self._dsd._gc_context():
            return self._dsd._get_optim_state_dict(model, (opt,), self._info(model, (opt,)))


_INFOS = _Infos()


def build_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    model = (
        _model_of(state)
        if any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        else None
    )
    out: dict[str, Any] = {}
    for key, v in state.items():
        if isinstance(v, nn.Module):
            out[key] = _INFOS.model(v)
        elif isinstance(v, torch.optim.Optimizer):
            if model is None:
                raise ValueError(f"state[{key!r}] is an optimizer but state holds no nn.Module")
            out[key] = _INFOS.optimizer(model, v)
        elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
            out[key] = v.state_dict()
        else:
            out[key] = v
    return out


def optimizer_tensor_ptrs(state: Mapping[str, Any]) -> set[int]:
    """Storage pointers that change only inside ``optimizer.step()``: parameters and
    optimizer state. Everything else is copied synchronously at save time."""
    ptrs: set[int] = set()
    for v in state.values():
        if isinstance(v, nn.Module):
            for p in v.parameters():
                t = p.to_local() if hasattr(p, "to_local") else p
                ptrs.add(t.untyped_storage().data_ptr())
        elif isinstance(v, torch.optim.Optimizer):
            for s in v.state.values():
                for t in s.values():
                    if isinstance(t, torch.Tensor):
                        t = t.to_local() if hasattr(t, "to_local") else t
                        ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def apply_state(state: MutableMapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Load ``loaded`` (as built by :func:`build_state_dict`) back into the live objects."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = (
        _model_of(state)
        if any(isinstance(v, torch.optim.Optimizer) for v in state.values())
        else None
    )
    for key, v in state.items():
        if key not in loaded:
            continue
        new = loaded[key]
        if isinstance(v, nn.Module):
            if not _aliases(get_model_state_dict(v), new):
                set_model_state_dict(v, new)
        elif isinstance(v, torch.optim.Optimizer):
            assert model is not None
            set_optimizer_state_dict(model, v, new)
        elif hasattr(v, "state_dict") and hasattr(v, "load_state_dict"):
            v.load_state_dict(new)
        elif isinstance(v, torch.Tensor):
            if v.data_ptr() != new.data_ptr():
                v.copy_(new)
        elif isinstance(v, MutableMapping):
            _update_in_place(v, new)
        else:
            state[key] = new


def _aliases(cur: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """True if ``new`` holds exactly the live tensors of ``cur`` (restored in place already)."""
    if cur.keys() != new.keys():
        return False
    return all(
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and type(a) is torch.Tensor
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        for a, b in ((cur[k], new[k]) for k in cur)
    )


def _update_in_place(dst: MutableMapping[str, Any], src: Mapping[str, Any]) -> None:
    for k, new in src.items():
        cur = dst.get(k)
        if isinstance(cur, torch.Tensor) and isinstance(new, torch.Tensor):
            if cur.data_ptr() != new.data_ptr():
                cur.copy_(new)
        elif isinstance(cur, MutableMapping) and isinstance(new, Mapping):
            _update_in_place(cur, new)
        else:
            dst[k] = new


def rng_key(rank: int) -> str:
    return f"_trainguard_rng_rank{rank}"


class _RngCache:
    """The JSON of the Python, NumPy and torch CPU generator states last encoded: many
    training loops do not draw from them between snapshots, and the memory tier snapshots
    every step."""

    python: tuple[Any, str] | None = None
    numpy: tuple[Any, str] | None = None
    torch: tuple[Any, str] | None = None


def _encoded(kind: str, state: Any, same: Any) -> str:
    hit = getattr(_RngCache, kind)
    if hit is not None and same(hit[0], state):
        return hit[1]
    text = jsoncodec.dumps(state)
    setattr(_RngCache, kind, (state, text))
    return text


def _same_numpy(a: Any, b: Any) -> bool:
    import numpy as np

    return a[0] == b[0] and a[2:] == b[2:] and np.array_equal(a[1], b[1])


def rng_state() -> bytes:
    """Every generator's state as JSON bytes (what :func:`set_rng_state` restores)."""
    parts = [
        ("python", _encoded("python", random.getstate(), lambda a, b: a == b)),
        ("torch", _encoded("torch", torch.get_rng_state(), torch.equal)),
    ]
    try:
        import numpy as np

        parts.append(("numpy", _encoded("numpy", np.random.get_state(), _same_numpy)))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(("cuda", jsoncodec.dumps(torch.cuda.get_rng_state_all())))
    return ("{" + ",".join(f'"{k}":{v}' for k, v in parts) + "}").encode()


def set_rng_state(blob: Any) -> None:
    if isinstance(blob, torch.Tensor):  # never expected; DCP returns bytes objects as-is
        return
    st = jsoncodec.loads(bytes(blob)) if isinstance(blob, bytes | bytearray) else blob
    random.setstate(st["python"])
    torch.set_rng_state(st["torch"])
    if "numpy" in st:
        import numpy as np

        np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
