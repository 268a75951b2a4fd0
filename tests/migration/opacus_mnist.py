"""Opacus' examples/mnist.py (1.x), with ``opacus`` renamed ``dptorch`` in the imports.

Offline: ``datasets.MNIST`` is replaced by a small synthetic MNIST-shaped dataset (1x28x28
images whose class is a bright block at one of ten places), and the loaders use no worker
processes. ``PrivacyEngine(accountant="rdp")`` keeps the example's
``accountant.get_privacy_spent(delta=)`` call (an RDP accountant method) meaningful. ``main``
takes the example's command-line flags and returns what it printed, for the tests.
"""

import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from dptorch import PrivacyEngine

# Precomputed characteristics of the MNIST dataset
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        x = self.fc2(x)  # -> [B, 10]
        return x

    def name(self):
        return "SampleConvNet"


def synthetic_mnist(n, seed):
    """MNIST-shaped stand-in: class c is a bright 8x8 block at the c-th of ten places, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = 0.2 * torch.rand(n, 1, 28, 28, generator=g)
    for i, c in enumerate(y.tolist()):
        row, col = 2 + 12 * (c // 5), 1 + 5 * (c % 5)
        x[i, 0, row : row + 8, col : col + 6] += 0.8
    x = (x - MNIST_MEAN) / MNIST_STD
    return torch.utils.data.TensorDataset(x, y)


def train(args, model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    if not args.disable_dp:
        epsilon, best_alpha = privacy_engine.accountant.get_privacy_spent(delta=args.delta)
        print(
            f"Train Epoch: {epoch} \t"
            f"Loss: {np.mean(losses):.6f} "
            f"(ε = {epsilon:.2f}, δ = {args.delta}) for α = {best_alpha}"
        )
    else:
        epsilon = None
        print(f"Train Epoch: {epoch} \t Loss: {np.mean(losses):.6f}")
    return float(np.mean(losses)), epsilon


def test(model, device, test_loader):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += criterion(output, target).item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print(
        "\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.2f}%)\n".format(
            test_loss,
            correct,
            len(test_loader.dataset),
            100.0 * correct / len(test_loader.dataset),
        )
    )
    return correct / len(test_loader.dataset)


def main(argv=None):
    # Training settings
    parser = argparse.ArgumentParser(
        description="Opacus MNIST Example",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-b", "--batch-size", type=int, default=64, metavar="B", help="Batch size")
    parser.add_argument("--test-batch-size", type=int, default=1024, metavar="TB", help="input batch size for testing")
    parser.add_argument("-n", "--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
    parser.add_argument("-r", "--n-runs", type=int, default=1, metavar="R", help="number of runs to average on")
    parser.add_argument("--lr", type=float, default=0.1, metavar="LR", help="learning rate")
    parser.add_argument("--sigma", type=float, default=1.0, metavar="S", help="Noise multiplier")
    parser.add_argument(
        "-c", "--max-per-sample-grad_norm", type=float, default=1.0, metavar="C",
        help="Clip per-sample gradients to this norm",
    )
    parser.add_argument("--delta", type=float, default=1e-5, metavar="D", help="Target delta")
    parser.add_argument("--device", type=str, default="cpu", help="GPU ID for this process")
    parser.add_argument("--disable-dp", action="store_true", default=False, help="Disable privacy training")
    parser.add_argument(
        "--secure-rng", action="store_true", default=False,
        help="Enable Secure RNG to have trustworthy privacy guarantees. Comes at a performance cost",
    )
    parser.add_argument("--n-train", type=int, default=60000, help="size of the synthetic training set")
    parser.add_argument("--n-test", type=int, default=10000, help="size of the synthetic test set")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    train_loader = torch.utils.data.DataLoader(synthetic_mnist(args.n_train, seed=0), batch_size=args.batch_size)
    test_loader = torch.utils.data.DataLoader(
        synthetic_mnist(args.n_test, seed=1), batch_size=args.test_batch_size, shuffle=True
    )
    run_results = []
    history = []
    for _ in range(args.n_runs):
        model = SampleConvNet().to(device)

        optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
        privacy_engine = None

        if not args.disable_dp:
            privacy_engine = PrivacyEngine(accountant="rdp", secure_mode=args.secure_rng)
            model, optimizer, train_loader = privacy_engine.make_private(
                module=model,
                optimizer=optimizer,
                data_loader=train_loader,
                noise_multiplier=args.sigma,
                max_grad_norm=args.max_per_sample_grad_norm,
            )

        for epoch in range(1, args.epochs + 1):
            history.append(train(args, model, device, train_loader, optimizer, privacy_engine, epoch))
        run_results.append(test(model, device, test_loader))

    if len(run_results) > 1:
        print(
            "Accuracy averaged over {} runs: {:.2f}% ± {:.2f}%".format(
                len(run_results), np.mean(run_results) * 100, np.std(run_results) * 100
            )
        )
    return {"accuracy": run_results, "history": history, "privacy_engine": privacy_engine,
            "train_loader": train_loader, "optimizer": optimizer}


if __name__ == "__main__":
    main()
