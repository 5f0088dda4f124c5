"""Environment names are spelled in one place: no ``"TRAINGUARD_...`` string literal outside
trainguard/core/contracts/envvars.py (facts and user-set names) and the config loader
(``TRAINGUARD_<SECTION>_<FIELD>`` settings, trainguard/core/config/); and one variable carries
the run directory (the others are read for compatibility only)."""

from __future__ import annotations

import ast
from pathlib import Path

from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir

PACKAGE = Path(__file__).resolve().parents[1] / "trainguard"
PREFIX = envvars.NAMESPACE
OWNERS = ("core/contracts/envvars.py", "core/config/")

ALLOWED = {
    # Runs at every Python start in a worker's environment: it imports nothing of trainguard
    # (a copy of envvars.ZYGOTE_FD; the test below holds it equal).
    ("runtime/_zygote/sitecustomize.py", envvars.ZYGOTE_FD),
}
"""(module relative to trainguard/, the literal) pairs allowed outside the owners: each a copy of
a constant of envvars."""


def env_literals(root: Path = PACKAGE) -> list[tuple[str, int, str]]:
    """(module, line, literal) of every string literal that starts with ``TRAINGUARD_`` outside
    the owners (docstrings included: a name in prose is written ``TRAINGUARD_X``, mid-sentence)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if any(rel == o or rel.startswith(o) for o in OWNERS):
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                if n.value.startswith(PREFIX):
                    found.append((rel, n.lineno, n.value))
    return found


def test_no_env_literal_outside_envvars_and_the_config_loader() -> None:
    bad = [
        f"trainguard/{rel}:{line}: {value!r}: use (or add) its constant in "
        "trainguard/core/contracts/envvars.py (settings: trainguard.core.config.setting_env)"
        for rel, line, value in env_literals()
        if (rel, value) not in ALLOWED
    ]
    assert not bad, "\n".join(bad)


def test_the_allowed_literals_are_copies_of_envvars_and_still_there() -> None:
    constants = {v for k, v in vars(envvars).items() if k.isupper() and isinstance(v, str)}
    assert {value for _, value in ALLOWED} <= constants
    present = {(rel, value) for rel, _, value in env_literals()}
    assert ALLOWED <= present, f"no longer there (take them off the list): {ALLOWED - present}"


def test_the_scan_finds_a_literal(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text('import os\nX = os.environ.get("TRAINGUARD_NEW_THING")\n')
    assert env_literals(tmp_path) == [("mod.py", 2, "TRAINGUARD_NEW_THING")]


def test_one_variable_carries_the_run_directory() -> None:
    assert envvars.run_dir({}) is None
    assert envvars.run_dir({envvars.RUN_DIR: "/a", envvars.ROLE_RUN_DIR: "/b"}) == "/a"
    # compatibility reads: an engine started by hand, a chain's batch script from before
    assert envvars.run_dir({envvars.ROLE_RUN_DIR: "/b"}) == "/b"
    assert envvars.run_dir({envvars.SBATCH_RUN_DIR: "/c"}) == "/c"


def test_rundir_owns_the_paths_of_the_features() -> None:
    r = RunDir("/run")
    assert r.weights == Path("/run/rl/weights")
    assert r.straggler_scores("n1") == Path("/run/health/straggler_scores.n1.json")
    assert r.role_log("rollout", 2) == Path("/run/roles/rollout/2.log")
    assert str(RunDir("$RUN_DIR").step_log("agent")) == "$RUN_DIR/logs/agent-%j-%t.out"
    assert r.telemetry_file("metrics", "n1") == Path("/run/telemetry/metrics_n1.jsonl")
    assert r.telemetry_file("summary", "n1") == Path("/run/telemetry/summary_n1.json")
    assert r.prometheus_endpoint("n1") == Path("/run/prometheus_n1.json")
    assert r.report == Path("/run/report.html")


def test_rundir_paths_are_where_the_features_write(tmp_path: Path) -> None:
    from trainguard.telemetry.prometheus import endpoint_file

    assert endpoint_file(tmp_path, "n1") == RunDir(tmp_path).prometheus_endpoint("n1")
    (tmp_path / "health").mkdir()
    (tmp_path / "health" / "straggler_scores.n1.json").write_text("{}")
    assert RunDir(tmp_path).straggler_score_files() == [RunDir(tmp_path).straggler_scores("n1")]
