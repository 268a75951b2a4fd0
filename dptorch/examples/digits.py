"""Private training of a small CNN on scikit-learn's bundled handwritten digits (8x8 images).

Runs offline in well under a minute: ``python -m dptorch.examples.digits``. Prints the test
accuracy of the private model next to a non-private one trained the same way, and the
privacy spent (epsilon at delta) with the noise multiplier that reached it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine


def load_digits_splits(seed: int = 0) -> Tuple[TensorDataset, TensorDataset]:
    """Digits as (N, 1, 8, 8) float tensors in [0, 1]; a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, test = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def digits_cnn() -> nn.Module:
    """A small CNN with GroupNorm (BatchNorm would mix samples)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def accuracy(model: nn.Module, dataset: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        correct = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def train_epochs(model, optimizer, loader, epochs: int, on_epoch=None) -> List[float]:
    """Plain training loop (identical for private and non-private runs); returns epoch losses."""
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(epochs):
        total, count = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            if len(y):  # a Poisson batch may be empty: the private step then adds noise only
                loss = criterion(model(x), y)
                loss.backward()
                total, count = total + loss.item() * len(y), count + len(y)
            optimizer.step()
        losses.append(total / max(count, 1))
        if on_epoch:
            on_epoch(epoch, losses[-1])
    return losses


def run(
    *,
    epsilon: float = 3.0,
    delta: float = 1e-5,
    epochs: int = 20,
    batch_size: int = 128,
    max_grad_norm: float = 1.0,
    lr: float = 0.1,
    mode: str = "hooks",
    wrap_model: bool = False,
    seed: int = 0,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Train private and non-private models; return the report as a dict."""
    say = print if verbose else (lambda *a, **k: None)
    train, test = load_digits_splits(seed)
    torch.manual_seed(seed)
    baseline = digits_cnn()
    start = time.perf_counter()
    train_epochs(baseline, torch.optim.SGD(baseline.parameters(), lr=0.1, momentum=0.9),
                 DataLoader(train, batch_size=batch_size, shuffle=True), epochs)
    baseline_acc = accuracy(baseline, test)
    torch.manual_seed(seed)
    model = digits_cnn()
    engine = PrivacyEngine()
    private_model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        data_loader=DataLoader(train, batch_size=batch_size, shuffle=True),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        grad_sample_mode=mode,
        wrap_model=wrap_model,
    )
    say(f"private training: noise multiplier {optimizer.noise_multiplier:.3f}, sample rate {engine.sample_rate:.4f}")
    private_start = time.perf_counter()
    losses = train_epochs(
        private_model, optimizer, loader, epochs,
        on_epoch=lambda e, l: say(f"  epoch {e + 1:2d}/{epochs}  loss {l:.3f}  epsilon {engine.get_epsilon(delta):.2f}"),
    )
    report = engine.privacy_report(delta)
    report.update(
        private_accuracy=accuracy(private_model, test),
        non_private_accuracy=baseline_acc,
        final_loss=losses[-1],
        private_seconds=time.perf_counter() - private_start,
        total_seconds=time.perf_counter() - start,
    )
    engine.detach()
    return report


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--mode", default="hooks", choices=["hooks", "functorch"])
    parser.add_argument("--wrap-model", action="store_true", help="use the GradSampleModule wrapper")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run(
        epsilon=args.epsilon, delta=args.delta, epochs=args.epochs, batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm, lr=args.lr, mode=args.mode, wrap_model=args.wrap_model,
        verbose=not args.json,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"\naccuracy: private {report['private_accuracy']:.3f}, non-private {report['non_private_accuracy']:.3f}\n"
            f"privacy: epsilon {report['epsilon']:.2f} at delta {report['delta']:g} "
            f"(noise multiplier {report['noise_multiplier']:.3f}, {report['steps']} steps, "
            f"sample rate {report['sample_rate']:.4f}, {report['accountant']} accountant)\n"
            f"wall time: {report['total_seconds']:.1f} s"
        )
    return report


if __name__ == "__main__":
    main()
