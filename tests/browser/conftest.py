"""A real browser: Playwright for Python driving Debian's `chromium` package (Playwright's own
browser download cannot run here). .ci/run installs the package when it can; where it is not
installed these tests skip, saying so."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator

import pytest
from playwright.async_api import Browser, async_playwright

from tests.system.conftest import spawn_daemon  # noqa: F401 -- the fixture, for these tests too


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("no `chromium` on PATH: install Debian's package (apt-get install -y chromium)")
    # As root Chromium refuses its sandbox; the pages it opens here are our own.
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=path, args=args)
        try:
            yield launched
        finally:
            await launched.close()
