"""A small, deterministic YAML writer for the generated rule and Alertmanager files.

Only what those files need: mappings (insertion order kept), lists, strings, numbers, booleans.
Strings are written as JSON strings (a JSON string is a valid YAML double-quoted scalar), or
as literal blocks (``|-``) when they span lines, so the output never depends on a YAML
library's version and regenerating gives the same bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["dump"]

_PLAIN = re.compile(r"\A[A-Za-z_][A-Za-z0-9_./-]*\Z")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, int | float):
        return repr(v)
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in _RESERVED:
        return s
    return json.dumps(s, ensure_ascii=False)


def _key(k: str) -> str:
    return k if _PLAIN.match(k) and k.lower() not in _RESERVED else json.dumps(k)


def _lines(v: Any, indent: int) -> list[str]:
    pad = " " * indent
    out: list[str] = []
    if isinstance(v, Mapping):
        if not v:
            return [pad + "{}"]
        for k, item in v.items():
            out.extend(_entry(f"{pad}{_key(str(k))}:", item, indent))
        return out
    if isinstance(v, Sequence) and not isinstance(v, str):
        if not v:
            return [pad + "[]"]
        for item in v:
            if isinstance(item, Mapping) and item:
                sub = _lines(item, indent + 2)
                out.append(pad + "- " + sub[0][indent + 2 :])
                out.extend(sub[1:])
            else:
                out.extend(_entry(f"{pad}-", item, indent))
        return out
    return [pad + _scalar(v)]


def _entry(head: str, item: Any, indent: int) -> list[str]:
    if isinstance(item, str) and "\n" in item:
        body = [(" " * (indent + 2) + line) if line else "" for line in item.split("\n")]
        return [head + " |-", *body]
    if isinstance(item, Mapping) and item:
        return [head, *_lines(item, indent + 2)]
    if isinstance(item, Sequence) and not isinstance(item, str) and item:
        return [head, *_lines(item, indent + 2)]
    return [f"{head} {_lines(item, 0)[0]}"]


def dump(data: Mapping[str, Any], *, header: str = "") -> str:
    """YAML text of ``data`` (a mapping), with ``header`` as leading ``#`` comment lines."""
    lines = [f"# {h}".rstrip() for h in header.splitlines()] if header else []
    lines.extend(_lines(data, 0))
    return "\n".join(lines) + "\n"
