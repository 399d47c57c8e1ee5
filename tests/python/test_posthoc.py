"""Post-hoc EMA (EDM2 sec. 3.2, app. C.3) and checkpoint merging.

The weights are checked against EDM2's ``solve_posthoc_coefficients``
written out here from the paper's equations (eq. 126-128, then each column
scaled to sum to 1, as ``training/phema.py`` does), the synthesised weights
against the same combination of the downloaded source snapshots, and the
result against a profile the server tracked directly."""

from __future__ import annotations

import io
import tarfile
import time

import httpx
import numpy as np
import pytest
import safetensors.torch
import torch
from polyak_testing.refs import rel_err, std_to_exp

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True


def p_dot_p(t_a, gamma_a, t_b, gamma_b):
    """EDM2 eq. 128: the inner product of two power-function profiles."""
    t_ratio = t_a / t_b
    t_exp = np.where(t_a < t_b, gamma_b, -gamma_a)
    t_max = np.maximum(t_a, t_b)
    num = (gamma_a + 1) * (gamma_b + 1) * t_ratio**t_exp
    den = (gamma_a + gamma_b + 1) * t_max
    return num / den


def solve_posthoc_coefficients(in_t, in_std, out_t, out_std):
    """EDM2 ``solve_posthoc_coefficients``: solve ``A X = B``, then scale
    each column to sum to 1. Returns (X, residual per column)."""
    exp = np.vectorize(std_to_exp)
    in_t, in_g = np.float64(in_t).reshape(-1, 1), exp(np.float64(in_std)).reshape(-1, 1)
    out_t, out_g = np.float64(out_t).reshape(1, -1), exp(np.float64(out_std)).reshape(1, -1)
    a = p_dot_p(in_t, in_g, in_t.T, in_g.T)
    b = p_dot_p(in_t, in_g, out_t, out_g)
    x = np.linalg.solve(a, b)
    x = x / np.sum(x, axis=0)
    tt = p_dot_p(out_t, out_g, out_t, out_g)[0]
    sq = np.einsum("ij,ik,kj->j", x, a, x) - 2 * np.einsum("ij,ij->j", x, b) + tt
    return x, np.sqrt(np.maximum(sq, 0) / tt), np.linalg.cond(a)


def wait_all(c: httpx.Client, run: str, ids, timeout=120.0):
    deadline = time.monotonic() + timeout
    out = {}
    while time.monotonic() < deadline:
        for sid in ids:
            if sid not in out:
                s = c.get(f"/v1/runs/{run}/snapshots/{sid}").json()
                if s["status"] != "pending":
                    out[sid] = s
        if len(out) == len(ids):
            bad = [s for s in out.values() if s["status"] != "complete"]
            assert not bad, bad
            return [out[sid] for sid in ids]
        time.sleep(0.05)
    raise AssertionError(f"snapshots still pending: {set(ids) - set(out)}")


def full(c: httpx.Client, run: str, sid: str, profile: str) -> dict[str, torch.Tensor]:
    r = c.get(f"/v1/runs/{run}/snapshots/{sid}/download", params={"profile": profile})
    assert r.status_code == 200, r.text
    return safetensors.torch.load(r.content)


def create(c: httpx.Client, name: str, sigmas: dict[str, float], **extra) -> None:
    body = {
        "name": name,
        "world_size": extra.pop("world_size", 1),
        "profiles": [{"name": n, "kind": "power", "sigma_rel": s} for n, s in sigmas.items()],
        **extra,
    }
    r = c.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text


def push(c: httpx.Client, run: str, step: int, state: dict[str, torch.Tensor], rank=0):
    r = c.put(f"/v1/runs/{run}/ranks/{rank}/steps/{step}", content=safetensors.torch.save(state))
    assert r.status_code == 200, r.text


@pytest.fixture()
def c(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


SIGMAS = {"p05": 0.05, "p10": 0.10, "p15": 0.15}


def test_weights_equal_edm2_for_many_source_sets(c):
    """Irregular, sparse and dense snapshot sets, every usable target step,
    profile subsets and many lengths: the weights and the residual equal
    EDM2's to 1e-12."""
    run = "ph-weights"
    create(c, run, SIGMAS)
    snap_steps = [0, 1, 3, 7, 10, 18, 25, 40, 41, 60, 99, 100, 180, 250]
    # p15 only in some snapshots: source sets differ by profile too.
    with_p15 = {3, 25, 41, 100, 250}
    w = torch.zeros(4)
    for step in range(251):
        if step in snap_steps:
            profiles = ["p05", "p10"] + (["p15"] if step in with_p15 else [])
            r = c.post(f"/v1/runs/{run}/snapshots", json={"step": step, "profiles": profiles})
            assert r.status_code == 202, r.text
        w = w + 0.01
        push(c, run, step, {"w": w})
    ids = [s["id"] for s in c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]]
    wait_all(c, run, ids)
    sweep = [0.02, 0.04, 0.05, 0.07, 0.09, 0.10, 0.13, 0.15, 0.2, 0.25]
    checked = 0
    worst = {True: 0.0, False: 0.0}  # by cond(A) <= 1e4
    conds = []
    for profiles in (None, ["p05", "p10"], ["p10", "p15"], ["p05"]):
        for step in snap_steps:
            params = {"sigma_rel": ",".join(map(str, sweep)), "step": step}
            if profiles is not None:
                params["profiles"] = ",".join(profiles)
            r = c.get(f"/v1/runs/{run}/posthoc/plan", params=params)
            assert r.status_code == 200, r.text
            plan = r.json()
            assert plan["step"] == step
            chosen = set(profiles or SIGMAS)
            want_sources = sorted(
                (s, p)
                for s in snap_steps
                if s <= step
                for p in ["p05", "p10"] + (["p15"] if s in with_p15 else [])
                if p in chosen
            )
            got_sources = [(src["step"], src["profile"]) for src in plan["sources"]]
            assert sorted(got_sources) == want_sources
            in_t = [src["step"] + 1 for src in plan["sources"]]
            in_std = [SIGMAS[src["profile"]] for src in plan["sources"]]
            x, res, cond = solve_posthoc_coefficients(in_t, in_std, [step + 1] * len(sweep), sweep)
            conds.append(cond)
            for j, target in enumerate(plan["targets"]):
                assert target["sigma_rel"] == sweep[j]
                got = np.array(target["weights"])
                assert abs(got.sum() - 1) < 1e-12
                err = np.max(np.abs(got - x[:, j])) / max(1.0, np.max(np.abs(x[:, j])))
                # Two float64 solvers of A x = b agree to about cond(A) * eps
                # (the accuracy to which float64 entries of A define x); to
                # 1e-12 wherever that allows it.
                bound = max(1e-12, cond * np.finfo(np.float64).eps)
                worst[cond <= 1e4] = max(worst[cond <= 1e4], err)
                assert err <= bound, (profiles, step, sweep[j], cond, got, x[:, j])
                # Below ~1e-7 the expansion |x'Ax - 2x'b + c| sits at float64's
                # cancellation floor (sqrt(eps)); above it, both agree closely.
                assert abs(target["residual"] - res[j]) <= 1e-7 + 1e-6 * res[j], (
                    target["residual"],
                    res[j],
                )
                checked += 1
    print(
        f"\n{checked} (source set, target) pairs, cond(A) {min(conds):.1e}..{max(conds):.1e}; "
        f"worst weight difference {worst[True]:.1e} where cond(A) <= 1e4, "
        f"{worst[False]:.1e} elsewhere"
    )
    assert worst[True] <= 1e-12
    assert checked == 4 * len(snap_steps) * len(sweep)
    # A step without a snapshot is refused with the usable steps.
    r = c.get(f"/v1/runs/{run}/posthoc/plan", params={"sigma_rel": "0.1", "step": 50})
    assert r.status_code == 422
    assert f"usable steps: {snap_steps}" in r.json()["error"]["message"]
    r = c.get(f"/v1/runs/{run}/posthoc/plan", params={"sigma_rel": "0.1", "profiles": "nope"})
    assert r.status_code == 422 and "nope" in r.json()["error"]["message"]
    r = c.get(f"/v1/runs/{run}/posthoc/plan", params={"sigma_rel": "0.4"})
    assert r.status_code == 422 and "sigma_rel" in r.json()["error"]["message"]
    r = c.get(f"/v1/runs/{run}/posthoc/plan", params={"sigma_rel": "x"})
    assert r.status_code == 422 and "sigma_rel" in r.json()["error"]["message"]


def noisy_run(c, run, sigmas, steps, snapshot_every, seed=0, world_size=2, mirror=False):
    """Pushes a weight near 1.0 (1 % noise) and a constant tensor for
    ``steps`` steps on ``world_size`` ranks; returns the pushed states."""
    create(
        c,
        run,
        sigmas,
        world_size=world_size,
        snapshot_every=snapshot_every,
        mirror=mirror,
    )
    gen = torch.Generator().manual_seed(seed)
    states = []
    for step in range(steps):
        for rank in range(world_size):
            state = {
                "w": 1.0 + 0.01 * torch.randn(64, 32, generator=gen),
                "drift": torch.full((16,), float(step)) + torch.randn(16, generator=gen),
                "const": torch.full((8,), 0.375),
                "n": torch.tensor(step, dtype=torch.int64),
            }
            states.append(state)
            push(c, run, step, state, rank=rank)
    want = list(range(0, steps, snapshot_every))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snaps = c.get(f"/v1/runs/{run}/snapshots", params={"status": "complete"}).json()[
            "snapshots"
        ]
        if [s["step"] for s in snaps] == want:
            return snaps
        time.sleep(0.05)
    raise AssertionError(f"periodic snapshots: {[s['step'] for s in snaps]} != {want}")


def test_posthoc_end_to_end_matches_the_combination_of_sources(c):
    """The setup of the defect: power profiles 0.05 and 0.10, a snapshot
    every 10 steps, a weight near 1.0 pushed for steps 0..59, sigma_rel
    0.07 at every snapshot step."""
    run = "ph-e2e"
    snaps = noisy_run(c, run, {"p05": 0.05, "p10": 0.10}, 60, 10)
    means = {}
    for step in range(0, 60, 10):
        r = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": 0.07, "step": step})
        assert r.status_code == 202, r.text
        (got,) = wait_all(c, run, [r.json()["id"]])
        assert got["kind"] == "posthoc" and got["profiles"] == ["posthoc"] and got["step"] == step
        detail = got["detail"]
        sources = detail["sources"]
        assert all(s["step"] <= step for s in sources)
        x, res, _ = solve_posthoc_coefficients(
            [s["step"] + 1 for s in sources],
            [s["sigma_rel"] for s in sources],
            [step + 1],
            [0.07],
        )
        weights = np.array([s["weight"] for s in sources])
        assert np.max(np.abs(weights - x[:, 0])) <= 1e-12
        assert abs(detail["residual"] - res[0]) <= 1e-7 + 1e-6 * res[0]
        inputs = [full(c, run, s["snapshot"], s["profile"]) for s in sources]
        synth = full(c, run, got["id"], "posthoc")
        for k in ("w", "drift", "const"):
            want = sum(float(wi) * inp[k].double() for wi, inp in zip(x[:, 0], inputs, strict=True))
            assert rel_err(synth[k], want) <= 1e-6, (step, k, rel_err(synth[k], want))
        # A constant comes back as that constant; copied tensors from the
        # newest source.
        assert torch.allclose(synth["const"], torch.full_like(synth["const"], 0.375), rtol=1e-6)
        assert synth["n"].item() == step
        means[step] = synth["w"].double().mean().item()
        assert abs(means[step] - 1.0) < 0.01, means
    print(f"\nmeans of the synthesised weight by step: {means}")
    # 55 and 59 have no snapshot: refused, with the usable steps.
    for step in (55, 59, 200):
        r = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": 0.07, "step": step})
        assert r.status_code == 422, r.text
        msg = r.json()["error"]["message"]
        assert "usable steps: [0, 10, 20, 30, 40, 50]" in msg, msg
    # Nothing was recorded for the refused requests.
    kinds = [s["kind"] for s in c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]]
    assert kinds.count("posthoc") == 6 and len(snaps) == 6


def test_synthesis_approaches_a_tracked_profile_as_snapshots_densify(c):
    """A third power profile (0.07) tracked directly: the synthesis from
    the 0.05 and 0.10 snapshots nears it as snapshots get denser, and the
    reported residual falls with it."""
    rows = []
    for every in (40, 20, 10, 5):
        run = f"ph-dense-{every}"
        create(
            c,
            run,
            {"p05": 0.05, "p10": 0.10, "p07": 0.07},
            snapshot_every=every,
        )
        gen = torch.Generator().manual_seed(3)
        w = torch.zeros(256)
        for step in range(161):
            # A trajectory that drifts, then turns: EMA lengths disagree.
            w = w + (0.05 if step < 100 else -0.05) + 0.02 * torch.randn(256, generator=gen)
            push(c, run, step, {"w": w})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            snaps = c.get(f"/v1/runs/{run}/snapshots", params={"status": "complete"}).json()
            if any(s["step"] == 160 for s in snaps["snapshots"]):
                break
            time.sleep(0.05)
        r = c.post(
            f"/v1/runs/{run}/posthoc",
            json={"sigma_rel": 0.07, "step": 160, "profiles": ["p05", "p10"]},
        )
        assert r.status_code == 202, r.text
        (got,) = wait_all(c, run, [r.json()["id"]])
        last = next(s for s in snaps["snapshots"] if s["step"] == 160)
        tracked = full(c, run, last["id"], "p07")["w"]
        synth = full(c, run, got["id"], "posthoc")["w"]
        err = rel_err(synth, tracked)
        p05_err = rel_err(full(c, run, last["id"], "p05")["w"], tracked)
        rows.append((every, len(got["detail"]["sources"]), got["detail"]["residual"], err, p05_err))
    print("\nsnapshot_every  sources  residual   |synth - tracked| / |tracked|  (p05 alone)")
    for every, n, res, err, p05_err in rows:
        print(f"{every:>14}  {n:>7}  {res:.3e}  {err:.3e}                     {p05_err:.3e}")
    residuals = [r[2] for r in rows]
    errors = [r[3] for r in rows]
    assert residuals == sorted(residuals, reverse=True) and residuals[-1] < residuals[0] / 3
    assert errors[-1] < errors[0] / 3, errors
    # Dense snapshots synthesise a length better than either source is.
    assert errors[-1] < rows[-1][4] / 10


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def test_sweep_equals_single_calls_with_bounded_memory(fresh_server):
    """A sweep of 8 lengths reads each source once and writes 8 derived
    snapshots; each equals the single-length call; the server's peak RSS
    during the sweep stays below (8 + 2) x the largest rank shard."""
    srv = fresh_server.start()
    pid = srv.proc.pid
    run = "ph-sweep"
    numel = 4 << 20  # 16 MiB of float32 per rank and profile
    shard_bytes = numel * 4
    with httpx.Client(base_url=srv.url, timeout=300) as c:
        # No state writes: their captures would count in the sweep's peak.
        create(
            c,
            run,
            {"p05": 0.05, "p10": 0.10},
            world_size=2,
            update_every=10,
            snapshot_every=10,
            persist_every_secs=0,
        )
        gen = torch.Generator().manual_seed(5)
        base = torch.randn(numel, generator=gen)
        for step in range(0, 31, 10):
            for rank in range(2):
                push(c, run, step, {"w": base + 0.01 * step + rank}, rank=rank)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            snaps = c.get(
                f"/v1/runs/{run}/snapshots", params={"status": "complete", "kind": "periodic"}
            ).json()
            if len(snaps["snapshots"]) == 4:
                break
            time.sleep(0.1)
        sweep = [0.03, 0.05, 0.06, 0.07, 0.08, 0.10, 0.12, 0.15]
        rss_before = vm_kib(pid, "VmRSS") * 1024
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        r = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": sweep, "step": 30})
        assert r.status_code == 202, r.text
        rows = r.json()["snapshots"]
        assert [row["detail"]["sigma_rel"] for row in rows] == sweep
        done = wait_all(c, run, [row["id"] for row in rows], timeout=300)
        peak = vm_kib(pid, "VmHWM") * 1024
        growth = peak - rss_before
        print(
            f"\nsweep of 8: peak RSS {peak / 2**20:.0f} MiB, {growth / 2**20:.1f} MiB over the "
            f"{rss_before / 2**20:.0f} MiB before; bound (8 + 2) x {shard_bytes / 2**20:.0f} MiB"
        )
        assert growth < (8 + 2) * shard_bytes
        for sigma, row in zip(sweep, done, strict=True):
            assert row["detail"]["sweep"] == [x["id"] for x in rows]
            r = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": sigma, "step": 30})
            (single,) = wait_all(c, run, [r.json()["id"]], timeout=300)
            assert single["detail"]["sources"] == row["detail"]["sources"]
            assert single["detail"]["residual"] == row["detail"]["residual"]
            a = full(c, run, row["id"], "posthoc")["w"]
            b = full(c, run, single["id"], "posthoc")["w"]
            assert torch.equal(a, b), sigma
        r = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": [0.05] * 33})
        assert r.status_code == 422 and "32" in r.json()["error"]["message"]


def test_merge_of_online_weights(c):
    """uniform, linear and exp weights over the last 3 mirror snapshots
    equal the same averages of the downloaded online weights."""
    run = "merge"
    noisy_run(c, run, {"p10": 0.10}, 41, 10, seed=9, mirror=True)
    snaps = c.get(f"/v1/runs/{run}/snapshots", params={"kind": "periodic"}).json()["snapshots"]
    last3 = snaps[-3:]
    online = [full(c, run, s["id"], "online") for s in last3]
    cases = {
        "uniform": ([1 / 3] * 3, {}),
        "linear": ([1 / 6, 2 / 6, 3 / 6], {}),
        "exp": ([0.36 / 1.96, 0.6 / 1.96, 1 / 1.96], {"alpha": 0.6}),
    }
    for scheme, (weights, extra) in cases.items():
        r = c.post(f"/v1/runs/{run}/merge", json={"last": 3, "weights": scheme, **extra})
        assert r.status_code == 202, r.text
        (got,) = wait_all(c, run, [r.json()["id"]])
        assert got["kind"] == "merge" and got["step"] == last3[-1]["step"]
        assert [s["snapshot"] for s in got["detail"]["sources"]] == [s["id"] for s in last3]
        assert np.allclose([s["weight"] for s in got["detail"]["sources"]], weights, atol=1e-15)
        merged = full(c, run, got["id"], "merged")
        for k in ("w", "drift", "const"):
            want = sum(w * o[k].double() for w, o in zip(weights, online, strict=True))
            assert rel_err(merged[k], want) <= 1e-6, (scheme, k)
        assert merged["n"].item() == last3[-1]["step"]
        # The sharded layout serves the same tensors (the ranks push whole
        # tensors here, so it holds one file).
        r = c.get(
            f"/v1/runs/{run}/snapshots/{got['id']}/download",
            params={"profile": "merged", "layout": "sharded"},
        )
        assert r.status_code == 200, r.text
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            (member,) = tar.getmembers()
            sharded = safetensors.torch.load(tar.extractfile(member).read())
        assert set(sharded) == set(merged)
        assert all(torch.equal(sharded[k], merged[k]) for k in merged), scheme
    # By ids, in any order: weighed by step.
    ids = [last3[2]["id"], last3[0]["id"]]
    r = c.post(f"/v1/runs/{run}/merge", json={"snapshots": ids, "weights": "linear"})
    (got,) = wait_all(c, run, [r.json()["id"]])
    merged = full(c, run, got["id"], "merged")
    want = (online[0]["w"].double() + 2 * online[2]["w"].double()) / 3
    assert rel_err(merged["w"], want) <= 1e-6
    # Bad requests change nothing.
    before = len(c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"])
    for body, word in (
        ({"last": 3, "weights": "uniform", "alpha": 0.5}, "alpha"),
        ({"last": 3, "weights": "exp", "alpha": 1.5}, "alpha"),
        ({"last": 99}, "last"),
        ({}, "either"),
        ({"snapshots": [ids[0], ids[0]]}, "twice"),
    ):
        r = c.post(f"/v1/runs/{run}/merge", json=body)
        assert r.status_code == 422, (body, r.text)
        assert word in r.json()["error"]["message"], (body, r.text)
    r = c.post(f"/v1/runs/{run}/merge", json={"snapshots": ["nope"]})
    assert r.status_code == 404
    assert len(c.get(f"/v1/runs/{run}/snapshots").json()["snapshots"]) == before
    # A run without a mirror has no online weights to merge.
    create(c, "merge-no-mirror", {"p10": 0.10})
    r = c.post("/v1/runs/merge-no-mirror/merge", json={"last": 2})
    assert r.status_code == 422 and "mirror" in r.json()["error"]["message"]
