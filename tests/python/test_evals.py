"""Evaluations of EMA candidates as data: stored once per snapshot, profile
and evaluator (the same numbers again 200, other numbers 409), listed with
each candidate's step, kind, sigma_rel, residual and sources, filtered,
announced as `eval` events, gone with their snapshot; bad input refused
with nothing stored; the best candidate of a metric with a download that
serves its weights; `python -m polyak download --best`."""

from __future__ import annotations

import json

import httpx
import pytest
import safetensors.torch
import torch
from polyak.cli import main

# Run on every catalog and store pair (see polyak_testing.plugin).
BACKEND_MATRIX = True

PROFILES = [
    {"name": "p05", "kind": "power", "sigma_rel": 0.05},
    {"name": "p10", "kind": "power", "sigma_rel": 0.10},
    {"name": "c", "kind": "constant", "beta": 0.9},
]


@pytest.fixture()
def c(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def wait_complete(c: httpx.Client, run: str, sid: str) -> dict:
    for _ in range(1200):
        s = c.get(f"/v1/runs/{run}/snapshots/{sid}").json()
        if s["status"] != "pending":
            assert s["status"] == "complete", s
            return s
        import time

        time.sleep(0.05)
    raise AssertionError(f"snapshot {sid} still pending")


@pytest.fixture(scope="module")
def trained(server):
    """A run with a mirror, two cuts (steps 9 and 19), a post-hoc result, a
    merge and a state snapshot."""
    run = "evals"
    with httpx.Client(base_url=server.url, timeout=120) as c:
        r = c.post(
            "/v1/runs", json={"name": run, "world_size": 1, "mirror": True, "profiles": PROFILES}
        )
        assert r.status_code == 201, r.text
        g = torch.Generator().manual_seed(0)
        w = torch.randn(16, 8, generator=g)
        cuts = []
        for step in range(20):
            w = w + 0.05 * torch.randn(16, 8, generator=g)
            body = safetensors.torch.save({"w": w, "b": w.sum(0)})
            assert c.put(f"/v1/runs/{run}/ranks/0/steps/{step}", content=body).status_code == 200
            if step in (9, 19):
                r = c.post(f"/v1/runs/{run}/snapshots", json={"step": step})
                assert r.status_code == 202, r.text
                cuts.append(wait_complete(c, run, r.json()["id"]))
        posthoc = c.post(f"/v1/runs/{run}/posthoc", json={"sigma_rel": 0.07}).json()
        posthoc = wait_complete(c, run, posthoc["id"])
        merge = c.post(f"/v1/runs/{run}/merge", json={"last": 2}).json()
        merge = wait_complete(c, run, merge["id"])
        assert c.post(f"/v1/runs/{run}/persist").status_code < 300
        state = None
        for _ in range(1200):
            states = [
                s
                for s in c.get(f"/v1/runs/{run}/snapshots", params={"kind": "state"}).json()[
                    "snapshots"
                ]
                if s["status"] == "complete"
            ]
            if states:
                state = states[0]
                break
            import time

            time.sleep(0.05)
        assert state is not None
    return {"run": run, "cuts": cuts, "posthoc": posthoc, "merge": merge, "state": state}


def post(c, run, snapshot, profile, metrics, evaluator=None, status=201):
    body = {"snapshot": snapshot, "profile": profile, "metrics": metrics}
    if evaluator is not None:
        body["evaluator"] = evaluator
    r = c.post(f"/v1/runs/{run}/evals", json=body)
    assert r.status_code == status, r.text
    return r.json()


def loss_of(step: int, profile: str) -> float:
    """Distinct numbers per candidate; p10 at step 19 is the lowest."""
    base = {"p05": 0.30, "p10": 0.20, "c": 0.40, "online": 0.50}[profile]
    return base - step / 100


def test_evaluations_are_stored_once_listed_and_go_with_their_snapshot(c, trained):
    run = trained["run"]
    a, b = trained["cuts"]
    since = max(
        [
            e["id"]
            for e in c.get(f"/v1/runs/{run}/events", headers={"Accept": "application/json"}).json()
        ]
        or [0]
    )
    posted = {}
    for snap in (a, b):
        for profile in ("p05", "p10", "c", "online"):
            e = post(
                c,
                run,
                snap["id"],
                profile,
                {"val_loss": loss_of(snap["step"], profile), "acc": 0.5},
            )
            posted[(snap["id"], profile)] = e
            assert (e["step"], e["evaluator"]) == (snap["step"], "")
    ph, mg = trained["posthoc"], trained["merge"]
    e_ph = post(c, run, ph["id"], "posthoc", {"val_loss": 0.1})
    e_mg = post(c, run, mg["id"], "merged", {"val_loss": 0.15, "acc": 0.9})

    # The candidate: kind, sigma_rel (a live power profile's, a post-hoc
    # target's), the fit residual and the sources of derived ones.
    e = posted[(b["id"], "p05")]
    assert (e["kind"], e["sigma_rel"], e["residual"], e["sources"]) == ("ema", 0.05, None, [])
    e = posted[(b["id"], "c")]
    assert (e["kind"], e["sigma_rel"]) == ("ema", None)
    e = posted[(b["id"], "online")]
    assert (e["kind"], e["sigma_rel"]) == ("online", None)
    assert (e_ph["kind"], e_ph["sigma_rel"], e_ph["step"]) == ("posthoc", 0.07, 19)
    assert e_ph["residual"] == ph["detail"]["residual"]
    assert set(e_ph["sources"]) == {a["id"], b["id"]}
    assert (e_mg["kind"], e_mg["sigma_rel"], sorted(e_mg["sources"])) == (
        "merge",
        None,
        sorted([a["id"], b["id"]]),
    )

    # Idempotent: the same numbers again are 200 with the stored one; other
    # numbers 409; another evaluator is another evaluation.
    again = post(c, run, a["id"], "p05", {"val_loss": loss_of(9, "p05"), "acc": 0.5}, status=200)
    assert again == posted[(a["id"], "p05")]
    r = c.post(
        f"/v1/runs/{run}/evals",
        json={"snapshot": a["id"], "profile": "p05", "metrics": {"val_loss": 0.0}},
    )
    assert (r.status_code, r.json()["error"]["code"]) == (409, "eval_conflict")
    other = post(c, run, a["id"], "p05", {"val_loss": 0.0}, evaluator="fid-10k")
    assert other["evaluator"] == "fid-10k"

    listed = c.get(f"/v1/runs/{run}/evals").json()["evals"]
    assert len(listed) == 8 + 2 + 1
    assert [x["step"] for x in listed] == sorted(x["step"] for x in listed)
    by_id = {x["id"]: x for x in listed}
    for e in [*posted.values(), e_ph, e_mg, other]:
        assert by_id[e["id"]] == e
    # Filters.
    acc = c.get(f"/v1/runs/{run}/evals", params={"metric": "acc"}).json()["evals"]
    assert {x["id"] for x in acc} == {x["id"] for x in listed if "acc" in x["metrics"]}
    assert len(acc) == 9
    online = c.get(f"/v1/runs/{run}/evals", params={"profile": "online"}).json()["evals"]
    assert [x["snapshot"] for x in online] == [a["id"], b["id"]]
    kinds = c.get(f"/v1/runs/{run}/evals", params={"kind": "posthoc"}).json()["evals"]
    assert [x["id"] for x in kinds] == [e_ph["id"]]
    fid = c.get(f"/v1/runs/{run}/evals", params={"evaluator": "fid-10k"}).json()["evals"]
    assert [x["id"] for x in fid] == [other["id"]]
    assert c.get(f"/v1/runs/{run}/evals", params={"kind": "weird"}).status_code == 400

    # One `eval` event per stored evaluation (none for the repeat, the
    # conflict), at the candidate's step.
    events = c.get(
        f"/v1/runs/{run}/events",
        params={"since": since, "kinds": "eval"},
        headers={"Accept": "application/json"},
    ).json()
    assert len(events) == 11
    got = {
        (ev["detail"]["snapshot"], ev["detail"]["profile"], ev["detail"]["evaluator"])
        for ev in events
    }
    assert got == {(x["snapshot"], x["profile"], x["evaluator"]) for x in listed}
    first = next(ev for ev in events if ev["detail"]["profile"] == "online")
    assert first["step"] == 9 and first["detail"]["kind"] == "online"
    assert first["detail"]["metrics"] == {"val_loss": loss_of(9, "online"), "acc": 0.5}

    # The best: min and max, narrowed by kind and profile; its download
    # serves the candidate's weights.
    best = c.get(f"/v1/runs/{run}/best", params={"metric": "val_loss"}).json()
    assert (best["evaluation"]["id"], best["value"], best["mode"]) == (other["id"], 0.0, "min")
    best = c.get(
        f"/v1/runs/{run}/best", params={"metric": "val_loss", "kind": "ema", "evaluator": ""}
    ).json()
    assert (best["evaluation"]["snapshot"], best["evaluation"]["profile"]) == (b["id"], "p10")
    assert best["value"] == loss_of(19, "p10")
    assert best["download"] == f"/v1/runs/{run}/snapshots/{b['id']}/download?profile=p10"
    served = c.get(best["download"]).content
    direct = c.get(
        f"/v1/runs/{run}/snapshots/{b['id']}/download", params={"profile": "p10"}
    ).content
    assert served == direct and len(served) > 0
    best = c.get(f"/v1/runs/{run}/best", params={"metric": "acc", "mode": "max"}).json()
    assert (best["evaluation"]["id"], best["value"]) == (e_mg["id"], 0.9)
    best = c.get(
        f"/v1/runs/{run}/best", params={"metric": "val_loss", "mode": "max", "profile": "online"}
    ).json()
    assert best["evaluation"]["snapshot"] == a["id"]
    r = c.get(f"/v1/runs/{run}/best", params={"metric": "fid"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "no_evaluations")
    assert (
        c.get(f"/v1/runs/{run}/best", params={"metric": "val_loss", "mode": "median"}).status_code
        == 400
    )
    assert c.get(f"/v1/runs/{run}/best").status_code == 400

    # Deleting a snapshot deletes its evaluations (and nothing else).
    assert c.delete(f"/v1/runs/{run}/snapshots/{mg['id']}").status_code < 300
    left = c.get(f"/v1/runs/{run}/evals").json()["evals"]
    assert {x["id"] for x in left} == {x["id"] for x in listed} - {e_mg["id"]}
    r = c.get(f"/v1/runs/{run}/best", params={"metric": "acc", "mode": "max"}).json()
    assert r["evaluation"]["snapshot"] != mg["id"]


def test_bad_evaluations_are_refused_and_nothing_is_stored(c, trained):
    run = trained["run"]
    a = trained["cuts"][0]
    before = c.get(f"/v1/runs/{run}/evals").json()["evals"]
    ok = {"snapshot": a["id"], "profile": "p05", "metrics": {"m": 1.0}, "evaluator": "bad-input"}

    def refused(body, status, code, raw=None):
        if raw is not None:
            r = c.post(
                f"/v1/runs/{run}/evals", content=raw, headers={"content-type": "application/json"}
            )
        else:
            r = c.post(f"/v1/runs/{run}/evals", json=body)
        assert r.status_code == status, (body or raw, r.text)
        assert r.json()["error"]["code"] == code, r.text
        return r.json()["error"]

    refused({**ok, "snapshot": "no-such-snapshot"}, 404, "snapshot_not_found")
    refused({**ok, "profile": "nope"}, 404, "profile_not_found")
    # A derived snapshot keeps no online weights; a state snapshot is no candidate.
    refused(
        {**ok, "snapshot": trained["posthoc"]["id"], "profile": "online"}, 404, "profile_not_found"
    )
    refused({**ok, "snapshot": trained["state"]["id"]}, 422, "invalid_eval")
    # Non-finite values: JSON has no NaN (a `NaN` literal is not JSON), and
    # a number too large for a double is refused too; strings, nulls too.
    for raw in ('{"m": NaN}', '{"m": Infinity}', '{"m": 1e999}', '{"m": -1e999}'):
        body = json.dumps({**ok, "metrics": "X"}).replace('"X"', raw)
        r = c.post(
            f"/v1/runs/{run}/evals", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code in (400, 422), (raw, r.text)
    err = refused({**ok, "metrics": {"m": "nan"}}, 422, "invalid_eval")
    assert err["field"] == "metrics.m"
    refused({**ok, "metrics": {"m": None}}, 422, "invalid_eval")
    err = refused({**ok, "metrics": {"x" * 129: 1.0}}, 422, "invalid_eval")
    assert err["field"] == "metrics"
    refused({**ok, "metrics": {f"m{i}": float(i) for i in range(65)}}, 422, "invalid_eval")
    refused({**ok, "metrics": {}}, 422, "invalid_eval")
    refused({**ok, "evaluator": "e" * 129}, 422, "invalid_eval")
    refused({**ok, "extra": 1}, 422, "invalid_config")
    r = c.post("/v1/runs/no-such-run/evals", json=ok)
    assert r.status_code == 404
    assert c.get(f"/v1/runs/{run}/evals").json()["evals"] == before
    # The limits themselves are accepted.
    post(c, run, a["id"], "p05", {"x" * 128: 1.0}, evaluator="limits-name")
    post(c, run, a["id"], "p05", {f"m{i}": float(i) for i in range(64)}, evaluator="limits-count")


def test_download_best_from_the_shell(c, trained, server, tmp_path, capsys):
    run = trained["run"]
    b = trained["cuts"][1]
    post(c, run, b["id"], "c", {"shell_loss": 0.25}, evaluator="shell")
    post(c, run, b["id"], "p05", {"shell_loss": 0.5}, evaluator="shell")
    out = tmp_path / "best.safetensors"
    argv = [
        "--url",
        server.url,
        "download",
        run,
        "--best",
        "shell_loss",
        "--no-progress",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "best shell_loss (min): 0.25" in printed.err
    direct = c.get(f"/v1/runs/{run}/snapshots/{b['id']}/download", params={"profile": "c"}).content
    assert out.read_bytes() == direct
    out_max = tmp_path / "worst.safetensors"
    assert main([*argv[:-1], str(out_max), "--mode", "max"]) == 0
    direct = c.get(
        f"/v1/runs/{run}/snapshots/{b['id']}/download", params={"profile": "p05"}
    ).content
    assert out_max.read_bytes() == direct
    # Neither a snapshot nor --best: a usage error.
    with pytest.raises(SystemExit):
        main(["--url", server.url, "download", run])


def test_poorly_fitted_lengths_are_warned_about_by_the_cli(c, trained, server, capsys):
    run = trained["run"]
    plan = c.get(f"/v1/runs/{run}/posthoc/plan", params={"sigma_rel": "0.005,0.1"}).json()
    residuals = {t["sigma_rel"]: t["residual"] for t in plan["targets"]}
    assert residuals[0.005] > 0.05 >= residuals[0.1]
    assert main(["--url", server.url, "posthoc", run, "--sigma-rel", "0.005,0.1"]) == 0
    err = capsys.readouterr().err
    assert "sigma_rel 0.005 is poorly fitted" in err
    assert "sigma_rel 0.1 is poorly" not in err
