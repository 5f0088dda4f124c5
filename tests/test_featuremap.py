"""The feature map (docs/featuremap.toml, rendered into docs/reference/features.md by
docs/gen.py) lists every module of trainguard/ exactly once, and only modules that exist."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", REPO / "docs" / "gen.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def problems(features: list[dict], modules: list[str]) -> list[str]:
    listed = Counter(m for f in features for m in f["modules"])
    out = [
        f"trainguard/{m}.py is in no feature of docs/featuremap.toml: add it to the feature "
        "it serves"
        for m in modules
        if m not in listed
    ]
    out += [f"{m} is listed {n} times in docs/featuremap.toml: keep one" for m, n in listed.items() if n > 1]  # fmt: skip
    out += [f"{m} in docs/featuremap.toml is no module of trainguard/" for m in listed if m not in modules]  # fmt: skip
    return out


def test_every_module_is_in_one_feature() -> None:
    gen = _gen()
    found = problems(gen.feature_map(), gen.product_modules())
    assert not found, "\n".join(found)


def test_every_feature_names_a_page_and_its_modules_a_layer() -> None:
    gen = _gen()
    for f in gen.feature_map():
        assert (REPO / "docs" / f["doc"]).is_file(), f
        assert f["what"] and f["modules"], f
        for m in f["modules"]:
            gen.layer_of(m)  # StopIteration: a top-level name of no layer


@pytest.mark.parametrize("change", ["new module", "twice", "gone"])
def test_the_check_fails_on_a_map_out_of_date(change: str) -> None:
    gen = _gen()
    features, modules = gen.feature_map(), gen.product_modules()
    before = len(problems(features, modules))
    if change == "new module":
        modules = [*modules, "health/new_probe"]
    elif change == "twice":
        features = [*features, {"modules": ["core/contracts/rundir"]}]
    else:
        features = [*features, {"modules": ["core/gone"]}]
    assert len(problems(features, modules)) == before + 1
