"""How loosely trainguard is typed: the uses of ``typing.Any`` in trainguard/, by package,
against a ceiling that only goes down (``make test`` runs it with the checks).

A use is a name ``Any`` (or ``typing.Any``) in the code: annotations (evaluated or not), casts,
type arguments; imports and text in strings are not counted. When the count falls, lower
:data:`CEILING` to it in the same change; a count above it fails (exit 1) naming the packages
that grew, with the way out: a Protocol of what the code uses of the object, the real type
under ``if TYPE_CHECKING:``, or ``object`` where nothing is used of it.

    python tests/services/any_count.py            # the count by package; exit 1 above CEILING
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

CEILING = 834
"""The count when this ceiling was last lowered (891 before the seams got Protocols)."""

PACKAGE = Path(__file__).resolve().parents[2] / "trainguard"


def uses(tree: ast.AST) -> int:
    return sum(
        (isinstance(n, ast.Name) and n.id == "Any")
        or (isinstance(n, ast.Attribute) and n.attr == "Any")
        for n in ast.walk(tree)
    )


def count(root: Path = PACKAGE) -> Counter[str]:
    """Uses of ``Any`` by package (``core``, ``rl``, ...; a top-level module by its name)."""
    by_package: Counter[str] = Counter()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        n = uses(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if n:
            by_package[rel.parts[0]] += n
    return by_package


def main() -> int:
    by_package = count()
    total = sum(by_package.values())
    packages = ", ".join(f"{p} {n}" for p, n in by_package.most_common())
    print(f"Any in trainguard/: {total} (ceiling {CEILING}): {packages}")
    if total > CEILING:
        print(
            f"any_count: {total} uses of Any, over the ceiling of {CEILING}: type the new ones "
            "(a Protocol of what is used, the real type under TYPE_CHECKING, or object)",
            file=sys.stderr,
        )
        return 1
    if total < CEILING:
        print(f"any_count: lower CEILING in tests/services/any_count.py to {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
