"""Forward-only migrations: numbered plain SQL files in sql/, applied in order.

Each file is applied in its own transaction and recorded in `schema_migrations` with the sha256 of
its text. The whole run holds a session advisory lock on a dedicated connection, so two replicas
starting at once apply each migration exactly once: the second waits, then finds nothing to do.

Refusals (nothing is applied when any holds):
* an applied migration whose file changed (checksum differs);
* an applied migration whose file is gone, or a database newer than the code;
* two files with the same number, or a file name that does not match NNNN_name.sql.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from controlplane.errors import MigrationError
from controlplane.store import locks
from controlplane.store.pool import Conn

_NAME = re.compile(r"(\d{4})_([a-z0-9_]+)\.sql")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


def default_sql_dir() -> Path:
    # The package's `sql` entry is a link to the top-level sql/ folder in a source tree, and a
    # copy of its files in a built wheel, so one path serves editable and packaged installs.
    return Path(__file__).resolve().parents[1] / "sql"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def discover(sql_dir: Path) -> list[Migration]:
    if not sql_dir.is_dir():
        raise MigrationError(f"migrations folder not found: {sql_dir}")
    found: dict[int, Migration] = {}
    for path in sorted(sql_dir.glob("*.sql")):
        match = _NAME.fullmatch(path.name)
        if match is None:
            raise MigrationError(f"migration file name must look like 0001_name.sql: {path.name}")
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share number {version:04d}: {path.name}")
        found[version] = Migration(version, match.group(2), path.read_text())
    return [found[version] for version in sorted(found)]


async def applied(conn: Conn) -> dict[int, tuple[str, str]]:
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    if not exists:
        return {}
    rows = await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
    return {row["version"]: (row["name"], row["checksum"]) for row in rows}


def check(migrations: list[Migration], done: dict[int, tuple[str, str]]) -> list[Migration]:
    """Refuse drift between files and database; return the migrations still to apply."""
    by_version = {migration.version: migration for migration in migrations}
    for version, (name, checksum) in sorted(done.items()):
        migration = by_version.get(version)
        if migration is None:
            raise MigrationError(
                f"migration {version:04d}_{name} is applied but its file is missing: "
                "the database is newer than this code"
            )
        if migration.checksum != checksum:
            raise MigrationError(
                f"migration {version:04d}_{migration.name}.sql was edited after it was applied "
                f"(checksum {checksum[:12]} in the database, {migration.checksum[:12]} on disk); "
                "add a new migration instead"
            )
    return [migration for migration in migrations if migration.version not in done]


async def pending(conn: Conn, sql_dir: Path | None = None) -> list[Migration]:
    """The migrations not yet applied (raises on drift). Used by readiness checks."""
    return check(discover(sql_dir or default_sql_dir()), await applied(conn))


async def migrate(conn: Conn, sql_dir: Path | None = None) -> list[Migration]:
    """Apply what is missing and return it. `conn` must be a dedicated connection.

    Locks: the session advisory lock `locks.MIGRATIONS_KEY`, held for the whole run and released
    before returning. Each migration then takes whatever locks its DDL takes, in its own
    transaction; no other code path takes the migrations key, so it cannot deadlock.
    """
    migrations = discover(sql_dir or default_sql_dir())
    await conn.execute("SELECT pg_advisory_lock($1)", locks.MIGRATIONS_KEY)
    try:
        await conn.execute(_CREATE_TABLE)
        todo = check(migrations, await applied(conn))
        for migration in todo:
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
        return todo
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", locks.MIGRATIONS_KEY)
