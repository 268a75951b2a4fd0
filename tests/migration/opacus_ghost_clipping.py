"""Opacus 1.6's fast gradient clipping ("ghost clipping") recipe, with ``opacus`` renamed ``dptorch``.

``make_private(..., criterion=criterion, grad_sample_mode="ghost")`` returns four items in Opacus:
the model, the optimizer, the wrapped criterion (whose ``backward`` does both ghost passes) and
the data loader. Offline: a small synthetic two-class problem.
"""

import torch
from torch import nn

from dptorch import PrivacyEngine


def main(epochs=3, delta=1e-5, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(512, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(x_all, (x_all[:, :4].sum(dim=1) > 0).long())
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=64)

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss()

    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, criterion, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        criterion=criterion,
        noise_multiplier=1.1,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    losses = []
    for _ in range(epochs):
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {"losses": losses, "epsilon": privacy_engine.get_epsilon(delta), "train_loader": train_loader}


if __name__ == "__main__":
    print(main())
