"""A client program written for Opacus 1.6's non-wrapping mode, with every ``opacus`` renamed to
``dptorch`` and one argument added (``model_loss="mean"``): a ``PreTrainedModel`` around a ``DPLSTM``
whose tied-weight aliases name Opacus' submodule layout, ``make_private(wrap_model=False)``, the model
read back as ``hooks._module``, a ``BatchMemoryManager`` loop that counts logical steps with
``optimizer._is_last_step_skipped``, ``outputs.loss.backward()``, ``hooks.cleanup()``."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from dptorch import PrivacyEngine
from dptorch.layers import DPLSTM
from dptorch.utils.batch_memory_manager import BatchMemoryManager

PAD = -100


class CharLSTMConfig(PretrainedConfig):
    model_type = "char_lstm_migration_test"

    def __init__(self, vocab_size=11, hidden_size=8, num_layers=2, tie_word_embeddings=True, **kwargs):
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers


class CharLSTMForCausalLM(PreTrainedModel):
    config_class = CharLSTMConfig
    # the upper layer shares the lower one's input map and hidden bias, named in Opacus' DPLSTM layout
    _tied_weights_keys = {"lstm.l1.ih.weight": "lstm.l0.ih.weight", "lstm.l1.hh.bias": "lstm.l0.hh.bias"}

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lstm = DPLSTM(config.hidden_size, config.hidden_size, num_layers=config.num_layers, batch_first=True)
        self.head = nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def _init_weights(self, module):
        pass  # the layers' own initialisation

    def forward(self, input_ids, labels=None):
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutput(loss=loss, logits=logits)


def dataset(rows=64, length=7, vocab=11, seed=0):
    """Token rows of varied lengths, padded with -100 in the labels (so the batch's token mean divides by a
    count of the data)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    lengths = torch.randint(3, length + 1, (rows,), generator=g)
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = PAD
    return TensorDataset(ids, labels)


def train(model, *, epochs=2, batch_size=16, max_physical_batch_size=6, noise_multiplier=1.0, max_grad_norm=1.0,
          delta=1e-5, **private):
    """Train as the client does; returns (logical steps, epsilon, the model)."""
    engine = PrivacyEngine(accountant="rdp")
    hooks, optimizer, train_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(dataset(), batch_size=batch_size), noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, wrap_model=False, **private,
    )
    model = hooks._module
    model.train()
    steps = 0
    for _ in range(epochs):
        with BatchMemoryManager(data_loader=train_loader, max_physical_batch_size=max_physical_batch_size,
                                optimizer=optimizer) as memory_safe_loader:
            for input_ids, labels in memory_safe_loader:
                optimizer.zero_grad()
                outputs = model(input_ids=input_ids, labels=labels)
                outputs.loss.backward()
                optimizer.step()
                if not optimizer._is_last_step_skipped:
                    steps += 1
    epsilon = engine.get_epsilon(delta)
    hooks.cleanup()
    return steps, epsilon, model
