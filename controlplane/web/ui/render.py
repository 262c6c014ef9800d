"""Rendering: the Jinja2 environment over the package's templates, the headers every page
carries, and the few formatting rules the templates share (ages, masking)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse

from controlplane.web.ui import roles
from controlplane.web.ui.roles import Principal

HERE = Path(__file__).parent
MASK = "••••••"

# Nothing from elsewhere: scripts, styles, images and connections are our own origin's only.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    # same-origin, not no-referrer: with no-referrer a browser sends `Origin: null` on our own
    # form posts, and sessions.py refuses those.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def age(when: datetime | None, now: datetime | None = None) -> str:
    """How long ago, in the largest unit that fits: '42 s', '3 min', '2 h 5 min', '3 d'."""
    if when is None:
        return "–"
    seconds = max(0, int(((now or datetime.now(UTC)) - when).total_seconds()))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86_400:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 86_400} d"


def stamp(when: datetime | None) -> str:
    return "–" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def masked(payload: dict[str, Any]) -> str:
    """The payload as indented JSON with every value of its `env` masked: env is where a job's
    secrets travel, and a page is no place for them."""
    shown = dict(payload)
    env = shown.get("env")
    if isinstance(env, dict):
        shown["env"] = dict.fromkeys(env, MASK)
    elif env is not None:
        shown["env"] = MASK
    return msgspec.json.format(msgspec.json.encode(shown), indent=2).decode()


_env = jinja2.Environment(
    loader=jinja2.FileSystemLoader(HERE / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters["age"] = age
_env.filters["stamp"] = stamp
_env.filters["labels"] = lambda labels: ", ".join(labels) if labels else "–"


def page(
    request: Request,
    template: str,
    who: Principal | None,
    context: dict[str, Any],
    status: int = 200,
) -> HTMLResponse:
    """`template` rendered for the operator `who` (None: signed out), with the page headers."""
    html = _env.get_template(template).render(
        who=who,
        may_act=who is not None and roles.may_act(who),
        path=request.url.path,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=HEADERS)
