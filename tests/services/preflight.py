"""What the suite runs outside Python, checked once before the first test.

``make test`` installs these (its ``TEST_DEBS`` list and the rotel venv). A machine where one
is missing gets one line naming each missing tool and the Debian package that has it, instead
of a failure deep inside whichever test first runs it. The table names binaries, not packages,
so that a package dropped from the install list is caught here.
"""

from __future__ import annotations

import os
import shutil

# binary -> the Debian package that ships it
BINARIES: dict[str, str] = {
    "etcd": "etcd-server",
    "etcdctl": "etcd-client",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "amtool": "prometheus-alertmanager",
    "chromium": "chromium",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sbatch": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "munged": "munge",
    "ip": "iproute2",
}
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")  # daemons, not always on a user's PATH


def _found(binary: str) -> bool:
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *_SBIN])
    return shutil.which(binary, path=path) is not None


def missing() -> list[str]:
    """``binary (Debian package)`` for every tool the suite needs that is not installed."""
    out = [f"{b} (Debian {pkg})" for b, pkg in BINARIES.items() if not _found(b)]
    from tests.services.telemetry_services import rotel_installed

    if not rotel_installed():
        out.append("rotel (PyPI, installed by make test into the test cache)")
    return out


def message(absent: list[str]) -> str:
    return (
        f"not installed: {', '.join(absent)}; `make test` installs them "
        "(its TEST_DEBS list in the Makefile and the rotel venv)"
    )
