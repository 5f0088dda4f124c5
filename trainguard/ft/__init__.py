"""torchft mode: replica groups that survive the loss of a peer group without a restart.

``trainguard run --ft`` (or ``[ft] enabled = true``) finds or starts a torchft lighthouse and
runs its workers as one replica group; ``tg.ft_wrap(model, optimizer)`` in the worker builds
``torchft.Manager`` and its DDP/optimizer wrappers (:mod:`trainguard.ft.worker`)."""

from __future__ import annotations

from typing import Any

from trainguard.ft.lighthouse import FTUnavailable, Lighthouse, ensure_lighthouse, torchft_error

__all__ = ["FTUnavailable", "Lighthouse", "ensure_lighthouse", "torchft_error", "wrap"]


def wrap(*args: Any, **kwargs: Any) -> Any:
    """:func:`trainguard.ft.worker.wrap` (imports torch and torchft on first use)."""
    from trainguard.ft.worker import wrap as _wrap

    return _wrap(*args, **kwargs)
