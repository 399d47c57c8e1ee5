"""The Nodes page lists the servers of the service with their lease: here
the one dashboard server, live, with its URL, engines and the ranks its
runs hold."""

from __future__ import annotations

import re

import httpx
from playwright.sync_api import Page, expect


def test_nodes_page_shows_this_node_and_its_lease(page: Page, dash_server):
    nodes = httpx.get(f"{dash_server.url}/v1/nodes").json()["nodes"]
    me = next(n for n in nodes if n["this"])
    assert me["url"] == dash_server.url and me["status"] == "live"
    page.goto(f"{dash_server.url}/#/nodes")
    row = page.locator(f'tr[data-node="{me["node"]}"]')
    expect(row).to_contain_text("(this server)")
    expect(row.locator('[data-field="url"]')).to_have_text(dash_server.url)
    expect(row.locator('[data-field="status"]')).to_have_text("live")
    for engine in me["engines"]:
        expect(row.locator('[data-field="engines"]')).to_contain_text(engine)
    # The lease renews: its age stays within the lease while the page polls.
    expect(row.locator('[data-field="lease"]')).to_have_text(re.compile(r"^\s*\d+\.\d s$"))
    lease = row.locator('[data-field="lease"]')
    age = float(lease.inner_text().strip().removesuffix(" s"))
    assert age <= me["lease_seconds"], age
    # The header links to the page.
    page.goto(f"{dash_server.url}/#/runs")
    page.get_by_role("link", name="Nodes").click()
    expect(page.locator('[data-testid="nodes"]')).to_be_visible()
