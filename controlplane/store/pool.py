"""The asyncpg pool, with the settings and deadlines every connection carries.

Every connection gets a statement timeout (so a lock wait can never hang a request forever) and
an application name. Client-side deadlines cover what the server cannot: a connection that stops
answering at all. Waiting for a pooled connection, or opening one, is bounded by
`acquire_timeout_seconds`, and every statement by `command_timeout_seconds`, which is longer than
the statement timeout so that, while the server answers, its own timeout fires first. A
connection that missed a deadline or failed under us is in an unknown state: it is terminated,
not returned to the pool, and the pool opens a fresh one on demand, so the daemon recovers by
itself once the database answers again.

How the command deadline is kept differs by connection. A dedicated connection (`connect`) has
asyncpg's `command_timeout`, a timer armed and cancelled around every statement. A pooled one has
no per-statement timer (2 to 13 us of CPU per statement in two micro-benchmarks, about a dozen
statements per job): the pool's watchdog (`DeadlinePool`) looks at every lent connection a few
times a second and terminates one that has sent no new statement for `command_timeout_seconds`.
So a statement (or a borrow that waits on something else with its connection held) is cut after
the deadline and at most two sweeps later: `min(0.25 s, 5 %)` each, so within 10 % or 0.5 s of
it. The statement waiting on the terminated connection fails with a lost connection:
DatabaseUnavailable. A release waiting on a cancel request is watched the same way (terminating
the connection also ends the cancel request's task, which asyncpg would bound by
`command_timeout`, None on these connections).

asyncpg's faults stop here. Whatever asks the pool for a connection (`async with
pool.acquire()`, `borrow`, or the pool's own `fetch`/`execute`) gets `DatabaseUnavailable` for
every fault of `UNAVAILABLE`: failing to connect or to get a connection in time, a connection
lost or gone silent mid-statement, the server cancelling a statement (statement timeout, 57014)
or a lock wait (lock timeout, 55P03), or refusing connections (57P03). The translation is at the
borrow's exit, so every statement run on the connection is covered, and store code inside the
borrow still sees asyncpg's own errors, to handle those it expects (a lock timeout that means
"someone else is at it", a constraint). Other errors (constraint violations, SQL bugs) pass
through as asyncpg raised them. Dedicated connections (`connect`) are the actors' own: opening
one fails with `DatabaseUnavailable`; their users retry on any fault after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import asyncpg
from asyncpg.pool import PoolAcquireContext, PoolConnectionProxy

from controlplane.errors import DatabaseUnavailable

log = logging.getLogger("controlplane.pool")

Pool = asyncpg.Pool
# A store function runs on a dedicated connection or on one borrowed from the pool.
Conn = asyncpg.Connection | PoolConnectionProxy

P = ParamSpec("P")
T = TypeVar("T")

# Faults that mean the database cannot serve us now, whatever we asked: answered as
# DatabaseUnavailable (503 with Retry-After over HTTP), never as a bug of ours.
UNAVAILABLE: tuple[type[Exception], ...] = (
    OSError,  # TimeoutError (a client-side deadline) is one
    asyncpg.PostgresConnectionError,  # class 08, and 57P03 cannot-connect-now
    asyncpg.InterfaceError,
    asyncpg.QueryCanceledError,  # 57014: statement_timeout
    asyncpg.LockNotAvailableError,  # 55P03: lock_timeout
    asyncpg.CannotConnectNowError,
)

# Faults after which a connection cannot be trusted (a statement may still be running, or the
# protocol is mid-message): drop it rather than wait for a cancel the server may never answer.
BROKEN_CONNECTION: tuple[type[Exception], ...] = (
    TimeoutError,
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
)


@dataclass(frozen=True)
class PoolSettings:
    url: str
    min_size: int = 2
    max_size: int = 20
    statement_timeout_ms: int = 10_000
    lock_timeout_ms: int = 5_000
    acquire_timeout_seconds: float = 5.0
    command_timeout_seconds: float = 15.0
    application_name: str = "controlplane"


def server_settings(settings: PoolSettings) -> dict[str, str]:
    return {
        "statement_timeout": str(settings.statement_timeout_ms),
        "lock_timeout": str(settings.lock_timeout_ms),
        "application_name": settings.application_name,
        "timezone": "UTC",
    }


async def _no_session_state(_conn: asyncpg.Connection) -> None:
    """Release without asyncpg's reset round trip (unlock all, UNLISTEN, RESET ALL).

    asyncpg still rolls back an open transaction and drops listeners before calling this. The
    rest has nothing to undo: pooled connections never take session advisory locks (those live
    on dedicated connections, see locks.py), never LISTEN and never SET. Skipping it saves one
    round trip per borrowed connection, inside every dispatch.
    """


class PooledConnection(asyncpg.Connection):
    """A pool's connection. A transaction still open at its release is rolled back here and
    logged at info, instead of asyncpg's "Resetting connection with an active transaction"
    through the event loop's exception handler (printed as an error). That happens when a task is
    cancelled inside `async with conn.transaction()`, a daemon's stop above all: the cancellation
    also cuts short the ROLLBACK on the way out. asyncpg would roll back all the same; nothing
    was ever lost, the message only alarmed. A transaction left open by mistake is logged too.

    `_reset` is asyncpg's release step before the pool's `reset` hook (`_no_session_state`);
    pyproject bounds asyncpg to the releases whose internals we read (tests/store/test_pool.py
    fails if this one moves)."""

    async def _reset(self) -> None:
        if self.is_in_transaction():
            log.info("pool.rolled_back_on_release")
            self._top_xact = None
            await self.execute("ROLLBACK")
        await super()._reset()


def _drop(conn: PoolConnectionProxy) -> None:
    """Terminate a borrowed connection that failed under its user. One that closed by itself
    is already detached from its proxy (asyncpg released it), and there is nothing to drop."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()  # detaches it from the pool; the release is a no-op


def unavailable(error: Exception) -> DatabaseUnavailable:
    """The domain error for a fault of `UNAVAILABLE` (raise it `from error`)."""
    return DatabaseUnavailable("database unavailable; retry")


class _Borrowed(PoolAcquireContext):
    """`async with pool.acquire()`: a connection that failed under its user is terminated, and
    the faults of `UNAVAILABLE`, in the acquire, the body or the release, leave as
    `DatabaseUnavailable`."""

    async def __aenter__(self) -> PoolConnectionProxy:
        try:
            return await super().__aenter__()
        except UNAVAILABLE as error:
            raise unavailable(error) from error

    async def __aexit__(self, *exc: object) -> None:
        error = exc[1]
        if self.connection is not None and isinstance(error, BROKEN_CONNECTION):
            _drop(self.connection)
        try:
            await super().__aexit__(*exc)
        except UNAVAILABLE as failed:
            raise unavailable(failed) from failed
        if isinstance(error, UNAVAILABLE):
            raise unavailable(error) from error


class DeadlinePool(asyncpg.Pool):
    """asyncpg's pool whose every acquire, wherever it is written, has a deadline, and whose
    lent connections have the command deadline (the module's docstring says how).

    The acquire deadline is armed only when the acquire may wait: with an idle connection in
    the pool, asyncpg hands one over without waiting (nothing can hang there; a connection it
    has to open has `connect`'s own timeout, the same number), so the timer would be pure cost,
    paid twice per request (asyncpg also bounds the release by the acquire's timeout; the
    release's only round trip, a ROLLBACK after a failed transaction, is watched like any
    statement). Measured on the throughput benchmark's profile: about 3% of a replica's CPU per
    job.

    The watchdog costs nothing per statement or per borrow: it reads what asyncpg keeps anyway,
    each holder's "in use" future (one per borrow) and its connection's count of statements
    sent. A lent connection whose borrow and count are both unchanged since a sweep at least
    `command_deadline` ago is terminated.
    """

    _holders: list[Any]  # asyncpg's PoolConnectionHolder objects (asyncpg.pool has no stubs)

    def __init__(
        self, *args: Any, acquire_timeout: float, command_deadline: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.acquire_timeout = acquire_timeout
        self.command_deadline = command_deadline
        self.sweep_seconds = min(0.25, command_deadline / 20)
        # holder -> (its borrow's future, statements sent, when this pair was first seen)
        self._seen: dict[object, tuple[object, int, float]] = {}
        self._sweeper: asyncio.TimerHandle | None = None

    def acquire(self, *, timeout: float | None = None) -> _Borrowed:
        if timeout is None and not self._free_holders():
            timeout = self.acquire_timeout
        return _Borrowed(self, timeout)

    def _free_holders(self) -> int:
        """Holders waiting in asyncpg's queue: an acquire takes one at once (opening its
        connection if it has none, under connect's own timeout). The queue's size is one
        attribute read; `get_idle_size()`, the public way, walks every holder (1.7% of a
        replica's CPU per job when it was used here)."""
        queue = getattr(self, "_queue", None)
        return queue.qsize() if queue is not None else self.get_idle_size()

    def start_watchdog(self) -> None:
        """Sweep the lent connections every `sweep_seconds` until the pool closes."""
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.sweep_seconds, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweeper = loop.call_later(self.sweep_seconds, self._sweep, loop)
        now = loop.time()
        seen: dict[object, tuple[object, int, float]] = {}
        for holder in self._holders:
            borrow, conn = holder._in_use, holder._con
            if borrow is None or conn is None or conn.is_closed():
                continue
            sent = conn._protocol.queries_count
            before = self._seen.get(holder)
            if before is None or before[0] is not borrow or before[1] != sent:
                seen[holder] = (borrow, sent, now)
            elif now - before[2] >= self.command_deadline:
                log.warning(
                    "pool.command_deadline",
                    extra={"pid": conn.get_server_pid(), "seconds": self.command_deadline},
                )
                conn.terminate()  # the statement waiting on it fails: connection lost
            else:
                seen[holder] = before
        self._seen = seen

    def _stop_watchdog(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def close(self) -> None:
        self._stop_watchdog()
        await super().close()

    def terminate(self) -> None:
        self._stop_watchdog()
        super().terminate()


def _connect_options(settings: PoolSettings, *, command_timeout: bool) -> dict[str, Any]:
    """Options of every connection; asyncpg's per-statement `command_timeout` on dedicated ones
    only (pooled ones have the pool's watchdog)."""
    return {
        "server_settings": server_settings(settings),
        "timeout": settings.acquire_timeout_seconds,
        "command_timeout": settings.command_timeout_seconds if command_timeout else None,
    }


async def create_pool(settings: PoolSettings) -> Pool:
    pool = DeadlinePool(
        settings.url,
        acquire_timeout=settings.acquire_timeout_seconds,
        command_deadline=settings.command_timeout_seconds,
        min_size=settings.min_size,
        max_size=settings.max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        loop=None,
        connection_class=PooledConnection,
        record_class=asyncpg.Record,
        reset=_no_session_state,
        **_connect_options(settings, command_timeout=False),
    )
    try:
        await pool
    except (OSError, asyncpg.PostgresConnectionError) as error:  # TimeoutError is an OSError
        raise DatabaseUnavailable(f"cannot connect to the database: {error!r}") from error
    pool.start_watchdog()
    return pool


@contextlib.asynccontextmanager
async def borrow(pool: Pool) -> AsyncIterator[PoolConnectionProxy]:
    """A pooled connection whose release cannot fail the caller.

    asyncpg resets a connection on release and, when the reset fails (the server went away just
    after our statement committed), terminates it and re-raises. Work that committed must not be
    reported as failed, least of all a claim, which would then never reach its runner: the
    connection is already terminated, so we log and carry on. Faults of `UNAVAILABLE` in the
    acquire or the body leave as `DatabaseUnavailable`.
    """
    try:
        conn = await pool.acquire()
    except UNAVAILABLE as error:
        raise unavailable(error) from error
    try:
        yield conn
    except UNAVAILABLE as error:
        if isinstance(error, BROKEN_CONNECTION):
            _drop(conn)
        raise unavailable(error) from error
    finally:
        try:
            await pool.release(conn)
        except Exception as error:
            log.warning("pool.release_failed", extra={"error": repr(error)})


class PoolAdapter:
    """The base of an actor's store over the pool (the `Pool...Store` beside each maintenance
    job and sweep): each of its methods runs store functions on a connection borrowed for that
    call alone, so the actor holds no connection between calls."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def _on_pool(
        self,
        statement: Callable[Concatenate[Conn, P], Awaitable[T]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """`statement(conn, *args, **kwargs)` on a borrowed connection."""
        async with self._pool.acquire() as conn:
            return await statement(conn, *args, **kwargs)


async def connect(settings: PoolSettings) -> asyncpg.Connection:
    """A dedicated connection, outside the pool (session locks, LISTEN), with the pool's
    deadlines: opening it within `acquire_timeout_seconds`, each statement within
    `command_timeout_seconds`."""
    try:
        return await asyncpg.connect(
            settings.url, **_connect_options(settings, command_timeout=True)
        )
    except (OSError, asyncpg.PostgresConnectionError) as error:
        raise DatabaseUnavailable(f"cannot connect to the database: {error!r}") from error
