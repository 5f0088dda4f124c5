"""trainguard.integrations: trainguard for jobs written against a training framework.

One line in the user's script attaches trainguard to the framework's own loop:

    from trainguard.integrations.hf import TrainGuardCallback         # transformers / TRL
    trainer = Trainer(..., callbacks=[TrainGuardCallback()])

    from trainguard.integrations.lightning import TrainGuardCallback  # Lightning
    trainer = L.Trainer(..., callbacks=[TrainGuardCallback()])

Under ``trainguard run`` they are attached without that line (``[integrations] auto``).
Each integration imports its framework only when it is used: importing ``trainguard`` (or this
package) imports none of them. The adapters sit on the worker API (``trainguard.init()``,
``tg.step``, ``tg.log``, ``tg.checkpoint``); they add no API of their own.
"""

from __future__ import annotations

__all__: list[str] = []
