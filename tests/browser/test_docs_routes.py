"""``/docs`` in headless Chromium: every route's name is shown whole in the
side list (a long one wraps, none is cut to "…"), and the nodes' internal
routes (``/v1/internal/*``), which ``/openapi.json`` still describes, are
not listed."""

from __future__ import annotations

import httpx
from playwright.sync_api import Page, expect

NAV = """() => [...document.querySelectorAll('#nav a')].map((a) => {
  const r = document.createRange(); r.selectNodeContents(a);
  const text = r.getBoundingClientRect(); const box = a.getBoundingClientRect();
  return { text: a.textContent, href: a.getAttribute('href'), scroll: a.scrollWidth, client: a.clientWidth,
           left: box.left, right: box.right, text_left: text.left, text_right: text.right };
})"""


def public_routes(url: str) -> tuple[list[str], list[str]]:
    """The routes ``/openapi.json`` describes as `METHOD /path`: the public
    ones, and the nodes' internal ones."""
    spec = httpx.get(f"{url}/openapi.json").json()
    routes = [f"{m.upper()} {path}" for path, item in spec["paths"].items() for m in item]
    internal = [r for r in routes if r.split(" ", 1)[1].startswith("/v1/internal/")]
    return [r for r in routes if r not in internal], internal


def nav_links(page: Page, width: int) -> list[dict]:
    page.set_viewport_size({"width": width, "height": 900})
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    return page.evaluate(NAV)


def test_docs_show_every_route_name_whole(page: Page, dash_server):
    public, _ = public_routes(dash_server.url)
    page.goto(f"{dash_server.url}/docs")
    expect(page.locator("section.op").first).to_be_visible()
    for width in (1280, 800):
        links = nav_links(page, width)
        shown = {a["text"] for a in links}
        assert set(public) <= shown, f"at {width} px: {sorted(set(public) - shown)} missing"
        for a in links:
            assert a["scroll"] <= a["client"] + 1, f"at {width} px the name {a['text']!r} is cut"
            assert a["left"] - 0.5 <= a["text_left"] and a["text_right"] <= a["right"] + 0.5, (
                f"at {width} px the name {a['text']!r} runs past its box: {a}"
            )


def test_docs_do_not_list_internal_routes(page: Page, dash_server):
    public, internal = public_routes(dash_server.url)
    assert internal, "the OpenAPI document describes the nodes' internal routes"
    page.goto(f"{dash_server.url}/docs")
    expect(page.locator("section.op").first).to_be_visible()
    routes = [a["text"] for a in nav_links(page, 1280) if " /" in a["text"]]
    assert sorted(routes) == sorted(public)
    assert "/v1/internal/" not in page.locator("body").inner_text()
    assert page.locator("section.op .method").count() == len(public)
