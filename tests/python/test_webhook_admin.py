"""Alert webhooks are the admin's: the server POSTs to them, so a run's
write token (which every trainer machine holds) may not aim them, and
``--webhook-allow`` limits where the server may send at all. The write
token keeps pushes, snapshots and metric posts.
"""

from __future__ import annotations

import httpx
import safetensors.torch
import torch

ADMIN = "admin-token-0123456789abcdef"


def start(server, *flags):
    server.start("--token", ADMIN, *flags)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    c = httpx.Client(base_url=server.url, timeout=30)
    r = c.post(
        "/v1/runs",
        json={"name": "hooked", "world_size": 1, "alerts": {"webhook": "http://hooks.example/a"}},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    write = {"Authorization": f"Bearer {r.json()['write_token']}"}
    return c, admin, write


def rules(c, headers):
    return c.get("/v1/runs/hooked/alerts", headers=headers).json()["rules"]


def test_the_write_token_cannot_aim_the_webhook(fresh_server):
    c, admin, write = start(fresh_server)
    for webhook in ("http://127.0.0.1:9/steal", None):
        r = c.patch("/v1/runs/hooked", json={"alerts": {"webhook": webhook}}, headers=write)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "webhook_needs_admin", r.text
    assert rules(c, admin)["webhook"] == "http://hooks.example/a", "nothing changed"
    # The write token still changes the other rules, the webhook kept as is.
    r = c.patch(
        "/v1/runs/hooked",
        json={"alerts": {"webhook": "http://hooks.example/a", "disk_free_below": 0.01}},
        headers=write,
    )
    assert r.status_code == 200, r.text
    assert rules(c, admin)["disk_free_below"] == 0.01
    r = c.patch("/v1/runs/hooked", json={"note": "trainer note"}, headers=write)
    assert r.status_code == 200, r.text
    # ... and keeps pushes, snapshots and metric posts.
    body = safetensors.torch.save({"w": torch.arange(4.0)})
    assert c.put("/v1/runs/hooked/ranks/0/steps/0", content=body, headers=write).status_code == 200
    assert c.post("/v1/runs/hooked/snapshots", json={}, headers=write).status_code == 202
    r = c.post("/v1/runs/hooked/metrics", json={"step": 0, "values": {"loss": 1.0}}, headers=write)
    assert r.status_code < 300, r.text
    # The admin sets it.
    r = c.patch(
        "/v1/runs/hooked", json={"alerts": {"webhook": "http://127.0.0.1:9/ok"}}, headers=admin
    )
    assert r.status_code == 200 and r.json()["alerts"]["webhook"] == "http://127.0.0.1:9/ok"


def test_webhook_allow_limits_where_the_server_sends(fresh_server):
    c, admin, _write = start(fresh_server, "--webhook-allow", "hooks.example,127.0.0.1:9")
    for url in (
        "http://169.254.169.254/latest",
        "http://127.0.0.1:8080/x",
        "http://hooks.example.evil/",
    ):
        r = c.patch("/v1/runs/hooked", json={"alerts": {"webhook": url}}, headers=admin)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "webhook_not_allowed", r.text
        r = c.post(
            "/v1/runs",
            json={"name": "other", "world_size": 1, "alerts": {"webhook": url}},
            headers=admin,
        )
        assert r.status_code == 422 and r.json()["error"]["code"] == "webhook_not_allowed"
    assert rules(c, admin)["webhook"] == "http://hooks.example/a"
    assert c.get("/v1/runs/other", headers=admin).status_code == 404
    # Listed hosts (a host, or host:port) are taken.
    for url in ("http://HOOKS.example:8080/b", "http://127.0.0.1:9/ok"):
        r = c.patch("/v1/runs/hooked", json={"alerts": {"webhook": url}}, headers=admin)
        assert r.status_code == 200 and r.json()["alerts"]["webhook"] == url, r.text
