"""Opacus' examples/char-lstm-classification.py (1.x), with ``opacus`` renamed ``dptorch``.

Offline: the names-by-language files are replaced by synthetic "names" of three made-up
languages (each with its own letters), and the loaders use no worker processes. The model, the
byte encoder, the padded collate and the training loop are the example's; ``DPLSTM`` (or
``DPGRU``/``DPRNN``) comes from ``dptorch.layers``. ``main`` takes the example's flags and returns
what it printed, for the tests. ``--uniform-sampler`` builds the training loader on
``UniformWithReplacementSampler`` as the example's older version does.
"""

import argparse
from statistics import mean

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset

from dptorch import PrivacyEngine
from dptorch.layers import DPGRU, DPLSTM, DPRNN
from dptorch.utils.uniform_sampler import UniformWithReplacementSampler

parser = argparse.ArgumentParser(description="PyTorch Name language classification DP Training")
parser.add_argument("--device", type=str, default="cpu", help="GPU ID for this process")
parser.add_argument("-b", "--batch-size", default=32, type=int, metavar="N", help="mini-batch size")
parser.add_argument("--batch-size-test", default=1600, type=int, help="mini-batch size for test dataset")
parser.add_argument("--mode", default="lstm", choices=["lstm", "gru", "rnn"], help="recursive network type")
parser.add_argument("--embedding-size", default=64, type=int, help="Character embedding dimension")
parser.add_argument("--hidden-size", default=128, type=int, help="hidden state dimensions")
parser.add_argument("--n-layers", default=1, type=int, help="How many layers to use")
parser.add_argument("--bidirectional", action="store_true", default=False, help="makes the RNN bidirectional")
parser.add_argument("--learning-rate", default=2.0, type=float, metavar="LR", help="initial learning rate")
parser.add_argument("--epochs", type=int, default=10, help="Number of training epochs")
parser.add_argument("--train-split", type=float, default=0.8, help="Fraction of data to utilize for training")
parser.add_argument("--sigma", type=float, default=1.0, metavar="S", help="Noise multiplier")
parser.add_argument("-c", "--max-per-sample-grad-norm", type=float, default=1.5, metavar="C", help="Clip bound")
parser.add_argument("--disable-dp", action="store_true", default=False, help="Disable privacy training")
parser.add_argument("--secure-rng", action="store_true", default=False, help="Enable Secure RNG")
parser.add_argument("--delta", type=float, default=8e-5, metavar="D", help="Target delta")
parser.add_argument("--n-names", type=int, default=2000, help="number of synthetic names")
parser.add_argument("--uniform-sampler", action="store_true", default=False,
                    help="sample training batches with UniformWithReplacementSampler")


class CharByteEncoder(nn.Module):
    """Encodes the UTF-8 bytes of a string, between a start token (256) and an end token (257)."""

    def __init__(self):
        super().__init__()
        self.start_token = "<s>"
        self.end_token = "</s>"
        self.pad_token = "<pad>"

        self.start_idx = 256
        self.end_idx = 257
        self.pad_idx = 258

    def forward(self, s: str, pad_to=0) -> torch.LongTensor:
        encoded = s.encode()
        n_pad = pad_to - len(encoded) if pad_to > len(encoded) else 0
        return torch.LongTensor(
            [self.start_idx] + [c for c in encoded] + [self.end_idx] + [self.pad_idx for _ in range(n_pad)]
        )

    def __len__(self):
        return 259


LANGUAGES = {"vowelish": "aeiouly", "consonantish": "kqzxvbn", "middling": "rstmdgh"}


class NamesDataset(Dataset):
    """Synthetic names: each language draws its letters mostly from its own alphabet."""

    def __init__(self, n, seed=0):
        self.labels = list(LANGUAGES)
        self.labels_dict = {label: i for i, label in enumerate(self.labels)}
        self.encoder = CharByteEncoder()
        g = torch.Generator().manual_seed(seed)
        every = "".join(LANGUAGES.values())
        self.samples = []
        for _ in range(n):
            label_id = int(torch.randint(0, len(self.labels), (1,), generator=g))
            own = LANGUAGES[self.labels[label_id]]
            length = int(torch.randint(3, 9, (1,), generator=g))
            letters = [
                own[int(torch.randint(0, len(own), (1,), generator=g))]
                if torch.rand(1, generator=g).item() < 0.8
                else every[int(torch.randint(0, len(every), (1,), generator=g))]
                for _ in range(length)
            ]
            name = "".join(letters).capitalize()
            self.samples.append((self.encoder(name), torch.tensor(label_id).long()))

    def __getitem__(self, i):
        return self.samples[i]

    def __len__(self):
        return len(self.samples)


VOCAB_SIZE = 256 + 3  # 256 alternatives in one byte, plus 3 special characters.


class CharNNClassifier(nn.Module):
    def __init__(self, rnn_type, embedding_size, hidden_size, output_size, num_layers=1, bidirectional=False,
                 vocab_size=VOCAB_SIZE):
        super().__init__()

        self.embedding_size = embedding_size
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.vocab_size = vocab_size

        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.rnn = rnn_type(
            embedding_size,
            hidden_size,
            num_layers=num_layers,
            bidirectional=bidirectional,
            batch_first=True,
        )
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x, hidden=None):
        x = self.embedding(x)  # -> [B, T, D]
        x, _ = self.rnn(x, hidden)  # -> [B, T, H]
        x = x[:, -1, :]  # -> [B, H]
        x = self.out_layer(x)  # -> [B, C]
        return x


def padded_collate(batch, padding_idx=0):
    x = pad_sequence([elem[0] for elem in batch], batch_first=True, padding_value=padding_idx)
    y = torch.stack([elem[1] for elem in batch]).long()

    return x, y


def train(model, criterion, optimizer, train_loader, epoch, privacy_engine, delta, device="cuda:0"):
    model.train()

    accs = []
    losses = []
    for x, y in train_loader:
        x = x.to(device)
        y = y.to(device)

        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()

        optimizer.step()
        optimizer.zero_grad()

        preds = logits.argmax(-1)
        n_correct = float(preds.eq(y).sum())
        batch_accuracy = n_correct / len(y)

        accs.append(batch_accuracy)
        losses.append(float(loss))

    printstr = f"\t Epoch {epoch}. Accuracy: {mean(accs):.6f} | Loss: {mean(losses):.6f}"
    if privacy_engine:
        epsilon = privacy_engine.accountant.get_epsilon(delta=delta)
        printstr += f" | (ε = {epsilon:.2f}, δ = {delta})"
    print(printstr)
    return mean(losses)


def test(model, test_loader, privacy_engine, delta, device="cuda:0"):
    model.eval()

    accs = []
    with torch.no_grad():
        for x, y in test_loader:
            x = x.to(device)
            y = y.to(device)

            preds = model(x).argmax(-1)
            n_correct = float(preds.eq(y).sum())
            batch_accuracy = n_correct / len(y)

            accs.append(batch_accuracy)
    mean_acc = mean(accs)
    printstr = "\n----------------------------\n" f"Test Accuracy: {mean_acc:.6f}"
    if privacy_engine:
        epsilon = privacy_engine.get_epsilon(delta)
        printstr += f" (ε = {epsilon:.2f}, δ = {delta})"
    print(printstr + "\n----------------------------\n")
    return mean_acc


def main(argv=None):
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    ds = NamesDataset(args.n_names)
    train_len = int(args.train_split * len(ds))
    test_len = len(ds) - train_len

    print(f"{train_len} samples for training, {test_len} for testing")

    if args.mode == "rnn":
        rnn_type = DPRNN
    elif args.mode == "gru":
        rnn_type = DPGRU
    elif args.mode == "lstm":
        rnn_type = DPLSTM
    else:
        raise ValueError(f"Invalid network type: {args.mode}")
    model = CharNNClassifier(
        rnn_type,
        args.embedding_size,
        args.hidden_size,
        len(ds.labels),
        args.n_layers,
        args.bidirectional,
    )
    model = model.to(device)

    train_ds, test_ds = torch.utils.data.random_split(
        ds, [train_len, test_len], generator=torch.Generator().manual_seed(0)
    )

    if args.uniform_sampler:
        train_loader = DataLoader(
            train_ds,
            batch_sampler=UniformWithReplacementSampler(
                num_samples=len(train_ds), sample_rate=args.batch_size / len(train_ds)
            ),
            collate_fn=padded_collate,
        )
    else:
        train_loader = DataLoader(train_ds, batch_size=args.batch_size, collate_fn=padded_collate)

    test_loader = DataLoader(test_ds, batch_size=args.batch_size_test, shuffle=False, collate_fn=padded_collate)

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)

    if not args.disable_dp:
        privacy_engine = PrivacyEngine(accountant="rdp", secure_mode=args.secure_rng)
        model, optimizer, train_loader = privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=train_loader,
            noise_multiplier=args.sigma,
            max_grad_norm=args.max_per_sample_grad_norm,
        )
    else:
        privacy_engine = None

    print(f"Train stats ({args.mode}): \n")
    losses = []
    for epoch in range(args.epochs):
        loss = train(model, criterion, optimizer, train_loader, epoch, privacy_engine, args.delta, device=device)
        losses.append(loss)

    mean_acc = test(model, test_loader, privacy_engine, args.delta, device=device)
    return {"accuracy": mean_acc, "losses": losses, "privacy_engine": privacy_engine, "train_loader": train_loader,
            "optimizer": optimizer, "n_classes": len(ds.labels)}


if __name__ == "__main__":
    main()
