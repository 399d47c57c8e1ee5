"""Fixtures for the dashboard tests: the real polyak server, a training
process feeding it through the Python client, and headless Chromium driven
by Playwright (Debian's ``chromium``; Playwright's own browsers are not
used). The fixtures every test tree shares (``polyak_binary``,
``backends``, ...) come from :mod:`polyak_testing.plugin`."""

from __future__ import annotations

import polyak
import pytest
from dashkit import (
    CHROMIUM_ARGS,
    PROFILES,
    RUN,
    WIDTHS,
    WORLD_SIZE,
    ConsoleErrors,
    Feeder,
    chromium_path,
)
from playwright.sync_api import Browser, Page, sync_playwright
from polyak_testing import PolyakServer


@pytest.fixture(scope="session")
def dash_server(tmp_path_factory: pytest.TempPathFactory, polyak_binary: str):
    srv = PolyakServer(tmp_path_factory.mktemp("dashboard-data"), binary=polyak_binary)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def feeder(dash_server):
    client = polyak.Client(dash_server.url)
    client.create_run(RUN, world_size=WORLD_SIZE, update_every=1, profiles=PROFILES, drift_every=1)
    client.close()
    feed = Feeder(dash_server.url, RUN)
    try:
        feed.wait_step(5)
        yield feed
    finally:
        feed.stop()


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture()
def console() -> ConsoleErrors:
    return ConsoleErrors()


@pytest.fixture()
def page(browser: Browser, console: ConsoleErrors):
    context = browser.new_context(
        viewport={"width": WIDTHS[0], "height": 900}, accept_downloads=True
    )
    pg: Page = context.new_page()
    pg.set_default_timeout(30_000)
    pg.on(
        "console",
        lambda msg: console.errors.append(f"console: {msg.text}") if msg.type == "error" else None,
    )
    pg.on("pageerror", lambda err: console.errors.append(f"pageerror: {err}"))
    # Nothing may come from outside the server (no CDN, no fonts).
    pg.on(
        "request",
        lambda req: (
            None
            if req.url.startswith(("http://127.0.0.1:", "data:", "blob:"))
            else console.errors.append(f"request outside the server: {req.url}")
        ),
    )
    yield pg
    context.close()
    assert console.unexpected() == [], "the page logged errors"
