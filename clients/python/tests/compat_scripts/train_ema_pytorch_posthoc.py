# A training script written for ema-pytorch's post-hoc EMA, as its README shows it.
import torch
from ema_pytorch import PostHocEMA

torch.manual_seed(0)
net = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(net.parameters(), lr=1e-2)
emas = PostHocEMA(
    net,
    sigma_rels=(0.05, 0.3),  # a sigma_rel of 0.05 corresponds to a gamma of 16.97
    update_every=1,  # how often to actually update, to save on compute
    checkpoint_every_num_steps=10,
    checkpoint_folder="./post-hoc-ema-checkpoints",
)
net.train()
x, y = torch.randn(32, 8), torch.randn(32, 8)
for _ in range(50):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()
    emas.update()
emas.eval()
synthesized_ema = emas.synthesize_ema_model(sigma_rel=0.15)
with torch.no_grad():
    synthesized_ema_output = synthesized_ema(torch.ones(1, 8))
RESULT = {**synthesized_ema.ema_model.state_dict(), "out": synthesized_ema_output}
