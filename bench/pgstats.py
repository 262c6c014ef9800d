"""What a PostgreSQL server and a daemon did over a window of a benchmark (bench/footprint.py):
CPU of every server process and of the daemon (/proc), WAL written, transactions and rows per
table (pg_stat_database, pg_stat_user_tables), and the daemon's server sessions by kind.

CPU and the WAL position are read at a window's edges. Statistics counters reach pg_stat_* when
a backend goes idle, up to 10 s late, so they are read after `SETTLE_SECONDS` of quiet.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from bench import harness
from controlplane.store import locks

SETTLE_SECONDS = 12.0  # longer than a backend's 10 s idle flush of its statistics

TABLE_COUNTERS = ("n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def postgres_cpu_seconds(postmaster: int) -> float:
    """CPU of the whole server: the postmaster's own time and that of its reaped children (ended
    backends), plus every live child's (backends, walwriter, checkpointer, autovacuum)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = _stat(postmaster)
    total = sum(int(fields[index]) for index in (11, 12, 13, 14))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            child = _stat(int(entry.name))
        except OSError:  # ended meanwhile: its time is in the postmaster's reaped children's
            continue
        if int(child[1]) == postmaster:
            total += int(child[11]) + int(child[12])
    return total / tick


async def postmaster_pid(admin: asyncpg.Connection) -> int | None:
    """The server's postmaster, when it runs on this machine and we may read its data folder."""
    try:
        folder = await admin.fetchval("SELECT current_setting('data_directory')")
        pid = int((Path(folder) / "postmaster.pid").read_text().split()[0])
        _stat(pid)
    except (asyncpg.PostgresError, OSError, ValueError, IndexError):
        return None
    return pid


async def table_counters(conn: asyncpg.Connection) -> dict[str, dict[str, int]]:
    rows = await conn.fetch(
        "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del"
        " FROM pg_stat_user_tables ORDER BY relname"
    )
    return {row["relname"]: {name: int(row[name]) for name in TABLE_COUNTERS} for row in rows}


async def wal_lsn(admin: asyncpg.Connection) -> str:
    return str(await admin.fetchval("SELECT pg_current_wal_lsn()::text"))


async def wal_bytes(admin: asyncpg.Connection, before: str, after: str) -> int:
    return int(
        await admin.fetchval(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)", after, before
        )
    )


class Meter:
    """Readings of one window: CPU and WAL at its edges, statistics counters once settled."""

    def __init__(self, admin: asyncpg.Connection, db: asyncpg.Connection, daemon: int | None):
        self.admin, self.db, self.daemon = admin, db, daemon
        self.postmaster: int | None = None

    async def start(self) -> None:
        self.postmaster = await postmaster_pid(self.admin)

    async def edge(self) -> dict[str, Any]:
        """What can be read at once: time, CPU of each process, the WAL position."""
        return {
            "at": time.monotonic(),
            "pg_cpu": postgres_cpu_seconds(self.postmaster) if self.postmaster else None,
            "daemon_cpu": harness.cpu_seconds(self.daemon) if self.daemon else None,
            "client_cpu": harness.cpu_seconds(os.getpid()),
            "wal": await wal_lsn(self.admin),
        }

    async def counters(self) -> dict[str, Any]:
        return {
            "at": time.monotonic(),
            "database": await harness.database_counters(self.db),
            "tables": await table_counters(self.db),
        }

    async def window(
        self, first: dict[str, Any], last: dict[str, Any], before: dict[str, Any]
    ) -> dict[str, Any]:
        """Totals between two edges, and (settled now) the counters since `before`."""
        await anyio.sleep(SETTLE_SECONDS)
        after = await self.counters()
        return {
            "seconds": last["at"] - first["at"],
            "counter_seconds": after["at"] - before["at"],
            "pg_cpu": _minus(last["pg_cpu"], first["pg_cpu"]),
            "daemon_cpu": _minus(last["daemon_cpu"], first["daemon_cpu"]),
            "client_cpu": last["client_cpu"] - first["client_cpu"],
            "wal_bytes": await wal_bytes(self.admin, first["wal"], last["wal"]),
            "database": harness.counter_delta(before["database"], after["database"]),
            "tables": _table_delta(before["tables"], after["tables"]),
        }


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


def _table_delta(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    found = {}
    for table, counts in after.items():
        was = before.get(table, dict.fromkeys(TABLE_COUNTERS, 0))
        delta = {name: counts[name] - was[name] for name in TABLE_COUNTERS}
        if any(delta.values()):
            found[table] = delta
    return found


def _socket_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets process `pid` holds (its side of each connection)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


async def replica_connections(admin: asyncpg.Connection, pid: int) -> dict[str, int]:
    """The replica's server sessions by state and kind: pooled, LISTEN, and the leader lock's
    (held, or a follower's that tries again)."""
    leader = locks.LEADER_KEY & 0xFFFFFFFFFFFFFFFF
    rows = await admin.fetch(
        """
        SELECT a.state, a.query,
               EXISTS (SELECT 1 FROM pg_locks l
                       WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted
                         AND l.classid::bigint = $2 AND l.objid::bigint = $3) AS leader
        FROM pg_stat_activity a
        WHERE a.backend_type = 'client backend' AND a.client_port = ANY($1::int[])
        """,
        sorted(_socket_ports(pid)),
        leader >> 32,
        leader & 0xFFFFFFFF,
    )
    found = {"total": len(rows), "active": 0, "idle": 0, "idle_in_transaction": 0}
    found.update({"pool": 0, "listen": 0, "leader_lock": 0})
    for row in rows:
        state = (row["state"] or "").replace(" ", "_")
        if state in found:
            found[state] += 1
        # A follower keeps its lock session to try again: its last statement is the try.
        if row["leader"] or str(row["query"]).startswith("SELECT pg_try_advisory_lock"):
            found["leader_lock"] += 1
        elif row["query"] == "SELECT 1" or str(row["query"]).startswith("LISTEN"):
            found["listen"] += 1
        else:
            found["pool"] += 1
    return found
