"""The server's EMA, read back over HTTP, equals the anchors computed here.

A small model (Embedding, Linear, LayerNorm, BatchNorm) trains for real;
every step is pushed to the real server binary. Float tensors must match to
1e-6 relative (norm of the difference over the norm of the anchor); integer
tensors (``num_batches_tracked``) are copied, so they equal the online value.
"""

from __future__ import annotations

import httpx
import pytest
import safetensors.torch
import torch
from ema_pytorch import EMA
from polyak_testing.refs import (
    Edm2Ema,
    SmallNetTrainer,
    assert_state_close,
    averaged_state,
    ema_pytorch_state,
    fetch_ema,
    half_life_beta,
    power_beta,
    push,
    rel_err,
    std_to_exp,
)
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def create(client: httpx.Client, body: dict) -> dict:
    r = client.post("/v1/runs", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def create_constant(client: httpx.Client, name: str, beta: float, **config) -> dict:
    """A one-rank run with one ``constant`` profile named ``ema``."""
    return create(
        client,
        {
            "name": name,
            "world_size": 1,
            "profiles": [{"name": "ema", "kind": "constant", "beta": beta}],
            **config,
        },
    )


def test_all_profiles_match_their_anchors_update_every_1(client):
    """One stream of pushes, five profiles, five anchors."""
    warmup = dict(beta=0.99, update_after_step=5, inv_gamma=2.0, power=0.75, min_value=0.2)
    create(
        client,
        {
            "name": "ref-every-1",
            "world_size": 1,
            "profiles": [
                {"name": "c", "kind": "constant", "beta": 0.9},
                {"name": "w", "kind": "warmup", **warmup},
                {"name": "s", "kind": "swa", "start_step": 10},
                {"name": "p", "kind": "power", "sigma_rel": 0.1},
                {"name": "h", "kind": "half_life", "steps": 8, "rampup_ratio": 0.5},
            ],
        },
    )
    tr = SmallNetTrainer(seed=0)
    model = tr.model
    ema_c = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
    ema_w = EMA(model, update_every=1, **warmup)
    swa = AveragedModel(model, use_buffers=True)
    gamma = std_to_exp(0.1)
    edm_p = edm_h = None
    prev = None
    for step in range(60):
        tr.step()
        state = tr.state()
        out = push(client, "ref-every-1", 0, step, state)
        assert out["applied"] is True and out["last_step"] == step
        ema_c.update_parameters(model)
        ema_w.update()
        if step >= 10:
            swa.update_parameters(model)
        if prev is None:
            edm_p, edm_h = Edm2Ema(state), Edm2Ema(state)
        else:
            t, delta = step + 1, step - prev
            edm_p.update(state, power_beta(gamma, t, delta))
            edm_h.update(state, half_life_beta(8, 0.5, t, delta))
        prev = step
    online = tr.state()
    anchors = {
        "c": averaged_state(ema_c),
        "w": ema_pytorch_state(ema_w),
        "s": averaged_state(swa),
        "p": edm_p.ema,
        "h": edm_h.ema,
    }
    for profile, want in anchors.items():
        got = fetch_ema(client, "ref-every-1", 0, profile)
        assert_state_close(got, want, online, label=profile)
    # The profiles really differ from each other and from the weights.
    got_c = fetch_ema(client, "ref-every-1", 0, "c")
    got_s = fetch_ema(client, "ref-every-1", 0, "s")
    assert rel_err(got_c["fc1.weight"], online["fc1.weight"]) > 1e-3
    assert rel_err(got_c["fc1.weight"], got_s["fc1.weight"]) > 1e-3
    assert int(online["bn.num_batches_tracked"]) == 60


def test_update_every_10_warmup_power_half_life(client):
    """ema-pytorch with update_every=10 and non-default schedule; EDM2 with
    pushes every 10 steps (interval-correct decay)."""
    warmup = dict(beta=0.995, update_after_step=25, inv_gamma=2.0, power=0.75, min_value=0.1)
    create(
        client,
        {
            "name": "ref-every-10",
            "world_size": 1,
            "update_every": 10,
            "profiles": [
                {"name": "w", "kind": "warmup", **warmup},
                {"name": "p", "kind": "power", "gamma": 5.0},
                {"name": "h", "kind": "half_life", "steps": 20, "rampup_ratio": 0.3},
            ],
        },
    )
    tr = SmallNetTrainer(seed=1)
    ema_w = EMA(tr.model, update_every=10, **warmup)
    edm_p = edm_h = None
    prev = None
    for step in range(90):
        tr.step()
        ema_w.update()
        state = tr.state()
        if step % 10 != 0:
            if step in (3, 47):
                # Not an update step: answered 200, nothing applied.
                out = push(client, "ref-every-10", 0, step, state)
                assert out["applied"] is False and out["reason"].startswith("not_update_step")
            continue
        out = push(client, "ref-every-10", 0, step, state)
        assert out["applied"] is True
        last_applied = state
        if prev is None:
            edm_p, edm_h = Edm2Ema(state), Edm2Ema(state)
        else:
            t, delta = step + 1, step - prev
            edm_p.update(state, power_beta(5.0, t, delta))
            edm_h.update(state, half_life_beta(20, 0.3, t, delta))
        prev = step
    # Integer tensors hold the last applied push's values.
    online = last_applied
    assert_state_close(
        fetch_ema(client, "ref-every-10", 0, "w"), ema_pytorch_state(ema_w), online, label="w"
    )
    assert_state_close(fetch_ema(client, "ref-every-10", 0, "p"), edm_p.ema, online, label="p")
    assert_state_close(fetch_ema(client, "ref-every-10", 0, "h"), edm_h.ema, online, label="h")
    # The warm-up EMA moved away from the last applied weights.
    assert (
        rel_err(fetch_ema(client, "ref-every-10", 0, "w")["fc2.weight"], online["fc2.weight"])
        > 1e-3
    )


def test_bf16_pushes_and_delta_pushes(client):
    """bf16 bodies averaged into a float32 EMA; keyframe + deltas land where
    full pushes do."""
    beta = 0.95
    for name, mirror in (("bf16", False), ("full", True), ("delta", True)):
        create_constant(client, f"ref-{name}", beta, mirror=mirror)
    tr = SmallNetTrainer(seed=2)
    exact = AveragedModel(tr.model, multi_avg_fn=get_ema_multi_avg_fn(beta), use_buffers=True)
    shadow = SmallNetTrainer(seed=2).model  # holds the bf16-rounded weights
    rounded = AveragedModel(shadow, multi_avg_fn=get_ema_multi_avg_fn(beta), use_buffers=True)
    mirror: dict[str, torch.Tensor] | None = None
    for step in range(50):
        tr.step()
        state = tr.state()
        bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
        push(client, "ref-bf16", 0, step, bf16)
        shadow.load_state_dict({k: v.to(state[k].dtype) for k, v in bf16.items()})
        rounded.update_parameters(shadow)
        exact.update_parameters(tr.model)
        push(client, "ref-full", 0, step, state)
        if mirror is None:
            push(client, "ref-delta", 0, step, state)
            mirror = {k: v.clone() for k, v in state.items()}
        else:
            delta = {}
            for k, v in state.items():
                if v.is_floating_point():
                    delta[k] = v - mirror[k]
                    mirror[k].add_(delta[k])  # the server does the same add
                else:
                    delta[k] = v
                    mirror[k] = v.clone()
            out = push(client, "ref-delta", 0, step, delta, metadata={"polyak.kind": "delta"})
            assert out["applied"] is True
    online = tr.state()
    got_bf16 = fetch_ema(client, "ref-bf16", 0, "ema")
    # Exactly the EMA of the bf16-rounded weights, in float32 ...
    assert_state_close(got_bf16, averaged_state(rounded), online, label="bf16 vs rounded anchor")
    # ... and within bf16 round-off of the float32 anchor.
    assert_state_close(
        got_bf16, averaged_state(exact), online, rtol=8e-3, label="bf16 vs fp32 anchor"
    )
    assert any(
        rel_err(got_bf16[k], averaged_state(exact)[k]) > 1e-6
        for k in got_bf16
        if got_bf16[k].is_floating_point()
    )
    got_full = fetch_ema(client, "ref-full", 0, "ema")
    got_delta = fetch_ema(client, "ref-delta", 0, "ema")
    assert_state_close(got_full, averaged_state(exact), online, label="full")
    assert_state_close(got_delta, got_full, online, label="delta vs full")


def test_ema_dtypes_bfloat16_and_float64(client):
    """``ema_dtype``: the EMA kept in bfloat16 or float64 equals torch's own
    ``lerp_`` in that dtype (the pushed float32 weights cast to it, as
    ``AveragedModel`` over a model cast to that dtype would see them), and
    stays within that dtype's round-off of the float32 ``AveragedModel``."""
    beta = 0.9
    dtypes = {"bfloat16": torch.bfloat16, "float64": torch.float64}
    for name in dtypes:
        create_constant(client, f"ref-ema-{name}", beta, ema_dtype=name)
    tr = SmallNetTrainer(seed=4)
    exact = AveragedModel(tr.model, multi_avg_fn=get_ema_multi_avg_fn(beta), use_buffers=True)
    anchors: dict[str, dict[str, torch.Tensor]] = {name: {} for name in dtypes}
    for step in range(50):
        tr.step()
        state = tr.state()
        exact.update_parameters(tr.model)
        for name, dtype in dtypes.items():
            push(client, f"ref-ema-{name}", 0, step, state)
            for k, v in state.items():
                if not v.is_floating_point():
                    continue
                w = v.to(dtype)
                if step == 0:
                    anchors[name][k] = w.clone()
                else:
                    anchors[name][k].lerp_(w, 1 - beta)
    online = tr.state()
    want32 = averaged_state(exact)
    for name, dtype in dtypes.items():
        got = fetch_ema(client, f"ref-ema-{name}", 0, "ema")
        assert set(got) == set(online)
        for k, v in online.items():
            if not v.is_floating_point():
                assert torch.equal(got[k], v), (name, k)
                continue
            anchor = anchors[name][k]
            assert got[k].dtype == dtype, (name, k, got[k].dtype)  # served as kept
            if dtype == torch.bfloat16:
                # Bit for bit what torch's bfloat16 lerp_ gives, ...
                assert torch.equal(got[k], anchor), (name, k)
                # ... which is a float32 EMA to within bfloat16 round-off.
                assert rel_err(got[k].float(), want32[k]) <= 2e-2, (name, k)
            else:
                assert rel_err(got[k].double(), anchor) <= 1e-12, (name, k)
                assert rel_err(got[k].double(), want32[k].double()) <= 1e-6, (name, k)


def test_nonfinite_skip_tensor_and_allow(client):
    for policy in ("skip_tensor", "allow"):
        create(
            client,
            {
                "name": f"nf-{policy}",
                "world_size": 1,
                "nonfinite": policy,
                "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}],
            },
        )
        a0, b0 = torch.ones(4), torch.full((3,), 2.0)
        push(client, f"nf-{policy}", 0, 0, {"a": a0, "b": b0})
        a1 = torch.tensor([3.0, float("nan"), 3.0, 3.0])
        b1 = torch.full((3,), 4.0)
        out = push(client, f"nf-{policy}", 0, 1, {"a": a1, "b": b1})
        got = fetch_ema(client, f"nf-{policy}", 0, "ema")
        assert torch.equal(got["b"], torch.full((3,), 3.0))
        if policy == "skip_tensor":
            assert out["skipped"] == ["a"]
            assert torch.equal(got["a"], a0)
        else:
            assert "skipped" not in out
            assert torch.isnan(got["a"][1]) and got["a"][0] == 2.0


def test_chunk_metadata_round_trips(client):
    """A rank's EMA comes back with the names, shapes and chunk metadata it pushed."""
    create(client, {"name": "chunks", "world_size": 2})
    shards = '{"w": {"global_shape": [5, 3], "offsets": [3, 0]}}'
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    body = safetensors.torch.save({"w": w, "b": torch.zeros(3)}, metadata={"polyak.shards": shards})
    r = client.put("/v1/runs/chunks/ranks/1/steps/0", content=body)
    assert r.status_code == 200, r.text
    r = client.get("/v1/runs/chunks/ranks/1/ema")
    assert r.status_code == 200
    import tempfile

    from safetensors import safe_open

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(r.content)
        f.flush()
        with safe_open(f.name, "pt") as st:
            meta = st.metadata()
            import json

            assert json.loads(meta["polyak.shards"]) == {
                "w": {"global_shape": [5, 3], "offsets": [3, 0]}
            }
            assert meta["polyak.rank"] == "1" and meta["polyak.step"] == "0"
            assert torch.equal(st.get_tensor("w"), w)
    # Rank 0 never pushed: 404 with a code, not an empty file.
    r = client.get("/v1/runs/chunks/ranks/0/ema")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_data"
