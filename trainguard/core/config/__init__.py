"""trainguard's own configuration: one root config composed of per-component sections.

Sources, highest precedence first: explicit overrides (CLI flags) > the ``--config`` TOML file >
``TRAINGUARD_<SECTION>_<FIELD>`` environment variables > defaults. torchrun's own flags are never
read from here; they keep torchrun's meaning and ``PET_*`` env defaults.

A TOML file looks like::

    [runtime]
    run_dir = "/scratch/runs/job42"

    [health]
    probe_interval_s = 10.0
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.atomicfile import write_atomic
from trainguard.core.config.alerts import AlertsConfig
from trainguard.core.config.checkpoint import CheckpointConfig
from trainguard.core.config.fleet import FleetConfig
from trainguard.core.config.ft import FTConfig
from trainguard.core.config.health import HealthConfig
from trainguard.core.config.inprocess import InProcessConfig
from trainguard.core.config.integrations import IntegrationsConfig
from trainguard.core.config.recovery import RecoveryConfig
from trainguard.core.config.rendezvous import RendezvousConfig
from trainguard.core.config.roles import RolesConfig
from trainguard.core.config.rollback import RollbackConfig
from trainguard.core.config.runtime import RuntimeConfig
from trainguard.core.config.sdc import SdcConfig
from trainguard.core.config.slurm import SlurmConfig
from trainguard.core.config.spares import SparesConfig
from trainguard.core.config.telemetry import TelemetryConfig
from trainguard.core.config.warm import WarmConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import CONFIG_JSON
from trainguard.core.urls import redact_url

__all__ = [
    "CONFIG_JSON",
    "ConfigError",
    "TrainGuardConfig",
    "load_config",
    "load_worker_section",
    "setting_env",
    "worker_section_or_default",
    "write_effective",
]

ENV_PREFIX = envvars.NAMESPACE

logger = logging.getLogger(__name__)

DEPRECATED: dict[tuple[str, str], tuple[str, str]] = {
    ("runtime", "warm_restarts"): ("warm", "enabled"),
    ("runtime", "warm_preload"): ("warm", "preload"),
    ("runtime", "warm_prestart_delay_s"): ("warm", "prestart_delay_s"),
    ("spares", "warm_workers"): ("warm", "enabled"),
    ("spares", "warm_preload"): ("warm", "preload"),
}
"""Old settings still accepted, (section, key) → the ``[warm]`` setting they now set (one
warm pool serves restarts and spares). A value given under the new name in the same source
wins."""

_WARM_WORKERS = {"on": True, "auto": True, "true": True, "1": True}
_WARM_WORKERS.update({"off": False, "false": False, "0": False})


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the source, the key and the fix."""


@dataclass(kw_only=True, slots=True)
class TrainGuardConfig:
    """Root config: composes the component sections and holds no fields of its own."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ft: FTConfig = field(default_factory=FTConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    inprocess: InProcessConfig = field(default_factory=InProcessConfig)
    spares: SparesConfig = field(default_factory=SparesConfig)
    integrations: IntegrationsConfig = field(default_factory=IntegrationsConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    sdc: SdcConfig = field(default_factory=SdcConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(TrainGuardConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainGuardConfig)}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert ``value`` (from TOML or an env string) to ``annotation``; raise ConfigError."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            if type(None) in args:
                return None
        return _coerce(value, non_none[0], where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else str
        return [_coerce(v, item, where) for v in value]
    if origin is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: expected a JSON object, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table/object, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return annotation(value) if annotation is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, str | int | float):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _read_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist: check the --config path") from None
    except PermissionError:
        raise ConfigError(
            f"config file {path} is not readable: fix its permissions (chmod +r)"
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory: pass a .toml file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _apply(section_obj: Any, key: str, raw: Any, where: str) -> None:
    hints = typing.get_type_hints(type(section_obj))
    names = {f.name for f in dataclasses.fields(section_obj)}
    if key not in names:
        known = ", ".join(sorted(names)) or "(none yet)"
        raise ConfigError(f"{where}: unknown key {key!r}; known keys: {known}")
    setattr(section_obj, key, _coerce(raw, hints[key], where))


def _undeprecated(
    layer: dict[str, dict[str, tuple[Any, str]]], spell: Callable[[str, str], str]
) -> dict[str, dict[str, tuple[Any, str]]]:
    """``layer`` (one source's values) with the :data:`DEPRECATED` settings moved to their new
    place, one warning line each; ``spell(section, key)`` names a setting as the source does."""
    for (old_section, old_key), (new_section, new_key) in DEPRECATED.items():
        if old_key not in layer.get(old_section, {}):
            continue
        raw, where = layer[old_section].pop(old_key)
        if (old_section, old_key) == ("spares", "warm_workers"):
            mode = str(raw).lower()
            if mode not in _WARM_WORKERS:
                raise ConfigError(
                    f"{where}: {raw!r}: use on, auto or off (deprecated: set "
                    f"{spell(new_section, new_key)} = true or false instead)"
                )
            raw = _WARM_WORKERS[mode]
        new = spell(new_section, new_key)
        taken = new_key in layer[new_section]
        if taken:
            by = layer[new_section][new_key][1].removesuffix(" (deprecated)")
            logger.warning("%s is deprecated and ignored here: %s sets %s", where, by, new)
        else:
            logger.warning(
                "%s is deprecated (one warm pool serves restarts and spares): read as %s = %s; "
                "set that instead",
                where,
                new,
                json.dumps(raw),
            )
            layer[new_section][new_key] = (raw, f"{where} (deprecated)")
    return layer


def _merge(
    values: dict[str, dict[str, tuple[Any, str]]], layer: dict[str, dict[str, tuple[Any, str]]]
) -> None:
    for name, table in layer.items():
        values.setdefault(name, {}).update(table)


def setting_env(section: str, key: str) -> str:
    """The environment variable of the setting ``[section] key``: ``TRAINGUARD_<SECTION>_<KEY>``."""
    return f"{ENV_PREFIX}{section}_{key}".upper()


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> TrainGuardConfig:
    """Build the effective config: overrides > file > ``TRAINGUARD_*`` env > defaults.

    ``overrides`` maps ``"section.field"`` to a value (e.g. from CLI flags); ``None`` values are
    ignored so unset flags do not mask lower layers.
    """
    env = os.environ if env is None else env
    sections = _sections()
    values: dict[str, dict[str, tuple[Any, str]]] = {name: {} for name in sections}

    layer: dict[str, dict[str, tuple[Any, str]]] = {name: {} for name in sections}
    for var, raw in env.items():
        if not var.startswith(ENV_PREFIX) or var.startswith(envvars.PREFIX):
            continue  # envvars.PREFIX: what the agent tells its workers, not settings
        rest = var[len(ENV_PREFIX) :].lower()
        for name in sections:
            if rest.startswith(name + "_"):
                layer[name][rest[len(name) + 1 :]] = (raw, f"env {var}")
                break
    _merge(values, _undeprecated(layer, lambda s, k: f"{ENV_PREFIX}{s}_{k}".upper()))

    if path is not None:
        data = _read_toml(path)
        layer = {name: {} for name in sections}
        for name, table in data.items():
            if name not in sections:
                raise ConfigError(
                    f"config file {path}: unknown section [{name}]; "
                    f"known sections: {', '.join(sections)}"
                )
            if not isinstance(table, dict):
                raise ConfigError(f"config file {path}: [{name}] must be a table")
            for key, raw in table.items():
                layer[name][key] = (raw, f"config file {path}: [{name}] {key}")
        _merge(values, _undeprecated(layer, lambda s, k: f"[{s}] {k}"))

    for dotted, raw in (overrides or {}).items():
        if raw is None:
            continue
        name, _, key = dotted.partition(".")
        values.setdefault(name, {})[key] = (raw, f"option {dotted}")

    built: dict[str, Any] = {}
    for name, cls in sections.items():
        obj = cls()
        for key, (raw, where) in values[name].items():
            if where.startswith("env ") and key not in {f.name for f in dataclasses.fields(obj)}:
                raise ConfigError(
                    f"{where}: unknown setting; known: "
                    + (
                        ", ".join(
                            f"{ENV_PREFIX}{name.upper()}_{f.name.upper()}"
                            for f in dataclasses.fields(obj)
                        )
                        or "(none yet)"
                    )
                )
            _apply(obj, key, raw, where)
        try:
            obj.__post_init__() if hasattr(obj, "__post_init__") else None
        except ValueError as e:
            raise ConfigError(f"[{name}]: {e}") from None
        built[name] = obj
    return TrainGuardConfig(**built)


def load_worker_section(run_dir: Path | None, name: str) -> Any:
    """Section ``name`` of the config the agent resolved for this run
    (``<run_dir>/config.json``). Outside ``trainguard run`` (plain torchrun or python, no
    config.json) it is read as ``load_config()`` reads it (env, defaults). Under the agent a
    missing or unreadable config.json is a :class:`ConfigError`: a worker never silently runs on
    other settings than its agent."""
    cls = type(getattr(TrainGuardConfig(), name))
    path = Path(run_dir) / CONFIG_JSON if run_dir is not None else None
    under_agent = bool(os.environ.get(envvars.PROGRESS_DIR))
    if path is None or (not path.exists() and not under_agent):
        return getattr(load_config(), name)
    try:
        section = json.loads(path.read_text())["trainguard"][name]
        return cls(**section)
    except OSError as e:
        raise ConfigError(
            f"cannot read the agent's resolved config {path}: {e.strerror or e}; the run "
            "directory must be readable by the workers (check --tg-run-dir and permissions)"
        ) from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{path}: section [{name}] is missing or invalid ({type(e).__name__}: {e}); it is "
            "written by `trainguard run` at launch: was the run directory reused by another "
            "trainguard version? start with a fresh --tg-run-dir"
        ) from None


def worker_section_or_default(run_dir: Path | str | None, name: str) -> Any:
    """:func:`load_worker_section`, or the section's defaults with one warning where it cannot
    be read: for settings (telemetry, heartbeats, integrations) that must never stop a worker."""
    try:
        return load_worker_section(Path(run_dir) if run_dir else None, name)
    except ValueError as e:  # a ConfigError, or a section's own check
        logger.warning("trainguard: [%s] settings ignored (%s); using the defaults", name, e)
        return type(getattr(TrainGuardConfig(), name))()


def write_effective(run_dir: Path, effective: dict[str, Any]) -> Path:
    """Write ``<run_dir>/config.json`` atomically (every node's agent writes it; a worker never
    reads a half-written file)."""
    return write_atomic(
        Path(run_dir) / CONFIG_JSON, json.dumps(_redacted(effective), indent=2, default=str) + "\n"
    )


def _redacted(effective: dict[str, Any]) -> dict[str, Any]:
    """``effective`` with the secret parts of URLs taken out: the pager's webhook URL often
    carries its token (in the path or the query), and config.json is readable by whoever may
    read the run directory."""
    out = json.loads(json.dumps(effective, default=str))
    alerts = (out.get("trainguard") or {}).get("alerts") or {}
    if alerts.get("webhook_url"):
        alerts["webhook_url"] = redact_url(alerts["webhook_url"])
    fleet = (out.get("trainguard") or {}).get("fleet") or {}
    if fleet.get("url"):
        fleet["url"] = redact_url(fleet["url"])
    return out
