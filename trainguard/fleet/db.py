"""The fleet database: every node's history across jobs (health verdicts, evictions, attributed
failures, straggler exclusions, refusals, releases), in SQLite (WAL; the default, under the
runs root) or PostgreSQL (``postgresql://...``, psycopg 3).

Schema (version :data:`SCHEMA_VERSION`, in table ``trainguard_meta``)::

    trainguard_records(uid PRIMARY KEY, time, node, device, job, attempt, kind, cause,
                       verdict, detail JSON, writer)
    trainguard_releases(node, time, by_whom, reason, writer)

``uid`` makes a write idempotent: a batch retried after a lost connection is never counted
twice. ``writer`` is who wrote the row as the database knows it: on PostgreSQL the login role
(``session_user``), stamped by a trigger whatever the writer sends, so that with ``[fleet]
node_role`` a record counts for a node only when that node's role wrote it, and a release only
when the operator's role did (:mod:`trainguard.fleet.lemons`); on SQLite it is empty (whoever
can write the file is trusted with all of it). A database of schema version 1 is upgraded in
place by its owner (rows written before have no writer).

Every error a caller can meet is a :class:`FleetDBError` with one line saying what, where and
how to fix it; a driver's message is scrubbed of the URL's user info and password first.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.urls import redact_url, scrub_secrets, url_secrets, userinfo_problem

__all__ = [
    "SCHEMA_VERSION",
    "FleetDB",
    "FleetDBError",
    "Record",
    "open_db",
    "safe_node_name",
]

SCHEMA_VERSION = 2
DEFAULT_FILE = "fleet.db"


class FleetDBError(RuntimeError):
    """The fleet database cannot be used (one line: what, where, how to fix)."""


@dataclass(slots=True)
class Record:
    """One fact about a node."""

    node: str
    kind: str
    """``failure`` (an attributed failure), ``eviction``, ``health``, ``straggler``,
    ``refused``, ``sniff``."""
    cause: str = ""
    """``hardware``, ``user_code``, ``network`` ... (attribution causes), ``lemon``."""
    verdict: str = ""
    job: str = ""
    attempt: int = -1
    device: str = ""
    """GPU UUID / serial when known."""
    time: float = field(default_factory=time.time)
    detail: dict[str, Any] = field(default_factory=dict)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    writer: str = ""
    """Who wrote it, as the database stamped it (read only: never sent on a write)."""

    def row(self) -> tuple[Any, ...]:
        return (
            self.uid,
            self.time,
            self.node,
            self.device,
            self.job,
            self.attempt,
            self.kind,
            self.cause,
            self.verdict,
            json.dumps(self.detail, default=str)[:20000],
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_COLS = "uid, time, node, device, job, attempt, kind, cause, verdict, detail"
_READ_COLS = _COLS + ", writer"


def safe_node_name(node: str) -> tuple[str, bool]:
    """``node`` as stored: printable, at most 255 characters; True when it had to change."""
    clean = "".join(
        c if c.isprintable() and c not in "\r\n\t" else f"\\x{ord(c):02x}" for c in node
    )
    clean = clean[:255] or "<empty>"
    return clean, clean != node


def _row_record(row: Iterable[Any]) -> Record:
    uid, t, node, device, job, attempt, kind, cause, verdict, detail, writer = row
    try:
        d = json.loads(detail) if detail else {}
    except ValueError:
        d = {"raw": str(detail)[:200]}
    return Record(
        node=node, kind=kind, cause=cause or "", verdict=verdict or "", job=job or "",
        attempt=int(attempt if attempt is not None else -1), device=device or "",
        time=float(t), detail=d, uid=uid, writer=writer or "",
    )  # fmt: skip


class FleetDB:
    """One connection's worth of the fleet database (open, use, close; not thread-safe)."""

    where: str
    param = "?"

    def _connect(self) -> Any:
        raise NotImplementedError

    def __init__(self) -> None:
        self._conn: Any = None

    # -- connection ----------------------------------------------------------------------------
    def connect(self) -> FleetDB:
        if self._conn is None:
            self._conn = self._connect()
            self._ensure_schema()
        return self

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass

    def __enter__(self) -> FleetDB:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", self.param)

    def _exec(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        cur = self._conn.cursor()
        try:
            cur.execute(self._sql(sql), args)
            rows = cur.fetchall() if cur.description else []
        finally:
            cur.close()
        self._conn.commit()
        return [tuple(r) for r in rows]

    _DDL: tuple[str, ...] = ()
    _MIGRATE_V1: tuple[str, ...] = ()

    def _has_schema(self) -> bool:
        raise NotImplementedError

    def _version(self) -> int | None:
        if not self._has_schema():
            return None
        got = self._exec("SELECT value FROM trainguard_meta WHERE key = ?", ("schema_version",))
        return int(got[0][0]) if got else None

    def _ensure_schema(self) -> None:
        version = self._version()
        if version is None:
            for stmt in self._DDL:
                self._exec(stmt)
            self._insert_version()
            version = self._version()
        if version == 1:  # the writer column and its stamp (by the database's owner)
            for stmt in self._MIGRATE_V1:
                self._exec(stmt)
            self._exec(
                "UPDATE trainguard_meta SET value = ? WHERE key = ?",
                (str(SCHEMA_VERSION), "schema_version"),
            )
            version = SCHEMA_VERSION
        if version != SCHEMA_VERSION:
            self.close()
            raise FleetDBError(
                f"fleet database {self.where} has schema version {version}; this trainguard "
                f"uses {SCHEMA_VERSION}: point [fleet] url at a database of this version (or "
                f"upgrade trainguard to the one that wrote it)"
            )

    def _insert_version(self) -> None:
        raise NotImplementedError

    # -- records -------------------------------------------------------------------------------
    def write(self, records: list[Record]) -> int:
        """Insert ``records`` (a uid already there is skipped); returns how many were sent."""
        if not records:
            return 0
        self._insert_rows([r.row() for r in records])
        return len(records)

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    def history(self, node: str | None = None, *, since: float = 0.0) -> list[Record]:
        if node is None:
            rows = self._exec(
                f"SELECT {_READ_COLS} FROM trainguard_records WHERE time >= ? ORDER BY time",
                (since,),
            )
        else:
            rows = self._exec(
                f"SELECT {_READ_COLS} FROM trainguard_records WHERE node = ? AND time >= ? "
                "ORDER BY time",
                (node, since),
            )
        return [_row_record(r) for r in rows]

    def history_of_kind(self, kind: str, *, since: float = 0.0, limit: int = 5000) -> list[Record]:
        """The latest ``limit`` records of ``kind`` since ``since``, oldest first."""
        rows = self._exec(
            f"SELECT {_READ_COLS} FROM trainguard_records WHERE kind = ? AND time >= ? "
            "ORDER BY time DESC LIMIT ?",
            (kind, since, int(limit)),
        )
        return [_row_record(r) for r in reversed(rows)]

    def count(self) -> int:
        return int(self._exec("SELECT COUNT(*) FROM trainguard_records")[0][0])

    def release(self, node: str, *, by: str, reason: str, now: float | None = None) -> None:
        self._exec(
            "INSERT INTO trainguard_releases (node, time, by_whom, reason) VALUES (?, ?, ?, ?)",
            (node, time.time() if now is None else now, by, reason),
        )

    def last_release(self, node: str, *, writer: str | None = None) -> float | None:
        """The time of ``node``'s last release (only those ``writer`` wrote, when given)."""
        if writer is None:
            got = self._exec("SELECT MAX(time) FROM trainguard_releases WHERE node = ?", (node,))
        else:
            got = self._exec(
                "SELECT MAX(time) FROM trainguard_releases WHERE node = ? AND writer = ?",
                (node, writer),
            )
        return float(got[0][0]) if got and got[0][0] is not None else None

    def nodes(self) -> list[str]:
        return [
            r[0] for r in self._exec("SELECT DISTINCT node FROM trainguard_records ORDER BY node")
        ]


class SQLiteFleetDB(FleetDB):
    _DDL = (
        "CREATE TABLE IF NOT EXISTS trainguard_meta (key TEXT PRIMARY KEY, value TEXT)",
        "CREATE TABLE IF NOT EXISTS trainguard_records (uid TEXT PRIMARY KEY, time REAL, "
        "node TEXT, device TEXT, job TEXT, attempt INTEGER, kind TEXT, cause TEXT, "
        "verdict TEXT, detail TEXT, writer TEXT NOT NULL DEFAULT '')",
        "CREATE INDEX IF NOT EXISTS trainguard_records_node ON trainguard_records (node, time)",
        "CREATE TABLE IF NOT EXISTS trainguard_releases (node TEXT, time REAL, by_whom TEXT, "
        "reason TEXT, writer TEXT NOT NULL DEFAULT '')",
    )
    _MIGRATE_V1 = (
        "ALTER TABLE trainguard_records ADD COLUMN writer TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE trainguard_releases ADD COLUMN writer TEXT NOT NULL DEFAULT ''",
    )

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.where = str(path)

    def _connect(self) -> Any:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=10.0)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=10000")
            return conn
        except sqlite3.DatabaseError as e:
            raise FleetDBError(
                f"fleet database {self.path} is not a usable SQLite database ({e}): move it "
                f"aside (a new one is created) or set [fleet] url"
            ) from None
        except OSError as e:
            raise FleetDBError(f"fleet database {self.path} cannot be created: {e}") from None

    def _ensure_schema(self) -> None:
        try:
            super()._ensure_schema()
        except sqlite3.DatabaseError as e:
            self.close()
            raise FleetDBError(
                f"fleet database {self.path} is not a usable SQLite database ({e}): move it "
                f"aside (a new one is created) or set [fleet] url"
            ) from None

    def _has_schema(self) -> bool:
        return bool(
            self._exec(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'trainguard_meta'"
            )
        )

    def _insert_version(self) -> None:
        self._exec(
            "INSERT OR IGNORE INTO trainguard_meta (key, value) VALUES (?, ?)",
            ("schema_version", str(SCHEMA_VERSION)),
        )

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        self._conn.executemany(
            f"INSERT OR IGNORE INTO trainguard_records ({_COLS}) VALUES "
            "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        self._conn.commit()


_STAMP = (
    "CREATE OR REPLACE FUNCTION trainguard_stamp_writer() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN NEW.writer := session_user; RETURN NEW; END $$"
)
_TRIGGERS = tuple(
    stmt
    for t in ("trainguard_records", "trainguard_releases")
    for stmt in (
        f"DROP TRIGGER IF EXISTS {t}_writer ON {t}",
        f"CREATE TRIGGER {t}_writer BEFORE INSERT OR UPDATE ON {t} FOR EACH ROW "
        "EXECUTE FUNCTION trainguard_stamp_writer()",
    )
)


class PostgresFleetDB(FleetDB):
    param = "%s"
    _DDL = (
        "CREATE TABLE IF NOT EXISTS trainguard_meta (key TEXT PRIMARY KEY, value TEXT)",
        "CREATE TABLE IF NOT EXISTS trainguard_records (uid TEXT PRIMARY KEY, "
        "time DOUBLE PRECISION, node TEXT, device TEXT, job TEXT, attempt INTEGER, kind TEXT, "
        "cause TEXT, verdict TEXT, detail TEXT, writer TEXT NOT NULL DEFAULT session_user)",
        "CREATE INDEX IF NOT EXISTS trainguard_records_node ON trainguard_records (node, time)",
        "CREATE TABLE IF NOT EXISTS trainguard_releases (node TEXT, time DOUBLE PRECISION, "
        "by_whom TEXT, reason TEXT, writer TEXT NOT NULL DEFAULT session_user)",
        _STAMP,
        *_TRIGGERS,
    )
    _MIGRATE_V1 = (
        # rows written before have no writer ('' : counted by no node's role)
        "ALTER TABLE trainguard_records ADD COLUMN IF NOT EXISTS writer TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE trainguard_records ALTER COLUMN writer SET DEFAULT session_user",
        "ALTER TABLE trainguard_releases ADD COLUMN IF NOT EXISTS writer TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE trainguard_releases ALTER COLUMN writer SET DEFAULT session_user",
        _STAMP,
        *_TRIGGERS,
    )

    def __init__(self, url: str, *, connect_timeout_s: float = 3.0, role: str = "") -> None:
        super().__init__()
        self.url = url
        self.role = role
        """Log in as this role instead of the URL's user (``[fleet] node_role``)."""
        self.where = redact_url(url) + (f" as {role}" if role else "")
        self.connect_timeout_s = connect_timeout_s
        self._secrets = url_secrets(url)
        problem = userinfo_problem(url)
        if problem is not None:
            raise FleetDBError(
                f"[fleet] url {redact_url(url)} cannot be used: {problem}; a password in the "
                "URL must be percent-encoded (or left out: PGPASSWORD, ~/.pgpass)"
            )

    def _error(self, e: BaseException, what: str = "") -> FleetDBError:
        """A driver's error as one line, without the URL's user info or password."""
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return FleetDBError(
            f"fleet database {self.where}{what}: {scrub_secrets(first, self._secrets)}"
        )

    def _connect(self) -> Any:
        try:
            import psycopg
        except ImportError:
            raise FleetDBError(
                f"[fleet] url {self.where} is PostgreSQL but psycopg is not installed: "
                "pip install 'trainguard[fleet]'"
            ) from None
        kw: dict[str, Any] = {"user": self.role} if self.role else {}
        try:
            return psycopg.connect(
                self.url,
                connect_timeout=max(1, int(self.connect_timeout_s)),
                autocommit=False,
                **kw,
            )
        except psycopg.Error as e:
            first = scrub_secrets(
                (str(e).strip().splitlines() or [type(e).__name__])[0], self._secrets
            )
            raise FleetDBError(
                f"fleet database {self.where} is unreachable ({first}): check [fleet] url and "
                "that the server runs"
            ) from None

    def _exec(self, sql: str, args: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        import psycopg

        try:
            return super()._exec(sql, args)
        except psycopg.Error as e:
            self.close()
            raise self._error(e) from None

    def _has_schema(self) -> bool:
        return self._exec("SELECT to_regclass('trainguard_meta') IS NOT NULL")[0][0] is True

    def _ensure_schema(self) -> None:
        # one creator at a time when many agents start against a new database
        self._exec("SELECT pg_advisory_lock(7147)")
        try:
            super()._ensure_schema()
        finally:
            if self._conn is not None:
                self._exec("SELECT pg_advisory_unlock(7147)")

    def _insert_version(self) -> None:
        self._exec(
            "INSERT INTO trainguard_meta (key, value) VALUES (?, ?) ON CONFLICT DO NOTHING",
            ("schema_version", str(SCHEMA_VERSION)),
        )

    def _insert_rows(self, rows: list[tuple[Any, ...]]) -> None:
        import psycopg

        try:
            with self._conn.cursor() as cur:
                cur.executemany(
                    f"INSERT INTO trainguard_records ({_COLS}) VALUES "
                    "(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (uid) DO NOTHING",
                    rows,
                )
            self._conn.commit()
        except psycopg.Error as e:
            self.close()
            raise self._error(e) from None

    def grant_roles(self, *, nodes: str, operator: str) -> None:
        """Give role ``nodes`` (the group of the node roles) what an agent needs: read
        everything, add records; and role ``operator`` releases. Run by the tables' owner."""
        import psycopg
        from psycopg import sql

        stmts = [
            "GRANT SELECT ON trainguard_meta, trainguard_records, trainguard_releases TO {n}",
            "GRANT INSERT ON trainguard_records TO {n}",
            "GRANT SELECT ON trainguard_meta, trainguard_records, trainguard_releases TO {o}",
            "GRANT INSERT ON trainguard_releases TO {o}",
        ]
        ids = {"n": sql.Identifier(nodes), "o": sql.Identifier(operator)}
        try:
            with self._conn.cursor() as cur:
                for stmt in stmts:
                    cur.execute(sql.SQL(stmt).format(**ids))
            self._conn.commit()
        except psycopg.Error as e:
            self.close()
            raise self._error(e, " (grants)") from None


def default_path(runs_root: str | os.PathLike[str]) -> Path:
    return Path(runs_root) / DEFAULT_FILE


def open_db(
    url: str,
    *,
    runs_root: str | os.PathLike[str],
    connect_timeout_s: float = 3.0,
    role: str = "",
) -> FleetDB:
    """The fleet database of ``[fleet] url`` (not connected yet: :meth:`FleetDB.connect`);
    ``role``: the PostgreSQL role to log in as instead of the URL's user."""
    if url.startswith(("postgresql://", "postgres://")):
        return PostgresFleetDB(url, connect_timeout_s=connect_timeout_s, role=role)
    if role:
        raise FleetDBError(
            f"[fleet] node_role needs a PostgreSQL url, not {redact_url(url) if url else 'SQLite'}"
            " (SQLite has no roles: whoever can write its file is trusted with all of it)"
        )
    if not url:
        return SQLiteFleetDB(default_path(runs_root))
    if url.startswith("sqlite:///"):
        return SQLiteFleetDB(Path("/" + url[len("sqlite:///") :].lstrip("/")))
    raise FleetDBError(
        f"[fleet] url {redact_url(url)} is not postgresql://... or sqlite:///...: fix it, or "
        "leave it empty for SQLite under the runs root"
    )
