"""trainguard's worker start-up hook, loaded through ``PYTHONPATH`` (see
:mod:`trainguard.runtime.workerhook`, which does all the work; this file only calls it, so
import-linter's contracts see every import the hook makes)."""

try:
    from trainguard.runtime.workerhook import main as _main
except ImportError as _err:  # an interpreter without trainguard: leave no trace, run the script
    import os as _os
    import sys as _sys

    if "TRAINGUARD_ZYGOTE_FD" in _os.environ:  # envvars.ZYGOTE_FD: a warm start cannot work
        _os._exit(111)
    _here = _os.path.dirname(_os.path.abspath(__file__))
    _kept = [
        p for p in _os.environ.get("PYTHONPATH", "").split(_os.pathsep)
        if p and _os.path.abspath(p) != _here
    ]  # fmt: skip
    if _kept:
        _os.environ["PYTHONPATH"] = _os.pathsep.join(_kept)
    else:
        _os.environ.pop("PYTHONPATH", None)
    print(f"trainguard: worker start-up hook not run ({_err})", file=_sys.stderr)
else:
    _main()
