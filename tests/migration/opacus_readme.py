"""Opacus' README quick-start, with ``opacus`` renamed ``dptorch`` in the imports.

Offline: the dataset is a small synthetic two-class problem instead of the user's own. The
engine's accountant is "rdp" so that the epsilon is Opacus' figure (the dptorch default is "pld").
"""

import torch
from torch import nn
from torch.optim import SGD

from dptorch import PrivacyEngine


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def synthetic_dataset(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return torch.utils.data.TensorDataset(x, y)


def full_loss(model, dataset):
    x, y = dataset.tensors
    model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(model(x), y).item()
    model.train()
    return loss


def main(epochs=3, delta=1e-5, seed=0):
    torch.manual_seed(seed)
    dataset = synthetic_dataset(seed=seed)

    model = Net()
    optimizer = SGD(model.parameters(), lr=0.5)
    data_loader = torch.utils.data.DataLoader(dataset, batch_size=64)
    loss_before = full_loss(model, dataset)

    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, data_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=data_loader,
        noise_multiplier=1.1,
        max_grad_norm=1.0,
    )
    # Now it's business as usual
    criterion = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for x, y in data_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()

    return {
        "loss_before": loss_before,
        "loss_after": full_loss(model, dataset),
        "epsilon": privacy_engine.get_epsilon(delta),
        "model": model,
        "optimizer": optimizer,
        "data_loader": data_loader,
    }


if __name__ == "__main__":
    print(main())
