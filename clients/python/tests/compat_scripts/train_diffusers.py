# A training script written for diffusers' EMAModel, as its examples use it.
import torch
from diffusers.training_utils import EMAModel
from torch import nn

torch.manual_seed(0)
unet = nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 6))
optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
ema_unet = EMAModel(unet.parameters(), decay=0.995, use_ema_warmup=True, power=3 / 4)
for _ in range(40):
    noise = torch.randn(8, 6)
    loss = nn.functional.mse_loss(unet(noise), noise)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    ema_unet.step(unet.parameters())
# Validation with the EMA weights, then back to the online ones.
ema_unet.store(unet.parameters())
ema_unet.copy_to(unet.parameters())
with torch.no_grad():
    val = unet(torch.ones(1, 6))
ema_unet.restore(unet.parameters())
RESULT = {**{f"shadow.{i}": t for i, t in enumerate(ema_unet.shadow_params)}, "val": val}
