"""Opacus' tutorial "Building an Image Classifier with Differential Privacy", in spirit.

The tutorial's steps and calls, with ``opacus`` renamed ``dptorch`` in the imports: check the
model with ``ModuleValidator.validate``, replace its BatchNorm with ``ModuleValidator.fix``, make
it private with ``make_private_with_epsilon``, train through ``BatchMemoryManager`` with physical
batches smaller than the logical ones, and report ``privacy_engine.get_epsilon(DELTA)``.
Offline and small: scikit-learn's bundled 8x8 digits instead of CIFAR-10, and a small CNN with
BatchNorm instead of ResNet-18. ``PrivacyEngine(accountant="rdp")`` gives Opacus' RDP epsilon.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

from dptorch import PrivacyEngine
from dptorch.utils.batch_memory_manager import BatchMemoryManager
from dptorch.validators import ModuleValidator

EPOCHS = 4
LR = 2e-3
BATCH_SIZE = 128
MAX_PHYSICAL_BATCH_SIZE = 48
MAX_GRAD_NORM = 1.2
EPSILON = 50.0
DELTA = 1e-5


def load_digits_data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    train_data = torch.utils.data.TensorDataset(x[order[:cut]], y[order[:cut]])
    test_data = torch.utils.data.TensorDataset(x[order[cut:]], y[order[cut:]])
    return train_data, test_data


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
    )


def accuracy(preds, labels):
    return (preds == labels).mean()


def train(model, train_loader, optimizer, epoch, device, privacy_engine, criterion):
    model.train()
    losses = []
    top1_acc = []

    with BatchMemoryManager(
        data_loader=train_loader, max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE, optimizer=optimizer
    ) as memory_safe_data_loader:
        for i, (images, target) in enumerate(memory_safe_data_loader):
            optimizer.zero_grad()
            images = images.to(device)
            target = target.to(device)

            # compute output
            output = model(images)
            loss = criterion(output, target)

            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()

            # measure accuracy and record loss
            acc = accuracy(preds, labels)

            losses.append(loss.item())
            top1_acc.append(acc)

            loss.backward()
            optimizer.step()

    epsilon = privacy_engine.get_epsilon(DELTA)
    print(
        f"\tTrain Epoch: {epoch} \t"
        f"Loss: {np.mean(losses):.6f} "
        f"Acc@1: {np.mean(top1_acc) * 100:.6f} "
        f"(ε = {epsilon:.2f}, δ = {DELTA})"
    )
    return len(losses)


def test(model, test_loader, device, criterion):
    model.eval()
    losses = []
    top1_acc = []

    with torch.no_grad():
        for images, target in test_loader:
            images = images.to(device)
            target = target.to(device)

            output = model(images)
            loss = criterion(output, target)
            preds = np.argmax(output.detach().cpu().numpy(), axis=1)
            labels = target.detach().cpu().numpy()
            acc = accuracy(preds, labels)

            losses.append(loss.item())
            top1_acc.append(acc)

    top1_avg = np.mean(top1_acc)
    print(f"\tTest set:Loss: {np.mean(losses):.6f} Acc: {top1_avg * 100:.6f} ")
    return float(top1_avg)


def main():
    torch.manual_seed(0)
    device = torch.device("cpu")
    train_data, test_data = load_digits_data()
    train_loader = torch.utils.data.DataLoader(train_data, batch_size=BATCH_SIZE)
    test_loader = torch.utils.data.DataLoader(test_data, batch_size=BATCH_SIZE, shuffle=False)

    model = make_model()
    errors = ModuleValidator.validate(model, strict=False)
    print(errors[-5:])
    model = ModuleValidator.fix(model)
    errors_after_fix = ModuleValidator.validate(model, strict=False)
    model = model.to(device)

    criterion = nn.CrossEntropyLoss()
    optimizer = optim.RMSprop(model.parameters(), lr=LR)

    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, train_loader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        epochs=EPOCHS,
        target_epsilon=EPSILON,
        target_delta=DELTA,
        max_grad_norm=MAX_GRAD_NORM,
    )
    print(f"Using sigma={optimizer.noise_multiplier} and C={MAX_GRAD_NORM}")

    physical_batches = 0
    for epoch in range(EPOCHS):
        physical_batches += train(model, train_loader, optimizer, epoch + 1, device, privacy_engine, criterion)

    top1_acc = test(model, test_loader, device, criterion)
    return {
        "errors_before_fix": errors,
        "errors_after_fix": errors_after_fix,
        "model": model,
        "optimizer": optimizer,
        "train_loader": train_loader,
        "privacy_engine": privacy_engine,
        "physical_batches": physical_batches,
        "test_accuracy": top1_acc,
        "epsilon": privacy_engine.get_epsilon(DELTA),
        "train_size": len(train_data),
    }


if __name__ == "__main__":
    main()
