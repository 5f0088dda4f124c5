"""torch's private internals: each one trainguard uses exists on the installed torch, and only
``trainguard/runtime/_torch.py`` and ``trainguard/core/_torch.py`` name them."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from trainguard.core import _torch as core_torch
from trainguard.runtime import _torch as runtime_torch

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"
ALLOWED = {PACKAGE / "runtime" / "_torch.py", PACKAGE / "core" / "_torch.py"}
PRIVATES = runtime_torch.PRIVATES + core_torch.PRIVATES
PRIVATE_NAMES = {name for _, _, name in PRIVATES if name.startswith("_")}


def missing(module: str, owner: str, name: str) -> str | None:
    """Why ``name`` is not on ``module[.owner]`` of the installed torch, or None if it is."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        return f"module {module} does not import: {e}"
    if not owner:
        return None if hasattr(mod, name) else f"{module}.{name}"
    cls = getattr(mod, owner, None)
    if cls is None:
        return f"{module}.{owner}"
    if hasattr(cls, name):
        return None
    # an instance attribute: some class of the MRO assigns it in its source
    for klass in inspect.getmro(cls):
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in src or f"self.{name}:" in src:
            return None
    return f"{module}.{owner}.{name}"


def test_every_torch_private_used_exists() -> None:
    gone = [m for m in (missing(*p) for p in PRIVATES) if m is not None]
    assert not gone, (
        "torch privates trainguard uses are missing on this torch "
        f"({importlib.import_module('torch').__version__}): {gone}; adapt "
        "trainguard/runtime/_torch.py (or core/_torch.py), the only modules that use them"
    )


def test_missing_private_is_named() -> None:
    """The check above reports the exact missing name (it is not a check that cannot fail)."""
    assert missing("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "", "_NoSuch") == (
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous._NoSuch"
    )
    assert (
        missing("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_nope")
        == "torch.distributed.elastic.agent.server.api.SimpleElasticAgent._nope"
    )
    assert (
        missing("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent", "_worker_group")
        is None
    )


def _torch_names(tree: ast.AST) -> set[str]:
    """Names a module binds to something imported from torch."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            out |= {a.asname or a.name for a in node.names}
    return out


def violations(path: Path) -> list[str]:
    src = path.read_text()
    tree = ast.parse(src)
    torch_names = _torch_names(tree)
    rel = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    out: list[str] = []

    def where(node: ast.AST, what: str) -> None:
        out.append(f"{rel}:{getattr(node, 'lineno', '?')}: {what}")

    torch_classes: set[ast.ClassDef] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(part.startswith("_") for part in node.module.split(".")):
                where(node, f"imports from the private module {node.module}")
            for a in node.names:
                if a.name.startswith("_"):
                    where(node, f"imports torch's private {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "torch" and any(p.startswith("_") for p in parts):
                    where(node, f"imports the private module {a.name}")
        elif isinstance(node, ast.ClassDef):
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if bases & torch_names:
                torch_classes.add(node)
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            where(node, f"names torch's private {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            recv = node.value.id if isinstance(node.value, ast.Name) else None
            if recv not in ("self", "cls"):
                where(node, f"reaches torch's private .{node.attr}")
    for cls in torch_classes:  # a subclass of a torch class: its inherited privates
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
                where(node, f"{cls.name} reaches torch's private self.{node.attr}")
            elif isinstance(node, ast.FunctionDef) and node.name in PRIVATE_NAMES:
                where(node, f"{cls.name} overrides torch's private {node.name}")
    return out


def test_only_the_torch_modules_name_torch_privates() -> None:
    found = [v for p in sorted(PACKAGE.rglob("*.py")) if p not in ALLOWED for v in violations(p)]
    assert not found, (
        "torch privates outside trainguard/runtime/_torch.py and trainguard/core/_torch.py "
        "(add an accessor there and list the name in its PRIVATES):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "snippet",
    [
        "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc\n",
        "x = handler._this_node\n",
        "y = getattr(agent, '_pcontext', None)\n",
        "from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader\n",
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "class A(LocalElasticAgent):\n    def f(self):\n        return self._remaining_restarts\n",
    ],
)
def test_the_scan_finds(tmp_path: Path, snippet: str) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(snippet)
    assert violations(probe), snippet
