# A training script written for ema-pytorch, as its README shows it.
import torch
from ema_pytorch import EMA
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
ema = EMA(
    net,
    beta=0.99,  # exponential moving average factor
    update_after_step=10,  # only after this number of .update() calls will it start updating
    update_every=2,  # how often to actually update, to save on compute
)
x, y = torch.randn(32, 6), torch.randn(32, 2)
for _ in range(40):
    optimizer.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()
    ema.update()
with torch.no_grad():
    ema_output = ema(torch.ones(1, 6))
RESULT = {**ema.ema_model.state_dict(), "out": ema_output}
