"""Who can reach the embedded PostgreSQL: TCP needs the secret from `var/`, nothing prints it.

Each test starts its own server on a fresh data folder, laid out as the daemon lays it out
(`<tmp>/var/postgres`, the secret in `<tmp>/var/postgres.secret`), never the session's server.
"""

from __future__ import annotations

import os
import pwd
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from controlplane.store.embedded import (
    SERVER_USER,
    EmbeddedPostgres,
    EmbeddedPostgresError,
    _bin_dir,
    free_port,
)

AS_ROOT = os.geteuid() == 0
NO_PASSFILE = "/nonexistent/.pgpass"


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A fresh folder in /tmp, not under pytest's tmp_path: as root the server user must traverse
    its ancestors, and every pytest session that starts on this machine (ours or a neighbour's)
    resets /tmp/pytest-of-root to 0700."""
    with tempfile.TemporaryDirectory(prefix="cp-test-embedded-") as folder:
        yield Path(folder)


@pytest.fixture
def var(workdir: Path) -> Path:
    return workdir / "var"


@pytest.fixture
def server(var: Path) -> Iterator[EmbeddedPostgres]:
    """A server object on a fresh folder, not started; whatever runs on the folder is stopped."""
    created = EmbeddedPostgres(var / "postgres", durable=False, max_connections=20)
    try:
        yield created
    finally:
        _stop_any(var / "postgres")


def _stop_any(data_dir: Path) -> None:
    leftover = EmbeddedPostgres(data_dir)
    if leftover.initialised() and leftover.running():
        leftover.stop("immediate")


def _without_password(port: int) -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


async def _connects(url: str) -> str:
    # No ~/.pgpass or $PGPASSWORD may stand in for a missing password.
    conn = await asyncpg.connect(url, passfile=NO_PASSFILE, timeout=30)
    try:
        user: str = await conn.fetchval("SELECT current_user")
        return user
    finally:
        await conn.close()


async def _refused(url: str) -> None:
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError) as refused:
        await _connects(url)
    # InvalidPasswordError (28P01) is the subclass PostgreSQL answers for a wrong or missing one.
    assert isinstance(refused.value, asyncpg.InvalidPasswordError)


def _secret_path(server: EmbeddedPostgres) -> Path:
    # Where docs/operations.md says it is: beside the data folder, in the same var/.
    return server.data_dir.parent / f"{server.data_dir.name}.secret"


def _secret(server: EmbeddedPostgres) -> str:
    return _secret_path(server).read_text().strip()


def _host_rules(data_dir: Path) -> list[list[str]]:
    lines = (data_dir / "pg_hba.conf").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


@pytest.fixture(autouse=True)
def _no_password_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGPASSWORD", raising=False)


async def test_tcp_needs_the_secret_kept_beside_the_data_folder(
    server: EmbeddedPostgres,
) -> None:
    url = await anyio.to_thread.run_sync(server.start)
    await _refused(_without_password(server.port))
    wrong = f"postgresql://postgres:{secrets.token_urlsafe(32)}@127.0.0.1:{server.port}/postgres"
    await _refused(wrong)
    assert await _connects(url) == "postgres"
    secret = _secret(server)
    assert len(secret) >= 43  # token_urlsafe(32): 256 bits
    assert f"postgres:{secret}@" in url
    assert server.masked_url == f"postgresql://postgres:***@127.0.0.1:{server.port}/postgres"
    # Every rule for TCP asks for the password; only the Unix socket (in the 0700 folder) trusts.
    rules = _host_rules(server.data_dir)
    assert {rule[-1] for rule in rules if rule[0] == "host"} == {"scram-sha-256"}
    assert [rule for rule in rules if rule[-1] == "trust"] == [["local", "all", "all", "trust"]]

    # Another process on the same var/ (a replica, the CLI) finds the secret by itself.
    sharing = EmbeddedPostgres(server.data_dir)
    assert await anyio.to_thread.run_sync(sharing.start) == url
    assert not sharing.owned
    assert await _connects(sharing.url) == "postgres"


async def test_secret_file_and_socket_folder_are_private(
    server: EmbeddedPostgres,
) -> None:
    previous = os.umask(0)  # the widest umask: the modes must not depend on it
    try:
        await anyio.to_thread.run_sync(server.start)
    finally:
        os.umask(previous)
    secret_file = _secret_path(server)
    info = secret_file.stat()
    assert oct(info.st_mode & 0o7777) == "0o600"
    assert info.st_uid == os.geteuid()
    assert [p.name for p in secret_file.parent.iterdir() if ".secret." in p.name] == []
    folder = server.data_dir.stat()
    assert oct(folder.st_mode & 0o7777) == "0o700"
    server_uid = pwd.getpwnam(SERVER_USER).pw_uid if AS_ROOT else os.geteuid()
    assert folder.st_uid == server_uid
    assert (server.data_dir / f".s.PGSQL.{server.port}").exists()  # the socket is in there


@pytest.mark.skipif(not AS_ROOT, reason="needs root to act as another local user")
async def test_another_local_user_can_neither_read_the_secret_nor_connect(
    server: EmbeddedPostgres,
) -> None:
    await anyio.to_thread.run_sync(server.start)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PGCONNECT_TIMEOUT": "10"}

    def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command,
            user="nobody",
            group="nogroup",
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    psql = str(_bin_dir() / "psql")
    query = ["-U", "postgres", "-p", str(server.port), "-w", "-c", "SELECT 1", "postgres"]
    over_tcp = as_nobody(psql, "-h", "127.0.0.1", *query)
    assert over_tcp.returncode != 0
    assert "password" in over_tcp.stderr
    over_socket = as_nobody(psql, "-h", str(server.data_dir), *query)
    assert over_socket.returncode != 0
    assert "Permission denied" in over_socket.stderr
    read = as_nobody("cat", str(_secret_path(server)))
    assert read.returncode != 0
    assert "Permission denied" in read.stderr


async def test_a_folder_that_older_code_set_up_to_trust_tcp_is_upgraded_in_place(
    server: EmbeddedPostgres,
) -> None:
    # What 78daf06 did: initdb --auth=trust, then a server on loopback that trusts TCP.
    server.data_dir.parent.mkdir(parents=True)
    server._prepare_permissions()  # as root: the folder, owned by the server user
    server.data_dir.mkdir(mode=0o700, exist_ok=True)
    initdb = server._run(
        ["initdb", "-D", str(server.data_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
    )
    assert initdb.returncode == 0, initdb.stderr
    assert ["host", "all", "all", "127.0.0.1/32", "trust"] in _host_rules(server.data_dir)
    port = free_port()
    options = f"-h 127.0.0.1 -p {port} -k {server.data_dir}"
    log = str(server.log_file)
    started = server._run(
        ["pg_ctl", "-D", str(server.data_dir), "-l", log, "-w", "-o", options, "start"]
    )
    assert started.returncode == 0, started.stderr
    conn = await asyncpg.connect(_without_password(port), passfile=NO_PASSFILE)
    try:  # trusted, as the issue saw it; and data to find again after the upgrade
        await conn.execute("CREATE TABLE kept (id int); INSERT INTO kept VALUES (7)")
    finally:
        await conn.close()
    server.stop()

    server.port = port
    url = await anyio.to_thread.run_sync(server.start)
    await _refused(_without_password(port))
    assert await _connects(url) == "postgres"
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT id FROM kept") == 7
    finally:
        await conn.close()
    assert oct(_secret_path(server).stat().st_mode & 0o7777) == "0o600"
    assert {rule[-1] for rule in _host_rules(server.data_dir) if rule[0] == "host"} == {
        "scram-sha-256"
    }


async def test_deleting_the_secret_while_stopped_rotates_the_password(
    server: EmbeddedPostgres,
) -> None:
    old_url = await anyio.to_thread.run_sync(server.start)
    old_secret = _secret(server)
    await anyio.to_thread.run_sync(server.stop)
    _secret_path(server).unlink()

    new_url = await anyio.to_thread.run_sync(server.start)
    assert _secret(server) != old_secret
    await _refused(old_url)
    assert await _connects(new_url) == "postgres"


async def test_a_running_server_whose_secret_file_is_gone_is_not_shared(
    server: EmbeddedPostgres,
) -> None:
    url = await anyio.to_thread.run_sync(server.start)
    _secret_path(server).unlink()
    with pytest.raises(EmbeddedPostgresError, match="stop every process using this folder"):
        await anyio.to_thread.run_sync(EmbeddedPostgres(server.data_dir).start)
    assert not _secret_path(server).exists()  # no new secret the running server does not know
    assert await _connects(url) == "postgres"


async def test_a_secret_file_others_can_read_is_refused(
    server: EmbeddedPostgres,
) -> None:
    await anyio.to_thread.run_sync(server.start)
    await anyio.to_thread.run_sync(server.stop)
    _secret_path(server).chmod(0o644)
    with pytest.raises(EmbeddedPostgresError, match="no one else can read or write"):
        await anyio.to_thread.run_sync(server.start)
    assert not server.running()


def _environment(**extra: str) -> dict[str, str]:
    """Ours, minus anything that configures a database: the processes must find var/ alone."""
    kept = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("CONTROLPLANE_", "PG")) and name != "DATABASE_URL"
    }
    return {**kept, "CONTROLPLANE_SERVER_PORT": "0", **extra}


async def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    with anyio.fail_after(120):
        return await anyio.run_process(
            [sys.executable, "-m", "controlplane.cli", *args],
            cwd=cwd,
            env=_environment(),
            check=False,
        )


@pytest.mark.system
async def test_serve_and_the_cli_share_var_and_never_print_the_secret(workdir: Path) -> None:
    log = workdir / "serve.log"
    with log.open("wb") as sink:
        serve = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "serve"],
            cwd=workdir,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=sink,
        )
    assert serve.stdout is not None
    printed: list[bytes] = []
    try:
        with anyio.fail_after(120):  # a new folder: initdb first
            printed.append(await anyio.to_thread.run_sync(serve.stdout.readline))
        assert printed[0].startswith(b"controlplane listening on "), log.read_text()[-3000:]

        tokens = await _cli(workdir, "tokens", "create", "admin", "--name", "shared var")
        migrate = await _cli(workdir, "migrate")
        assert tokens.returncode == 0, tokens.stderr.decode()
        assert migrate.returncode == 0, migrate.stderr.decode()
        assert migrate.stdout == b"database is up to date\n"
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            printed.append(serve.communicate(timeout=30)[0])
        finally:
            if serve.poll() is None:
                serve.kill()
                serve.wait()
            _stop_any(workdir / "var" / "postgres")
    assert serve.returncode == 0
    logged = log.read_text()
    assert '"event":"embedded_postgres.started"' in logged
    assert "postgresql://postgres:***@127.0.0.1:" in logged
    secret = (workdir / "var" / "postgres.secret").read_text().strip()
    everything = [
        logged,
        b"".join(printed).decode(),
        *(out.decode() for result in (tokens, migrate) for out in (result.stdout, result.stderr)),
        (workdir / "var" / "postgres.log").read_text(),
    ]
    assert [text for text in everything if secret in text] == []


@pytest.mark.system
async def test_dev_prints_the_database_url_without_its_password(workdir: Path) -> None:
    log = workdir / "dev.log"
    with log.open("wb") as sink:
        dev = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "dev", "--runners", "1"],
            cwd=workdir,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=sink,
        )
    assert dev.stdout is not None
    banner: list[str] = []
    try:
        with anyio.fail_after(120):
            while not banner or "Ctrl-C stops everything" not in banner[-1]:
                banner.append((await anyio.to_thread.run_sync(dev.stdout.readline)).decode())
                assert banner[-1], f"dev exited early: {log.read_text()[-3000:]}"
    finally:
        dev.send_signal(signal.SIGINT)
        try:
            rest = dev.communicate(timeout=60)[0].decode()
        finally:
            if dev.poll() is None:
                dev.kill()
                dev.wait()
            _stop_any(workdir / "var" / "postgres")
    database = [line.split() for line in banner if line.split()[:1] == ["database"]]
    assert len(database) == 1
    assert database[0][1].startswith("postgresql://postgres:***@127.0.0.1:")
    logged = log.read_text()
    assert "postgresql://postgres:***@127.0.0.1:" in logged  # the embedded_postgres.started line
    secret = (workdir / "var" / "postgres.secret").read_text().strip()
    assert secret not in "".join(banner) + rest + logged
