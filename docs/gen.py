"""The generated reference pages: configuration (from the config dataclasses in
``trainguard/core/config/``), events (from ``trainguard/core/contracts/event_kinds.py``), the worker
environment (from ``trainguard/core/contracts/envvars.py``) and the feature map (from
``docs/featuremap.toml``: which modules make up each feature, by layer).

    python docs/gen.py --write   # regenerate docs/reference/*.md (make docs runs it)
    python docs/gen.py --check   # exit 1 when they differ from the code (make test runs it)

The pages are checked in, so they read on the repository's web view too; ``--check`` in
``make test`` keeps them from drifting from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from trainguard.core import config as config_pkg
from trainguard.core.contracts import envvars, event_kinds

CONFIG_PAGE = "reference/configuration.md"
EVENTS_PAGE = "reference/events.md"
ENV_PAGE = "reference/environment.md"
FEATURES_PAGE = "reference/features.md"
FEATURE_MAP = Path(__file__).resolve().parent / "featuremap.toml"
PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"

LAYERS = (
    ("CLI", ("cli",)),
    ("integrations", ("integrations",)),
    ("agent", ("runtime",)),
    ("worker", ("worker",)),
    ("feature", ("checkpoint", "health", "telemetry", "recovery", "slurm", "dashboards", "ft",
                 "rl", "roles", "fleet")),
    ("plan, testing", ("plan", "testing")),
    ("chaos", ("chaos",)),
    ("core", ("core", "__init__", "__main__")),
)  # fmt: skip
"""The layers of docs/architecture.md, top to bottom, and the top-level names in each."""


def _md(text: str) -> str:
    """reST literals (``x``) and cross-references (:data:`x`) as Markdown code; one line (a
    table cell)."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r":(?:attr|class|data|func|meth|mod):`~?([^`]+)`", r"`\1`", text)
    return " ".join(text.split()).replace("|", "\\|")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in value) + "]`"
    if isinstance(value, dict):
        return f"`{value}`" if value else "`{}`"
    return f"`{value}`"


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = inspect.cleandoc(node.value.value)
    return docs


def _section_intro(cls: type) -> tuple[str, str | None]:
    """A section module's docstring: its prose (first line dropped: the heading says it) and
    its TOML example, if any."""
    doc = inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "")
    example = None
    if "Example::" in doc:
        doc, _, rest = doc.partition("Example::")
        # the example is the indented block after "Example::"; what follows it is prose again
        lines = rest.split("\n")
        end = next(
            (
                i
                for i, line in enumerate(lines)
                if line.strip() and not line[:1].isspace() and any(x.strip() for x in lines[:i])
            ),
            len(lines),
        )
        example = textwrap.dedent("\n".join(lines[:end])).strip("\n")
        doc = doc.rstrip() + "\n\n" + "\n".join(lines[end:]).strip()
    prose = doc.split("\n", 1)[1] if "\n" in doc else ""
    prose = re.sub(r"``([^`]+)``", r"`\1`", prose.strip())
    prose = re.sub(r"::$", ":", prose, flags=re.M)  # reST's literal-block marker
    return prose, example


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(config_pkg.TrainGuardConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_pkg.TrainGuardConfig)}


def config_reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses in `trainguard/core/config/` at every docs build.",
        "",
        "Every setting comes, highest precedence first, from a `trainguard run` flag where one",
        "exists (`--tg-run-dir`, `--no-tg-warm`, `--ft`, ...), the `--config FILE.toml` file, a",
        "`TRAINGUARD_<SECTION>_<FIELD>` environment variable, then the default. Lists in an",
        "environment variable are comma-separated, tables JSON. The effective configuration is",
        "written to `<run_dir>/config.json`. torchrun's own flags are never read from here.",
        "",
    ]
    for name, cls in sections().items():
        prose, example = _section_intro(cls)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        out += [f"## `[{name}]`", ""]
        if prose:
            out += [prose, ""]
        if example:
            out += ["```toml", example, "```", ""]
        out += ["| key | type | default | env | meaning |", "| --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            env = f"TRAINGUARD_{name.upper()}_{f.name.upper()}"
            out.append(
                f"| `{f.name}` | {_type_name(hints[f.name])} | {_default(getattr(defaults, f.name))}"
                f" | `{env}` | {_md(docs.get(f.name, ''))} |"
            )
        out.append("")
    out += [
        "## Deprecated names",
        "",
        "Still read, with one deprecation line each, into their new place:",
        "",
        "| old | new |",
        "| --- | --- |",
    ]
    for (sec, key), (new_sec, new_key) in sorted(config_pkg.DEPRECATED.items()):
        out.append(f"| `[{sec}] {key}` | `[{new_sec}] {new_key}` |")
    return "\n".join(out) + "\n"


def events_reference() -> str:
    out = [
        "# Event reference",
        "",
        "Generated from `trainguard/core/contracts/event_kinds.py` (the event contract) at every docs build.",
        "",
        "Each line of `<run_dir>/events.jsonl` is one JSON object; every event carries `time`,",
        "`kind`, `node` and `attempt` (the job-wide attempt) besides the fields listed, and the",
        "agent's also `agent_restarts`. `trainguard events RUN_DIR` prints them. Kinds marked",
        "*bus* are in-process messages between agent plugins, never written to the log.",
        "",
        "| kind | fields | emitted by | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for spec in event_kinds.EVENTS:
        fields = ", ".join(f"`{f}`" for f in spec.fields) or "—"
        emitters = ", ".join(f"`{e}`" for e in spec.emitters)
        bus = "" if spec.logged else " *bus*"
        out.append(f"| `{spec.name}`{bus} | {fields} | {emitters} | {_md(spec.description)} |")
    return "\n".join(out) + "\n"


def module_docs(module: types.ModuleType) -> dict[str, str]:
    """The docstrings of a module's constants (the string literal after each assignment)."""
    body = ast.parse(inspect.getsource(module)).body
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:], strict=False):
        if (
            isinstance(prev, ast.Assign)
            and isinstance(prev.targets[0], ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.targets[0].id] = inspect.cleandoc(node.value.value)
    return docs


def environment_reference() -> str:
    docs = module_docs(envvars)
    by_value = {v: k for k, v in vars(envvars).items() if k.isupper() and isinstance(v, str)}
    out = [
        "# Worker environment reference",
        "",
        "Generated from `trainguard/core/contracts/envvars.py` at every docs build.",
        "",
        "A worker started by `trainguard run` sees exactly the environment `torchrun` would give",
        "it, plus the names below (`TRAINGUARD_AGENT_*` are facts the agent hands its workers,",
        "never settings; settings reach a worker through the run's `config.json`). This holds for",
        "every start method and for `--no-python` programs, and for every Python they start.",
        "",
        "| variable | meaning |",
        "| --- | --- |",
    ]
    for value in envvars.ALL:
        out.append(f"| `{value}` | {_md(docs.get(by_value[value], ''))} |")
    roles = (
        envvars.ROLE,
        envvars.ROLE_REPLICA,
        envvars.ROLE_PORT,
        envvars.ROLE_RUN_DIR,
        envvars.ROLE_TOKEN,
    )
    out += [
        "",
        "A role replica (a rollout engine or reward server started by `[roles]`) gets these:",
        "",
        "| variable | meaning |",
        "| --- | --- |",
    ]
    for value in roles:
        out.append(f"| `{value}` | {_md(docs.get(by_value[value], ''))} |")
    return "\n".join(out) + "\n"


def feature_map() -> list[dict[str, Any]]:
    """The features of docs/featuremap.toml, in its order (name, doc, what, modules)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    with FEATURE_MAP.open("rb") as f:
        features: list[dict[str, Any]] = tomllib.load(f)["feature"]
    return features


def product_modules() -> list[str]:
    """Every module of trainguard/, as the feature map names it (``core/contracts/rundir``)."""
    return sorted(str(p.relative_to(PACKAGE).with_suffix("")) for p in PACKAGE.rglob("*.py"))


def layer_of(module: str) -> str:
    top = module.split("/", 1)[0]
    return next(name for name, tops in LAYERS if top in tops)


def features_reference() -> str:
    out = [
        "# Feature map",
        "",
        "Generated from `docs/featuremap.toml` at every docs build: the modules (under",
        "`trainguard/`) that make up each feature, by layer (top to bottom, as in",
        "[the layout](../architecture.md)). Every module is in exactly one row",
        "(`tests/test_featuremap.py`).",
        "",
        "| feature | " + " | ".join(name for name, _ in LAYERS) + " |",
        "| --- | " + " | ".join("---" for _ in LAYERS) + " |",
    ]
    for feature in feature_map():
        by_layer: dict[str, list[str]] = {}
        for module in feature["modules"]:
            by_layer.setdefault(layer_of(module), []).append(f"`{module}`")
        title = f"[{feature['name']}](../{feature['doc']}): {_md(feature['what'])}"
        cells = [", ".join(by_layer.get(name, [])) for name, _ in LAYERS]
        out.append("| " + " | ".join([title, *cells]) + " |")
    return "\n".join(out) + "\n"


PAGES = {
    CONFIG_PAGE: config_reference,
    EVENTS_PAGE: events_reference,
    ENV_PAGE: environment_reference,
    FEATURES_PAGE: features_reference,
}


DOCS = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    if argv not in (["--write"], ["--check"]):
        print("usage: python docs/gen.py --write|--check", file=sys.stderr)
        return 2
    stale = []
    for rel, render in PAGES.items():
        path = DOCS / rel
        text = render()
        if argv == ["--write"]:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
        elif not path.exists() or path.read_text() != text:
            stale.append(f"docs/{rel}")
    if stale:
        print(
            f"{', '.join(stale)} differ from the code they are generated from: "
            "run `python docs/gen.py --write` (or `make docs`) and commit the result",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
