"""SWA with BatchNorm, torch's ``swa_utils`` recipe (``SWALR``, an ``swa``
average, then ``update_bn`` over the training data) with the average kept
by polyak: ``ema_weights(model, "swa", bn_loader=loader)`` gives the BN
statistics ``update_bn`` gives on an ``AveragedModel`` of the same run."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

SWA_START = 5
STEPS = 15


def test_swa_recipe_recomputes_batchnorm_statistics(client, run_name):
    torch.manual_seed(50)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(51)
    xs = torch.randn(64, 4, generator=g) * 3 + 1
    ys = torch.randn(64, 2, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    swa_lr = SWALR(opt, swa_lr=0.01, anneal_epochs=3)
    anchor = AveragedModel(model)  # torch's SWA average, the reference
    run = client.create_run(
        run_name, profiles=[{"name": "swa", "kind": "swa", "start_step": SWA_START}]
    )
    pusher = run.pusher()
    pusher.attach(opt, model)
    for step in range(STEPS):
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # pushed as `step`
        opt.zero_grad()
        if step >= SWA_START:
            anchor.update_parameters(model)
            swa_lr.step()
    update_bn(loader, anchor)

    online = {k: v.clone() for k, v in model.state_dict().items()}
    with pusher.ema_weights(model, "swa", bn_loader=loader):
        bn, want = model[1], anchor.module[1]
        for name in ("weight", "bias"):
            assert torch.allclose(getattr(bn, name), getattr(want, name), rtol=0, atol=1e-6)
        assert torch.allclose(bn.running_mean, want.running_mean, rtol=0, atol=1e-5)
        assert torch.allclose(bn.running_var, want.running_var, rtol=1e-5, atol=1e-5)
        assert int(bn.num_batches_tracked) == int(want.num_batches_tracked) == len(loader)
        # The statistics are the averaged weights' own, not the online ones.
        assert not torch.allclose(bn.running_mean, online["1.running_mean"], atol=1e-3)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in online.items())
    pusher.close()
