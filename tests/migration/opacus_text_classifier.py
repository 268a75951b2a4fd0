"""Opacus' tutorial "Building a text classifier with Differential Privacy" (BERT), in spirit.

The tutorial's steps and calls, with ``opacus`` renamed ``dptorch`` in the imports: a HuggingFace
``BertForSequenceClassification`` with all but its last encoder layer, pooler and classifier
frozen, ``AdamW``, ``make_private_with_epsilon``, ``BatchMemoryManager`` and
``privacy_engine.get_epsilon(DELTA)``; the batches are ``(input_ids, attention_mask,
token_type_ids, labels)`` tensors and the loss is ``model(**inputs)[0]``. Offline and small: a
randomly initialised two-layer BERT and a synthetic two-class "sentiment" task (each class has its
own marker tokens) instead of SNLI and bert-base-cased. ``PrivacyEngine(accountant="rdp")`` gives
Opacus' RDP epsilon.
"""

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import BertConfig, BertForSequenceClassification

from dptorch import PrivacyEngine
from dptorch.utils.batch_memory_manager import BatchMemoryManager

EPOCHS = 3
LOGGING_INTERVAL = 5
EPSILON = 8.0
DELTA = 1e-4
BATCH_SIZE = 64
MAX_PHYSICAL_BATCH_SIZE = 32
MAX_GRAD_NORM = 0.1
LR = 2e-3
MAX_SEQ_LENGTH = 16
VOCAB_SIZE = 64


def synthetic_text(n, seed, label_noise=0.1):
    """Random token ids 4..63 after a first token that tells the class (2 or 3, wrong 10% of the time).

    The first token stands in for the informative [CLS] features of a pretrained BERT: a randomly
    initialised one has none, and fine-tuning its last layer could not learn in a few DP steps.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    input_ids = torch.randint(4, VOCAB_SIZE, (n, MAX_SEQ_LENGTH), generator=g)
    flipped = (torch.rand(n, generator=g) < label_noise).long()
    input_ids[:, 0] = 2 + (labels ^ flipped)
    lengths = torch.randint(MAX_SEQ_LENGTH // 2, MAX_SEQ_LENGTH + 1, (n,), generator=g)
    attention_mask = (torch.arange(MAX_SEQ_LENGTH).unsqueeze(0) < lengths.unsqueeze(1)).long()
    input_ids = input_ids * attention_mask  # padding id 0
    token_type_ids = torch.zeros_like(input_ids)
    return TensorDataset(input_ids, attention_mask, token_type_ids, labels)


def accuracy(preds, labels):
    return (preds == labels).mean()


def evaluate(model, test_dataloader, device):
    model.eval()

    loss_arr = []
    accuracy_arr = []

    for batch in test_dataloader:
        batch = tuple(t.to(device) for t in batch)

        with torch.no_grad():
            inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2],
                      "labels": batch[3]}

            outputs = model(**inputs)
            loss, logits = outputs[:2]

            preds = np.argmax(logits.detach().cpu().numpy(), axis=1)
            labels = inputs["labels"].detach().cpu().numpy()

            loss_arr.append(loss.item())
            accuracy_arr.append(accuracy(preds, labels))

    model.train()
    return float(np.mean(loss_arr)), float(np.mean(accuracy_arr))


def main():
    torch.manual_seed(0)
    device = torch.device("cpu")
    train_dataset = synthetic_text(512, seed=0)
    test_dataset = synthetic_text(256, seed=1)
    train_dataloader = DataLoader(train_dataset, batch_size=BATCH_SIZE)
    test_dataloader = DataLoader(test_dataset, batch_size=BATCH_SIZE)

    config = BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=MAX_SEQ_LENGTH, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)

    trainable_layers = [model.bert.encoder.layer[-1], model.bert.pooler, model.classifier]
    total_params = 0
    trainable_params = 0

    for p in model.parameters():
        p.requires_grad = False
        total_params += p.numel()

    for layer in trainable_layers:
        for p in layer.parameters():
            p.requires_grad = True
            trainable_params += p.numel()

    print(f"Total parameters count: {total_params}")
    print(f"Trainable parameters count: {trainable_params}")

    model = model.to(device)
    model.train()
    eval_before = evaluate(model, test_dataloader, device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-8)

    privacy_engine = PrivacyEngine(accountant="rdp")

    model, optimizer, train_dataloader = privacy_engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_dataloader,
        target_delta=DELTA,
        target_epsilon=EPSILON,
        epochs=EPOCHS,
        max_grad_norm=MAX_GRAD_NORM,
    )

    for epoch in range(1, EPOCHS + 1):
        losses = []

        with BatchMemoryManager(
            data_loader=train_dataloader, max_physical_batch_size=MAX_PHYSICAL_BATCH_SIZE, optimizer=optimizer
        ) as memory_safe_data_loader:
            for step, batch in enumerate(memory_safe_data_loader):
                optimizer.zero_grad()

                batch = tuple(t.to(device) for t in batch)
                inputs = {"input_ids": batch[0], "attention_mask": batch[1], "token_type_ids": batch[2],
                          "labels": batch[3]}

                outputs = model(**inputs)  # output = loss, logits, hidden_states, attentions

                loss = outputs[0]
                loss.backward()
                losses.append(loss.item())

                optimizer.step()

                if step > 0 and step % LOGGING_INTERVAL == 0:
                    train_loss = np.mean(losses)
                    eps = privacy_engine.get_epsilon(DELTA)

                    eval_loss, eval_accuracy = evaluate(model, test_dataloader, device)

                    print(
                        f"Epoch: {epoch} | "
                        f"Step: {step} | "
                        f"Train loss: {train_loss:.3f} | "
                        f"Eval loss: {eval_loss:.3f} | "
                        f"Eval accuracy: {eval_accuracy:.3f} | "
                        f"ɛ: {eps:.2f}"
                    )

    eval_after = evaluate(model, test_dataloader, device)
    return {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "optimizer": optimizer,
        "train_loader": train_dataloader,
        "privacy_engine": privacy_engine,
        "epsilon": privacy_engine.get_epsilon(DELTA),
        "trainable_params": trainable_params,
    }


if __name__ == "__main__":
    main()
