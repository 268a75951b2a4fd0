"""Private training of a small CNN on scikit-learn's bundled handwritten digits (8x8 images).

Runs offline in well under a minute: ``python -m dptorch.cli.examples.digits`` (or ``dptorch
example digits``). A plain PyTorch loop made private by ``PrivacyEngine.make_private_with_epsilon``
in non-wrapping mode (``wrap_model=False``: the CNN stays the CNN). Prints the test accuracy of
the private model next to a non-private one trained the same way, and the privacy spent
(epsilon at delta) with the noise multiplier that reached it; ``--plots DIR`` saves pictures.
``--compiled`` runs the private steps through ``dptorch.capture_step``: each step's forward, backward
and clipping one traced graph, compiled by ``torch.compile``, replayed for every Poisson batch in
replays of ``--batch-size`` rows (one shape, so one trace and one compilation).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine, capture_step
from dptorch.cli.examples.flags import add_shared_flags, check_shared_flags
from dptorch.cli.examples.plots import show_report
from dptorch.cli.examples.random_state import global_generators_kept
from dptorch.cli.examples.threads import threads_to_use
from dptorch.cli.plots import RunHistory, save_pictures
from dptorch.optim.captured_step import CAPTURED_MODES


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


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    epochs: int,
    history: RunHistory,
    *,
    test_accuracy: Callable[[], float],
    epsilon: Optional[Callable[[], float]] = None,
    show_progress: bool = True,
    backward: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
) -> float:
    """The same plain loop for both runs; records each step into ``history``, and the test accuracy
    before training and after each epoch; returns seconds (evaluations included).

    ``epsilon`` (private run) is asked after every step; the clipped fraction comes from the
    optimizer when it is a ``DPOptimizer``. ``backward(x, y)`` (a captured step) replaces the forward
    and ``loss.backward()``, returning the loss.
    """
    from tqdm.auto import tqdm

    criterion = nn.CrossEntropyLoss()
    start = time.perf_counter()
    history.record_test_accuracy(0, test_accuracy())
    with tqdm(total=epochs * len(loader), desc=history.label, unit="step", disable=not show_progress) as bar:
        for epoch in range(1, epochs + 1):
            for x, y in loader:
                optimizer.zero_grad()
                loss = math.nan
                if len(y) and backward is not None:  # the captured forward, backward and clipping
                    loss = backward(x, y).item()
                elif len(y):  # a Poisson batch may be empty: the private step then adds noise only
                    batch_loss = criterion(model(x), y)
                    batch_loss.backward()
                    loss = batch_loss.item()
                optimizer.step()
                history.record(
                    loss=loss,
                    epsilon=epsilon() if epsilon else None,
                    clipped_fraction=getattr(optimizer, "last_clipped_fraction", None),
                )
                shown = {"loss": f"{loss:.3f}"}
                if epsilon:
                    shown["epsilon"] = f"{history.epsilon[-1]:.2f}"
                bar.set_postfix(shown, refresh=False)
                bar.update()
            history.record_test_accuracy(epoch, test_accuracy())
    return time.perf_counter() - start


def run(
    *,
    epsilon: float = 3.0,
    delta: float = 1e-5,
    epochs: int = 20,
    batch_size: int = 128,
    max_grad_norm: float = 1.0,
    lr: float = 0.1,
    mode: str = "auto",
    wrap_model: bool = False,
    compiled: Optional[str] = None,
    seed: int = 0,
    threads: int = 1,
    plots: Optional[str] = None,
    baseline: bool = True,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Set up the private run (every check of the engine runs before anything trains), train the
    non-private model (unless ``baseline=False``), then the private one (its steps captured and
    compiled by the ``torch.compile`` backend ``compiled``, if given); return the report as a dict
    (pictures if ``plots``)."""
    threads = threads_to_use(threads)  # 1 by default: the CNN is too small to gain from more
    torch.set_num_threads(threads)
    start = time.perf_counter()
    train_set, test_set = load_digits_splits(seed)

    torch.manual_seed(seed)
    model = digits_cnn()
    engine = PrivacyEngine()
    first, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        data_loader=DataLoader(train_set, batch_size=batch_size, shuffle=True),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        grad_sample_mode=mode,
        wrap_model=wrap_model,
    )
    private_model = first if wrap_model else model  # wrap_model=False: the controller is returned, train the CNN
    captured = None
    if compiled:  # one loss per image (a trace cannot read the targets for cross-entropy's mean): the step reduces them
        captured = capture_step(optimizer, lambda x, y: nn.functional.cross_entropy(private_model(x), y, reduction="none"),
                                compile={"backend": compiled}, rows_per_replay=batch_size)

    non_private_history = RunHistory("non-private")
    non_private_accuracy = non_private_seconds = None
    if baseline:
        with global_generators_kept():
            torch.manual_seed(seed)
            plain = digits_cnn()
            non_private_seconds = train(
                plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9),
                DataLoader(train_set, batch_size=batch_size, shuffle=True), epochs, non_private_history,
                test_accuracy=lambda: accuracy(plain, test_set), show_progress=verbose,
            )
        non_private_accuracy = accuracy(plain, test_set)

    private_history = RunHistory("private")
    private_seconds = train(
        private_model, optimizer, loader, epochs, private_history, test_accuracy=lambda: accuracy(private_model, test_set),
        epsilon=lambda: engine.get_epsilon(delta), show_progress=verbose, backward=captured,
    )
    report = engine.privacy_report(delta)
    report.update(
        private_accuracy=accuracy(private_model, test_set),
        non_private_accuracy=non_private_accuracy,
        test_size=len(test_set),
        final_loss=private_history.loss[-1],
        threads=threads,
        private_seconds=private_seconds,
        non_private_seconds=non_private_seconds,
        total_seconds=time.perf_counter() - start,
        histories={"private": private_history, "non_private": non_private_history},
        compiled={"backend": compiled, "traces": captured.traces} if captured else None,
    )
    engine.detach()  # hooks and optimizer listener removed: `model` is exactly a plain CNN again
    if plots:
        report["pictures"] = save_pictures(
            plots, private_history, non_private_history, delta=delta, target_epsilon=epsilon
        )
    return report


def build_parser(prog: str = "python -m dptorch.cli.examples.digits") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_shared_flags(parser, epsilon=3.0, epochs=20,
                     batch_size_help="batch size B of the plain loader (default 128); Poisson sampling replaces it at "
                     "rate 1 / (its number of batches), so the expected Poisson batch is N / ceil(N / B): 119.75 for "
                     "the 1437 training images at 128")
    parser.add_argument("--lr", type=float, default=0.1, help="learning rate of the private run (default 0.1)")
    parser.add_argument("--wrap-model", action="store_true", help="use the GradSampleModule wrapper")
    parser.add_argument("--compiled", nargs="?", const="inductor", metavar="BACKEND",
                        help="capture each private step (forward, backward, clipping) as one graph compiled by "
                        "torch.compile with BACKEND (default inductor), replayed in replays of --batch-size rows")
    return parser


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> Dict[str, Any]:
    """Run the example with command-line flags ``argv``; print and return the report."""
    parser = build_parser(prog) if prog else build_parser()
    args = parser.parse_args(argv)
    check_shared_flags(args, parser, dataset_size=len(load_digits_splits(args.seed)[0]))
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.compiled and args.mode not in ("auto", *CAPTURED_MODES):
        parser.error(f"--compiled captures the modes {', '.join(CAPTURED_MODES)} (or auto), not --mode {args.mode}")
    report = run(
        epsilon=args.epsilon, delta=args.delta, epochs=args.epochs, batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm, lr=args.lr, mode=args.mode, wrap_model=args.wrap_model, compiled=args.compiled,
        seed=args.seed, threads=args.threads, plots=args.plots, baseline=not args.no_baseline, verbose=not args.json,
    )
    show_report(report, as_json=args.json)
    return report


if __name__ == "__main__":
    main()
