"""trainguard's framework hook (loaded through PYTHONPATH in ``trainguard run``'s workers when
``[integrations] auto`` is on): installs :mod:`trainguard.integrations.auto`, which imports no
framework, then runs the ``sitecustomize`` it shadowed, as ``site`` would have."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_user_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # site's own wording
        print(
            f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(err).__name__}: {err}",
            file=sys.stderr,
        )


def _leave_pythonpath() -> None:
    """Take this directory off ``sys.path`` and off the ``PYTHONPATH`` the script sees (and its
    own children inherit): the worker's environment stays exactly the launcher's."""
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    kept = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and os.path.abspath(p) != _HERE
    ]
    if kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        os.environ.pop("PYTHONPATH", None)


def _main() -> None:
    _leave_pythonpath()
    try:
        from trainguard.integrations.auto import install

        install()
    except Exception as err:
        print(f"trainguard: framework integrations not installed ({err})", file=sys.stderr)
    _chain_user_sitecustomize()


_main()
