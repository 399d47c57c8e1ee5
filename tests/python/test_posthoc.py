"""Post-hoc EMA: synthesising an EMA length after training (EDM2 sec. 3.2).

The server combines stored snapshots of two power-function profiles; the
weights and the result are checked against EDM2's ``solve_posthoc_coefficients``
computed here, and the result against a profile tracked directly."""

from __future__ import annotations

import time

import httpx
import numpy as np
import safetensors.torch
import torch
from refs import rel_err, std_to_exp
from shardsim import push_ranks
from test_snapshots import DIMS, Trainer

RUN = "posthoc"


def p_dot_p(t_a, gamma_a, t_b, gamma_b):
    """EDM2 ``phema.p_dot_p``."""
    t_ratio = t_a / t_b
    t_exp = np.where(t_a < t_b, gamma_b, -gamma_a)
    t_max = np.maximum(t_a, t_b)
    num = (gamma_a + 1) * (gamma_b + 1) * t_ratio**t_exp
    den = (gamma_a + gamma_b + 1) * t_max
    return num / den


def solve_posthoc_coefficients(in_t, in_std, out_t, out_std):
    """EDM2 ``phema.solve_posthoc_coefficients``."""
    exp = np.vectorize(std_to_exp)
    rv = lambda x: np.float64(x).reshape(-1, 1)  # noqa: E731
    cv = lambda x: np.float64(x).reshape(1, -1)  # noqa: E731
    a = p_dot_p(rv(in_t), rv(exp(in_std)), cv(in_t), cv(exp(in_std)))
    b = p_dot_p(rv(in_t), rv(exp(in_std)), cv(out_t), cv(exp(out_std)))
    return np.linalg.lstsq(a, b, rcond=None)[0]


def test_posthoc_matches_edm2(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(
            "/v1/runs",
            json={
                "name": RUN,
                "world_size": 2,
                "snapshot_every": 10,
                "profiles": [
                    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
                    {"name": "p15", "kind": "power", "sigma_rel": 0.15},
                    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
                ],
            },
        )
        assert r.status_code == 201, r.text
        tr = Trainer(seed=11)
        for step in range(61):
            tr.step()
            push_ranks(c, RUN, step, tr.state(), 2, dims=DIMS)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snaps = c.get(f"/v1/runs/{RUN}/snapshots", params={"kind": "periodic"}).json()[
                "snapshots"
            ]
            if len(snaps) == 7 and all(s["status"] == "complete" for s in snaps):
                break
            time.sleep(0.1)
        assert [s["step"] for s in snaps] == list(range(0, 61, 10))
        r = c.post(
            f"/v1/runs/{RUN}/posthoc",
            json={"sigma_rel": 0.10, "step": 60, "name": "synth", "profiles": ["p05", "p15"]},
        )
        assert r.status_code == 202, r.text
        sid = r.json()["id"]
        while time.monotonic() < deadline + 30:
            got = c.get(f"/v1/runs/{RUN}/snapshots/{sid}").json()
            if got["status"] != "pending":
                break
            time.sleep(0.1)
        assert got["status"] == "complete", got
        assert got["kind"] == "posthoc" and got["profiles"] == ["synth"]
        sources = got["detail"]["sources"]
        in_t = [s["step"] + 1 for s in sources]
        in_std = [0.05 if s["profile"] == "p05" else 0.15 for s in sources]
        x = solve_posthoc_coefficients(in_t, in_std, [61], [0.10])[:, 0]
        weights = np.array([s["weight"] for s in sources])
        assert np.allclose(weights, x, rtol=1e-6, atol=1e-9), (weights, x)

        def full(snapshot, profile):
            r = c.get(f"/v1/runs/{RUN}/snapshots/{snapshot}/download", params={"profile": profile})
            assert r.status_code == 200, r.text
            return safetensors.torch.load(r.content)

        inputs = [full(s["snapshot"], s["profile"]) for s in sources]
        want = {
            k: sum(float(w) * inp[k].double() for w, inp in zip(x, inputs, strict=True)).float()
            for k, v in inputs[0].items()
            if v.is_floating_point()
        }
        synth = full(sid, "synth")
        for k, v in want.items():
            assert rel_err(synth[k], v) <= 1e-5, (k, rel_err(synth[k], v))
        last = next(s for s in snaps if s["step"] == 60)["id"]
        assert torch.equal(
            synth["bn.num_batches_tracked"], full(last, "p10")["bn.num_batches_tracked"]
        )
        # The synthesised sigma_rel=0.10 is nearer the tracked one than either source is.
        tracked, p05, p15 = full(last, "p10"), full(last, "p05"), full(last, "p15")
        for k in ("fc1.weight", "fc2.weight", "emb.weight"):
            d = rel_err(synth[k], tracked[k])
            assert d < rel_err(p05[k], tracked[k]) and d < rel_err(p15[k], tracked[k]), k
        r = c.post(f"/v1/runs/{RUN}/posthoc", json={"sigma_rel": 0.5})
        assert r.status_code == 422 and "sigma_rel" in r.json()["error"]["message"]
        # Asking for a tracked length with it among the sources gives that
        # profile back exactly.
        r = c.post(f"/v1/runs/{RUN}/posthoc", json={"sigma_rel": 0.10, "step": 60, "name": "again"})
        sid = r.json()["id"]
        while c.get(f"/v1/runs/{RUN}/snapshots/{sid}").json()["status"] == "pending":
            time.sleep(0.1)
        again = full(sid, "again")
        assert max(rel_err(again[k], tracked[k]) for k in want) < 1e-5
