# A training script written for timm's ModelEmaV3, as timm's train.py uses it.
import torch
from timm.utils.model_ema import ModelEmaV3
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model_ema = ModelEmaV3(model, decay=0.998, use_warmup=True, warmup_power=0.75)
num_updates = 0
for _epoch in range(4):
    for _ in range(10):
        x, y = torch.randn(16, 6), torch.randn(16, 2)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        num_updates += 1
        model_ema.update(model, step=num_updates)
    model_ema.eval()
    with torch.no_grad():
        val = model_ema(torch.ones(2, 6))
RESULT = {**model_ema.module.state_dict(), "val": val}
