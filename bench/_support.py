"""What the benchmarks need around the product's code: their processes' environment. Ports,
services (etcd, PostgreSQL) and harnesses the test suite shares are in
:mod:`trainguard.testing`; process trees and faults are trainguard's own
(:mod:`trainguard.chaos`).

A launched job's environment is this one without trainguard's and torchrun's variables.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def base_env(**extra: str) -> dict[str, str]:
    """This environment without trainguard's, torchrun's and the agent's variables, this
    checkout on ``PYTHONPATH``, plus ``extra``."""
    from trainguard.core.contracts import envvars

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PET_", "TORCHELASTIC_", envvars.NAMESPACE))
    }
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env
