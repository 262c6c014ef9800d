"""Live updates: a Server-Sent Events stream per open page that says "something changed"; the
page's script then fetches itself again and swaps its main part (static/ui.js). The stream never
carries data, only the notice, so nothing on it can leak what a page would not show.

A stream wakes on this replica's event-feed watcher (held as an installation-wide read, counted
against the admin key's cap like any held read) and on enqueues this replica's listener hears.
It sends at most one notice per `live_min_interval_seconds`, a comment every
`live_keepalive_seconds` when idle, and ends after `live_stream_max_seconds` or at shutdown (the
browser reconnects by itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import anyio
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from controlplane.errors import RateLimited
from controlplane.web.ui.roles import Principal
from controlplane.web.ui.sessions import Deps, principal

CHANGE = b"event: change\ndata: changed\n\n"
KEEPALIVE = b": keepalive\n\n"


async def first_of(events: Sequence[anyio.Event], seconds: float) -> bool:
    """Wait until any of `events` is set (True) or `seconds` pass (False)."""
    woke = False
    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as group:

            async def wait(event: anyio.Event) -> None:
                nonlocal woke
                await event.wait()
                woke = True
                group.cancel_scope.cancel()

            for event in events:
                group.start_soon(wait, event)
    return woke


async def _notices(svc: Deps, who: Principal) -> AsyncIterator[bytes]:
    knobs = svc.settings.pages
    deadline = anyio.current_time() + knobs.live_stream_max_seconds
    svc.pulse.watchers += 1
    try:
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(svc.feed.hold(who.key.id, None))
                feed = True
            except RateLimited:  # the key holds its cap of feed reads: enqueues still wake us
                feed = False
            yield b"retry: 1000\n\n"
            while not svc.closing.is_set():
                left = deadline - anyio.current_time()
                if left <= 0:
                    return
                wakes = [svc.pulse.changed(), svc.closing]
                if feed:
                    wakes.append(svc.feed.wake_for(None))
                woke = await first_of(wakes, min(left, knobs.live_keepalive_seconds))
                if svc.closing.is_set():
                    return
                yield CHANGE if woke else KEEPALIVE
                if woke:
                    with anyio.move_on_after(min(knobs.live_min_interval_seconds, left)):
                        await svc.closing.wait()
    finally:
        svc.pulse.watchers -= 1


async def stream(svc: Deps, request: Request) -> Response:
    who = await principal(svc, request)
    if who is None:
        return PlainTextResponse("sign in first", status_code=401)
    return StreamingResponse(
        _notices(svc, who),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
