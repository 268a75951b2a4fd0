"""The engine-less HF Trainer flow of Opacus' ``examples/huggingface_trainer.py``, after the rename.

A ``transformers.Trainer`` subclass of our own drives the same API the way that example does: the
controller attached to the untouched model by ``wrap_model(..., wrap_model=False)``, the optimizer
class from ``get_optimizer_class`` built with Opacus' keywords only (no ``hooks=``), an accountant
hooked into the optimizer, the Trainer's loader made Poisson and split into physical batches, and
a callback that calls ``optimizer.step()`` at every sub-step while the skip queue decides which
steps are real. Tiny BERT built from a config, generated data; hooks and ghost modes, with and
without LoRA, with gradient accumulation.
"""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from dptorch.accountants import RDPAccountant, create_accountant  # noqa: E402
from dptorch.data_loader import DPDataLoader  # noqa: E402
from dptorch.grad_sample.utils import wrap_model  # noqa: E402
from dptorch.optimizers import AdaClipDPOptimizer, DPOptimizer, get_optimizer_class  # noqa: E402
from dptorch.utils.batch_memory_manager import wrap_data_loader  # noqa: E402
from dptorch.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping  # noqa: E402

N, LENGTH, PER_DEVICE, SIGMA, CLIP, DELTA = 64, 6, 4, 0.8, 0.5, 1e-3


class Rows(Dataset):
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 40, (N, LENGTH), generator=g)
        self.labels = (self.ids[:, 0] > 20).long()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(LENGTH, dtype=torch.long), "labels": self.labels[i]}


def tiny_bert(lora):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=2, lora_alpha=4,
                                                           target_modules=["query", "value"]))
    return model


def dp_optimizer_of(optimizer):
    for _ in range(5):  # Accelerate's AcceleratedOptimizer holds ours as .optimizer
        if isinstance(optimizer, DPOptimizer):
            return optimizer
        optimizer = optimizer.optimizer
    raise AssertionError(f"no DPOptimizer under {type(optimizer).__name__}")


class SubSteps(transformers.TrainerCallback):
    """Opacus' callback: a step at every sub-step, the skip queue deciding; records what each step did."""

    def __init__(self, accumulation, model):
        self.accumulation, self.model = accumulation, model
        self.real_steps, self.calls, self.moved_without_step = 0, 0, 0

    def _params(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        queue = dp_optimizer_of(optimizer)._step_skip_queue
        assert len(queue) <= self.accumulation  # one signal per fetched physical batch, none left over
        self.before = self._params()

    def _after_step(self, optimizer, steps_before):
        optimizer = dp_optimizer_of(optimizer)
        self.calls += 1
        now = self._params()
        real = optimizer.plan.steps > steps_before
        self.real_steps += int(real)
        if not real and any(not torch.equal(a, b) for a, b in zip(self.before, now)):
            self.moved_without_step += 1
        self.before = now
        optimizer.zero_grad(set_to_none=True)

    def on_substep_end(self, args, state, control, optimizer=None, **kwargs):
        steps_before = dp_optimizer_of(optimizer).plan.steps
        dp_optimizer_of(optimizer).step()
        self._after_step(optimizer, steps_before)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.steps_before = dp_optimizer_of(optimizer).plan.steps

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._after_step(optimizer, self.steps_before)  # the Trainer called optimizer.step() itself


class OpacusStyleTrainer(transformers.Trainer):
    """What the example's DPTrainer does, written here against the renamed API."""

    def __init__(self, model, args, train_dataset, mode, clipping="flat"):
        self.mode, self.clipping = mode, clipping
        self.sample_rate = args.per_device_train_batch_size * args.gradient_accumulation_steps / len(train_dataset)
        self.hooks = wrap_model(model, grad_sample_mode=mode, wrap_model=False)
        self.accountant = create_accountant("rdp")
        self.steps = SubSteps(args.gradient_accumulation_steps, model)
        super().__init__(model=model, args=args, train_dataset=train_dataset, callbacks=[self.steps])
        optimizer = self.create_optimizer()
        if mode == "ghost":
            model.loss_function = DPLossFastGradientClipping(self.hooks, optimizer, nn.CrossEntropyLoss(), "mean")
        optimizer.attach_step_hook(self.accountant.get_optimizer_hook_fn(self.sample_rate))

    def create_optimizer(self):
        if isinstance(self.optimizer, DPOptimizer):
            return self.optimizer
        inner = super().create_optimizer()
        cls = get_optimizer_class(clipping=self.clipping, distributed=False, grad_sample_mode=self.mode)
        kwargs = dict(optimizer=inner, noise_multiplier=SIGMA, expected_batch_size=self.args.per_device_train_batch_size,
                      max_grad_norm=CLIP, loss_reduction="mean")
        if issubclass(cls, AdaClipDPOptimizer):
            kwargs.update(max_clipbound=1.0, min_clipbound=0.05, clipbound_learning_rate=0.2,
                          target_unclipped_quantile=0.5, unclipped_num_std=1.0)
        self.optimizer = cls(**kwargs)
        return self.optimizer

    def get_train_dataloader(self):
        loader = self._get_dataloader(dataset=self.train_dataset, description="Training",
                                      batch_size=self._train_batch_size * self.args.gradient_accumulation_steps,
                                      sampler_fn=self._get_train_sampler, is_training=True)
        self.logical = DPDataLoader.from_data_loader(loader)
        return wrap_data_loader(data_loader=self.logical, optimizer=self.create_optimizer(),
                                max_batch_size=self._train_batch_size)


def train(tmp_path, mode, lora, accumulation, clipping="flat", epochs=1):
    model = tiny_bert(lora)
    trained = [p for p in model.parameters() if p.requires_grad]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = [p.detach().clone() for p in trained]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs, learning_rate=0.05, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0,
    )
    trainer = OpacusStyleTrainer(model, args, Rows(), mode, clipping)
    trainer.train()
    draws = len(trainer.logical)  # one epoch: every draw of the Poisson loader the Trainer iterated
    return trainer, model, trained, before, frozen, draws


@pytest.mark.parametrize("mode,lora,accumulation", [
    ("hooks", False, 2), ("ghost", False, 2), ("hooks", True, 2), ("ghost", True, 1),
])
def test_the_trainer_flow_trains_privately_and_accounts_every_draw(tmp_path, mode, lora, accumulation):
    trainer, model, trained, before, frozen, draws = train(tmp_path, mode, lora, accumulation)
    optimizer, steps = trainer.optimizer.optimizer, trainer.steps
    assert isinstance(optimizer, DPOptimizer) and optimizer.hooks is trainer.hooks and trainer.hooks.module is model
    assert optimizer.original_optimizer is not optimizer and not isinstance(optimizer.original_optimizer, DPOptimizer)
    # trains, only through the private step: every trained parameter moved, none moved at a skipped step
    assert all(not torch.equal(a, b) for a, b in zip(before, trained))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert steps.moved_without_step == 0 and steps.calls > steps.real_steps  # virtual steps happened
    # every Poisson draw is one real step, and one accountant step at the example's sample rate
    assert steps.real_steps == optimizer.plan.steps == draws == len(trainer.accountant)
    q = PER_DEVICE * accumulation / N
    assert trainer.accountant.history == [[SIGMA, q, draws]]
    reference = RDPAccountant()
    reference.step(noise_multiplier=SIGMA, sample_rate=q, num_steps=draws)
    assert math.isclose(trainer.accountant.get_epsilon(DELTA), reference.get_epsilon(DELTA), rel_tol=1e-9)
    assert trainer.accountant.mechanism() == "rdp"
    restored = create_accountant("rdp")
    restored.load_state_dict(trainer.accountant.state_dict())
    assert restored.history == trainer.accountant.history
    trainer.hooks.cleanup()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_adaptive_clipping_class_takes_opacus_keywords_in_the_flow(tmp_path):
    trainer, model, trained, before, _, draws = train(tmp_path, "hooks", False, 2, clipping="adaptive")
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, AdaClipDPOptimizer) and optimizer.clipping == "adaptive"
    assert all(not torch.equal(a, b) for a, b in zip(before, trained))
    # the accountant records the stated sigma (the gradient gets the raised one, the count the rest)
    assert trainer.accountant.history == [[SIGMA, PER_DEVICE * 2 / N, draws]]
    assert optimizer.plan.gradient_noise_multiplier > SIGMA
    trainer.hooks.cleanup()


def test_later_epochs_of_another_length_still_account_each_real_step_once(tmp_path):
    """The Trainer takes one epoch's length for all; each later epoch is drawn anew (other lengths), so
    it may end early or inside a draw: every real step is still one draw and one accountant step."""
    trainer, model, trained, before, _, draws = train(tmp_path, "hooks", False, 2, epochs=3)
    steps = trainer.steps
    assert steps.moved_without_step == 0 and all(not torch.equal(a, b) for a, b in zip(before, trained))
    assert steps.real_steps == trainer.optimizer.optimizer.plan.steps == len(trainer.accountant)
    assert draws < steps.real_steps <= 3 * draws  # the first epoch whole, later ones possibly cut inside a draw
    assert trainer.accountant.history == [[SIGMA, PER_DEVICE * 2 / N, steps.real_steps]]
    trainer.hooks.cleanup()
