from __future__ import annotations

import shutil
from pathlib import Path

import asyncpg
import pytest

from controlplane.errors import MigrationError
from controlplane.store import migrations


async def test_migrate_twice_second_run_changes_nothing(empty_database_url: str) -> None:
    conn = await asyncpg.connect(empty_database_url)
    try:
        first = await migrations.migrate(conn)
        assert [m.version for m in first] == [
            m.version for m in migrations.discover(migrations.default_sql_dir())
        ]
        before = await conn.fetch("SELECT version, checksum, applied_at FROM schema_migrations")
        second = await migrations.migrate(conn)
        after = await conn.fetch("SELECT version, checksum, applied_at FROM schema_migrations")
        assert second == []
        assert before == after
        assert await migrations.pending(conn) == []
    finally:
        await conn.close()


async def test_edited_applied_migration_is_refused(empty_database_url: str, tmp_path: Path) -> None:
    sql_dir = tmp_path / "sql"
    shutil.copytree(migrations.default_sql_dir(), sql_dir)
    conn = await asyncpg.connect(empty_database_url)
    try:
        await migrations.migrate(conn, sql_dir)
        first = sorted(sql_dir.glob("*.sql"))[0]
        first.write_text(first.read_text() + "\n-- edited\n")
        extra = sql_dir / "9999_never_applied.sql"
        extra.write_text("CREATE TABLE must_not_exist (id int);")
        with pytest.raises(MigrationError, match="edited after it was applied"):
            await migrations.migrate(conn, sql_dir)
        assert await conn.fetchval("SELECT to_regclass('must_not_exist')") is None
    finally:
        await conn.close()


async def test_missing_file_of_applied_migration_is_refused(
    empty_database_url: str, tmp_path: Path
) -> None:
    sql_dir = tmp_path / "sql"
    shutil.copytree(migrations.default_sql_dir(), sql_dir)
    (sql_dir / "9000_later.sql").write_text("CREATE TABLE later_table (id int);")
    conn = await asyncpg.connect(empty_database_url)
    try:
        await migrations.migrate(conn, sql_dir)
        (sql_dir / "9000_later.sql").unlink()
        with pytest.raises(MigrationError, match="newer than this code"):
            await migrations.migrate(conn, sql_dir)
    finally:
        await conn.close()


def test_bad_file_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "1_x.sql").write_text("")
    with pytest.raises(MigrationError, match=r"0001_name\.sql"):
        migrations.discover(tmp_path)
    (tmp_path / "1_x.sql").unlink()
    (tmp_path / "0001_a.sql").write_text("")
    (tmp_path / "0001_b.sql").write_text("")
    with pytest.raises(MigrationError, match="share number"):
        migrations.discover(tmp_path)


async def test_failed_migration_is_rolled_back_and_not_recorded(
    empty_database_url: str, tmp_path: Path
) -> None:
    (tmp_path / "0001_ok.sql").write_text("CREATE TABLE ok_table (id int);")
    (tmp_path / "0002_broken.sql").write_text("CREATE TABLE half (id int); SELECT nonsense();")
    conn = await asyncpg.connect(empty_database_url)
    try:
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await migrations.migrate(conn, tmp_path)
        assert await conn.fetchval("SELECT to_regclass('half')") is None
        versions = await conn.fetch("SELECT version FROM schema_migrations")
        assert [row["version"] for row in versions] == [1]
    finally:
        await conn.close()
