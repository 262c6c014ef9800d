"""Signing in and out of the pages, and the checks every request and form meets.

A browser signs in by posting an admin key (or by opening a one-time link `controlplane dev`
prints); it gets a session cookie holding a random secret (HttpOnly, SameSite=Strict, Secure over
TLS, expiring with the session), of which the database keeps only the SHA-256. Every request looks
the session up and applies its admin key's refusals, so revoking the key signs it out.

CSRF: every form carries a token derived from the session's secret (HMAC-SHA256, so nothing more
is stored); every POST must carry it and come from our own origin when the browser says where
it comes from. The sign-in form, shown before any session exists, pairs a random value in a
short-lived SameSite=Strict cookie with the same value in the form.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from controlplane.actors.feed import FeedWatch
from controlplane.domain import credential_rules as rules
from controlplane.domain import tokens
from controlplane.domain.credentials import Credential
from controlplane.errors import ControlPlaneError
from controlplane.settings import Settings
from controlplane.store import credentials, ui_sessions
from controlplane.web.pauses import PauseHeard
from controlplane.web.ui.plots import QueueHistory
from controlplane.web.ui.pulse import Pulse
from controlplane.web.ui.render import page
from controlplane.web.ui.roles import Principal

SESSION_COOKIE = "cp_ui_session"
SIGN_IN_COOKIE = "cp_ui_sign_in"
_SIGN_IN_COOKIE_SECONDS = 600
_FORM_FIELDS = 20


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    feed: FeedWatch  # poked after an action adds to the event feed
    pulse: Pulse  # enqueues heard by this replica's listener
    closing: anyio.Event  # set at shutdown: live streams end
    history: QueueHistory  # the overview's plots
    heard: PauseHeard  # the dispatcher's `runner_paused` (web/pauses.py heard_here)


def csrf_of(secret: str) -> str:
    return hmac.new(secret.encode(), b"controlplane ui csrf", hashlib.sha256).hexdigest()


def _now() -> datetime:
    return datetime.now(UTC)


def _usable(key: Credential | None) -> Credential | None:
    if key is None or key.kind != "admin":
        return None
    try:
        rules.API_KEY.check(key, _now())
    except ControlPlaneError:
        return None
    return key


async def principal(svc: Deps, request: Request) -> Principal | None:
    """The signed-in operator of this request, or None (no, unknown, expired or signed-out
    session, or its admin key revoked or expired)."""
    secret = request.cookies.get(SESSION_COOKIE)
    if not secret or len(secret) > 100:
        return None
    async with svc.pool.acquire() as conn:
        found = await ui_sessions.by_secret(conn, secret)
    if found is None or _usable(found.key) is None:
        return None
    return Principal(session_id=found.session_id, key=found.key, csrf=csrf_of(secret))


async def signed_in(svc: Deps, request: Request) -> Principal:
    """The operator, or a redirect to the sign-in page (raised)."""
    found = await principal(svc, request)
    if found is None:
        raise HTTPException(303, headers={"Location": "/ui/sign-in"})
    return found


def _same_origin(request: Request) -> bool:
    """A browser names where a POST comes from; refuse one from elsewhere. A client that sends
    neither header still needs the CSRF token."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    ours = f"{request.url.scheme}://{request.url.netloc}"
    return origin == ours


async def form(svc: Deps, request: Request) -> dict[str, str]:
    """The urlencoded body of a POST, one value per field; 400 for anything else."""
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        raise HTTPException(400, "a form must be sent as application/x-www-form-urlencoded")
    limit = svc.settings.pages.form_max_bytes
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"a form is at most {limit} bytes")
    try:
        pairs = urllib.parse.parse_qsl(
            body.decode(), keep_blank_values=True, max_num_fields=_FORM_FIELDS, strict_parsing=False
        )
    except (UnicodeDecodeError, ValueError) as error:
        raise HTTPException(400, "the form does not decode") from error
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields or "\x00" in value:
            raise HTTPException(400, f"form field {name!r} is repeated or holds NUL")
        fields[name] = value
    return fields


async def checked_form(svc: Deps, request: Request, who: Principal) -> dict[str, str]:
    """A signed-in operator's form: same origin, and its CSRF token is this session's."""
    fields = await form(svc, request)
    sent = fields.pop("csrf", "")
    if not _same_origin(request) or not hmac.compare_digest(sent.encode(), who.csrf.encode()):
        raise HTTPException(403, "this form is not from this session (CSRF token missing or wrong)")
    return fields


def _strict_cookie(
    response: Response, request: Request, name: str, value: str, seconds: int, path: str
) -> None:
    """A cookie scripts cannot read, never sent from another site, over TLS only when we are."""
    response.set_cookie(
        name,
        value,
        max_age=seconds,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


async def _open_session(svc: Deps, request: Request, key: Credential, how: str) -> Response:
    ttl = svc.settings.pages.session_ttl_seconds
    async with svc.pool.acquire() as conn, conn.transaction():
        secret = await ui_sessions.create(conn, key.id, timedelta(seconds=ttl))
        await ui_sessions.audit(conn, "signed_in", key, details={"how": how})
    svc.feed.poke()
    response = RedirectResponse("/ui/", status_code=303)
    _strict_cookie(response, request, SESSION_COOKIE, secret, ttl, "/")
    response.delete_cookie(SIGN_IN_COOKIE, path="/ui/sign-in")
    return response


async def sign_in_form(svc: Deps, request: Request, problem: str | None = None) -> Response:
    value = secrets.token_urlsafe(24)
    response = page(
        request, "sign_in.html", None, {"pair": value, "problem": problem}, 401 if problem else 200
    )
    _strict_cookie(response, request, SIGN_IN_COOKIE, value, _SIGN_IN_COOKIE_SECONDS, "/ui/sign-in")
    return response


async def sign_in(svc: Deps, request: Request) -> Response:
    """GET: the form. POST: an admin key for a session cookie."""
    if request.method != "POST":
        return await sign_in_form(svc, request)
    fields = await form(svc, request)
    pair = request.cookies.get(SIGN_IN_COOKIE, "")
    if (
        not pair
        or not _same_origin(request)
        or not hmac.compare_digest(fields.get("pair", "").encode(), pair.encode())
    ):
        raise HTTPException(403, "this sign-in form is stale or not ours: reload it and retry")
    try:
        sha256 = tokens.parse_opaque(fields.get("key", "").strip(), tokens.Kind.ADMIN_KEY)
    except tokens.TokenError:
        return await sign_in_form(svc, request, "That is not an admin key.")
    async with svc.pool.acquire() as conn:
        key = _usable(await credentials.api_key_by_digest(conn, "admin", sha256))
    if key is None:
        return await sign_in_form(svc, request, "That admin key is unknown, revoked or expired.")
    return await _open_session(svc, request, key, "admin key")


async def sign_in_link(svc: Deps, request: Request) -> Response:
    """A one-time link: spent on first use, whatever follows."""
    secret = request.path_params["link"]
    if len(secret) > 100:
        raise HTTPException(404, "no such sign-in link")
    async with svc.pool.acquire() as conn:
        key_id = await ui_sessions.use_link(conn, secret)
        key = None if key_id is None else _usable(await credentials.api_key_by_id(conn, key_id))
    if key is None:
        return await sign_in_form(
            svc, request, "That sign-in link was used, has expired, or its key was revoked."
        )
    return await _open_session(svc, request, key, "one-time link")


async def sign_out(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    await checked_form(svc, request, who)
    async with svc.pool.acquire() as conn, conn.transaction():
        await ui_sessions.sign_out(conn, who.session_id)
        await ui_sessions.audit(conn, "signed_out", who.key)
    svc.feed.poke()
    response = RedirectResponse("/ui/sign-in", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
