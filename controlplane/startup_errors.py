"""Start-up failures we can name, as one line each for the person at the terminal.

`serve`, `dev` and `migrate` fail before they do anything useful when the address is taken, the
database cannot be reached or refuses us, or a folder cannot be written. Those are the user's to
fix, so they get one line naming the thing and the fix, and exit code 2, instead of a traceback
(or, from inside a task group, an exception group of one).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import asyncpg

from controlplane.settings import Settings
from controlplane.store.embedded import EmbeddedPostgresError


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _database(config: Settings) -> str:
    if not config.database.url:
        return f"the embedded PostgreSQL in {config.database.embedded_data_dir}"
    parts = urlsplit(config.database.url)
    where = parts.hostname or "localhost"
    return f"the database at {where}:{parts.port or 5432}"


def _one(error: BaseException, config: Settings) -> str | None:
    server = config.server
    address = f"{server.host}:{server.port}"
    database = _database(config)
    if isinstance(error, EmbeddedPostgresError):
        return f"{error}; see the server log beside {config.database.embedded_data_dir}"
    if isinstance(
        error, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        return f"{database} refused our credentials ({error}); check DATABASE_URL"
    if isinstance(error, asyncpg.InvalidCatalogNameError):
        return f"{database}: {error}; create it, or fix the name in DATABASE_URL"
    if isinstance(error, asyncpg.CannotConnectNowError | asyncpg.TooManyConnectionsError):
        return f"{database} is not accepting connections ({error}); try again shortly"
    if isinstance(error, socket.gaierror):
        return f"cannot resolve the host of {database} ({error.strerror}); check DATABASE_URL"
    if isinstance(error, OSError):
        if error.errno == errno.EADDRINUSE:
            return (
                f"cannot listen on {address}: the address is in use (another controlplane?); "
                "pass --port, or set CONTROLPLANE_SERVER_PORT"
            )
        if error.errno == errno.EADDRNOTAVAIL:
            return f"cannot listen on {address}: no such address on this machine; pass --host"
        if error.errno == errno.EACCES and error.filename is None:
            return f"cannot listen on {address}: permission denied; pick a port above 1023"
        if isinstance(error, PermissionError | FileNotFoundError | NotADirectoryError):
            return f"cannot use {error.filename}: {error.strerror}"
        if isinstance(error, ConnectionRefusedError) or error.errno in (
            errno.ECONNREFUSED,
            errno.EHOSTUNREACH,
            errno.ENETUNREACH,
        ):
            return f"cannot reach {database} ({error.strerror}); is it running? check DATABASE_URL"
        if isinstance(error, TimeoutError):
            return f"cannot reach {database}: timed out; check DATABASE_URL"
    if isinstance(error, TimeoutError):
        return f"cannot reach {database}: timed out; check DATABASE_URL"
    return None


def explain(error: BaseException, config: Settings) -> str | None:
    """One line for a start-up failure we can name, or None for one we cannot (a bug: let its
    traceback through)."""
    for leaf in _leaves(error):
        # The store wraps a failed connect as Unavailable; what failed is its cause.
        for candidate in (leaf, leaf.__cause__):
            if candidate is not None and (line := _one(candidate, config)) is not None:
                return line
    return None
