"""The documentation: the README stays a front page whose links resolve, and the generated
reference pages cover every config setting and event kind (docs/gen.py; `make test` also
checks that the checked-in pages match the code and builds the site with warnings as errors)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from trainguard.core.contracts import event_kinds

REPO = Path(__file__).resolve().parent.parent


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_gen", REPO / "docs" / "gen.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_is_a_front_page_whose_links_resolve() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_config_reference_has_every_setting_with_its_env_name() -> None:
    gen = _gen()
    page = gen.config_reference()
    for section, cls in gen.sections().items():
        assert f"## `[{section}]`" in page
        for f in dataclasses.fields(cls):
            env = f"TRAINGUARD_{section.upper()}_{f.name.upper()}"
            assert re.search(rf"^\| `{f.name}` \|.*\| `{env}` \|", page, re.M), env


def test_event_reference_has_every_kind_and_field() -> None:
    page = _gen().events_reference()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)`.*$", page, re.M)}
    assert set(rows) == {spec.name for spec in event_kinds.EVENTS}
    for spec in event_kinds.EVENTS:
        for field in spec.fields:
            assert f"`{field}`" in rows[spec.name], (spec.name, field)


def test_environment_reference_has_every_name_a_worker_may_get() -> None:
    from trainguard.core.contracts import envvars

    page = _gen().environment_reference()
    rows = set(re.findall(r"^\| `(TRAINGUARD_\w+)` \|", page, re.M))
    roles = {
        envvars.ROLE,
        envvars.ROLE_REPLICA,
        envvars.ROLE_PORT,
        envvars.ROLE_RUN_DIR,
        envvars.ROLE_TOKEN,
    }
    assert rows == set(envvars.ALL) | roles
    assert "| `TRAINGUARD_ROLLOUT_URLS` | In the trainer's workers" in page


def test_checked_in_reference_pages_match_the_code() -> None:
    gen = _gen()
    for rel, render in gen.PAGES.items():
        assert (REPO / "docs" / rel).read_text() == render(), f"docs/{rel}: run docs/gen.py --write"


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = {p.relative_to(REPO / "docs").as_posix() for p in (REPO / "docs").rglob("*.md")}
    named = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M))
    assert pages == named, (pages - named, named - pages)
