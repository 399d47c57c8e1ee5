# A training script written for torch's swa_utils, as its docs show it.
import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
data = torch.utils.data.TensorDataset(torch.randn(64, 6), torch.randn(64, 2))
loader = torch.utils.data.DataLoader(data, batch_size=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
swa_model = AveragedModel(model)
ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
swa_start = 5
swa_scheduler = SWALR(optimizer, swa_lr=0.01)
for epoch in range(10):
    for x, y in loader:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        ema_model.update_parameters(model)
    if epoch > swa_start:
        swa_model.update_parameters(model)
        swa_scheduler.step()
    else:
        scheduler.step()
update_bn(loader, swa_model)
preds = swa_model(torch.ones(3, 6))
RESULT = {
    **{f"swa.{k}": v for k, v in swa_model.module.state_dict().items()},
    **{f"ema.{k}": v for k, v in ema_model.module.state_dict().items()},
    "preds": preds.detach(),
}
