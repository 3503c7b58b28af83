"""The small model the cache and leftover fault tests compile: one model object per process, so
every test of a session sees the same weights and the same engine cache keys."""
import torch


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


torch.manual_seed(0)
MODEL, X = TwoLayers().eval(), torch.randn(4, 16)
