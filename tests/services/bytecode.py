"""Compile, once, the bytecode of the third-party modules that the suite, the demo and the docs
build import (``make`` runs it after a fresh install that compiled nothing).

The venv holds 1.5 GB of packages; compiling all of them costs about 78 CPU seconds, most of it
for modules nothing here imports. The large packages are compiled by importing what is used
of them, the small ones whole. A module left out is compiled by each process that imports it
where ``PYTHONDONTWRITEBYTECODE`` is set (as the suite's processes may run), so the lists
follow what the suite imports: a process's uncompiled modules are listed by ``--missing``.
"""

from __future__ import annotations

import compileall
import importlib
import importlib.util
import os
import sys

IMPORTED = [
    "torch", "torch._dynamo", "torch._inductor", "torch.distributed.run",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "torch.profiler",
    "torch.profiler._cupti_monitor", "torch.utils.serialization",
    "transformers.trainer", "transformers.models.gpt2.modeling_gpt2",
    "transformers.tokenization_utils_fast", "trl.trainer.grpo_trainer", "lightning.pytorch",
    "lightning.pytorch.callbacks", "datasets", "torchft.ddp", "torchft.optim",
    "mkdocs.commands.build",
]  # fmt: skip
"""Large packages: what the suite uses of them, compiled by importing it."""

WHOLE = [
    "_pytest", "pytest", "pluggy", "xdist", "execnet", "pytest_timeout", "grimp", "importlinter",
    "grafana_foundation_sdk", "grafana_client", "opentelemetry", "google.protobuf", "grpc",
    "prometheus_client", "psycopg", "etcd3gw", "platformdirs", "pynvml", "psutil", "yaml",
    "rich", "requests", "urllib3", "certifi", "iniconfig", "pygments", "_distutils_hack",
    "google.rpc",
]  # fmt: skip
"""Small packages, compiled whole."""


def _dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    return spec.origin


def missing() -> list[str]:
    """The modules this process imported whose bytecode is not cached."""
    out = []
    for name, mod in sorted(sys.modules.items()):
        src, cached = getattr(mod, "__file__", None), getattr(mod, "__cached__", None)
        if isinstance(src, str) and src.endswith(".py") and isinstance(cached, str) \
                and not os.path.exists(cached):  # fmt: skip
            out.append(name)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--missing"]:  # run the given modules' imports, list what was not cached
        sys.dont_write_bytecode = True
        for name in argv[1:]:
            importlib.import_module(name)
        print("\n".join(missing()))
        return 0
    sys.dont_write_bytecode = False
    for name in IMPORTED:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - an import that fails is met by its test
            print(f"bytecode: importing {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
    site = _dir("pytest")  # the top-level modules beside the packages (an editable finder)
    if site is not None:
        compileall.compile_dir(os.path.dirname(site), maxlevels=0, quiet=2, workers=0)
    for name in WHOLE:
        path = _dir(name)
        if path is None:
            continue
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2, workers=0)
        else:
            compileall.compile_file(path, quiet=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
