"""DPTrainer under DeepSpeed ZeRO-1, 2 and 3 (``TrainingArguments(deepspeed=config)``), run by ``torchrun``
from ``test_hf_deepspeed.py`` on CPU (``DS_ACCELERATOR=cpu``, gloo).

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/hf_deepspeed_script.py OUT

The runs are ``hf_script.py``'s DDP ``full`` run (same model, data, seeds, noise stream ``ShardedNoise``,
Trainer settings, gradient accumulation 2 with empty micro-batches) with a DeepSpeed config whose values
are the Trainer's ``"auto"``: ``zero1``; ``zero2`` with a DeepSpeed checkpoint at step 2 and ``resumed``
from it; ``zero3`` (every parameter released outside its module's calls) and ``resumed-zero3`` likewise;
``zero3-init``, the ``zero3`` run with the model built after the TrainingArguments (``deepspeed.zero.Init``);
``zero2-bf16`` and ``zero3-bf16`` (``bf16=True``: DeepSpeed casts the model, fp32 master weights); ``units-zero1``
and ``units-ddp``, two rows per privacy unit under ZeRO-1 and under DDP; ``zero3-full`` and ``ddp-full``, a full
fine-tune (every parameter: embedding, RMSNorms, Linear layers) under ZeRO-3 and under DDP; ``plugin-zero2``, Accelerate's
DeepSpeed plugin from the environment of ``accelerate launch --use_deepspeed --zero_stage 2`` (no config).
Then the set-ups the private Trainer refuses at construction, and a second ``train()`` of ``zero1``.
Each rank writes ``OUT/hf-deepspeed-rank<r>.json``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from accelerate.state import AcceleratorState  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from dptorch.distributed import ShardedNoise  # noqa: E402
from dptorch.integrations.hf import (  # noqa: E402
    DataCollatorForPrivateCausalLanguageModeling,
    DPTrainer,
    PrivacyArguments,
)
from tests.distributed import hf_script  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    cpu_training_args,
    lm_dataset,
    tiny_llama,
    without_dropout,
    word_tokenizer,
)

# DeepSpeed compiles a shared-memory all-reduce for inference (minutes, once per machine); training never uses it.
# (The module itself: the attribute deepspeed.comm.torch is the torch package, which deepspeed.comm re-exports.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def config(stage: int, **extra) -> dict:
    """A DeepSpeed config that leaves to the Trainer what it fills (``"auto"``); ZeRO-3 releases every parameter
    outside its module's calls (none kept whole as "persistent")."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "steps_per_print": 10**9, **extra}


class ObservedDeepSpeed(hf_script.ObservedDPTrainer):
    """``hf_script``'s observed trainer; its DP optimizer (built with DeepSpeed's engine) draws ``ShardedNoise``."""

    def create_optimizer(self, model=None):
        return DPTrainer.create_optimizer(self, model)  # under DeepSpeed no DP optimizer exists yet

    def _new_dp_optimizer(self, inner):
        optimizer = super()._new_dp_optimizer(inner)
        optimizer.noise_generator = ShardedNoise(optimizer.noise_generator)  # the DDP run's stream
        return optimizer


def built_partitioned(reference, lora: LoraConfig):
    """``reference``'s LoRA Llama built again while a ZeRO-3 config is active (``from_config`` under
    ``deepspeed.zero.Init``: every base parameter partitioned as it is made), with ``reference``'s weights."""
    from transformers import LlamaForCausalLM

    model = get_peft_model(without_dropout(LlamaForCausalLM._from_config(reference.base_model.model.config)), lora)
    weights = dict(reference.named_parameters())
    with deepspeed.zero.GatheredParameters([p for p in model.parameters() if hasattr(p, "ds_id")], modifier_rank=0):
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
    return model


def ds_trainer(output_dir: Path, tokenizer, deepspeed: Optional[dict], units: bool = False, full: bool = False,
               init: bool = False, **training) -> ObservedDeepSpeed:
    """``hf_script.dp_trainer``'s DDP trainer, with ``deepspeed`` (None: DDP, or Accelerate's plugin from the
    environment) and ``training`` in its TrainingArguments; ``units``: two rows per privacy unit (a "user");
    ``full``: every parameter trains (no LoRA); ``init``: the model is built after the TrainingArguments, so under
    ZeRO-3 it comes partitioned (:func:`built_partitioned`)."""
    AcceleratorState._reset_state()  # each trainer's Accelerator takes its own DeepSpeed plugin
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = without_dropout(tiny_llama(tokenizer))
    model = model if full else get_peft_model(model, lora)
    settings = dict(hf_script.TRAINING, save_strategy="steps", save_steps=2, include_num_input_tokens_seen="all",
                    ddp_backend="gloo")
    settings.update(training)
    args = cpu_training_args(str(output_dir), deepspeed=deepspeed, **settings)
    if init:
        model = built_partitioned(model, lora)
    data, privacy = lm_dataset(tokenizer, hf_script.ROWS), dict(hf_script.PRIVACY)
    if units:
        data = data.add_column("user", [f"user{i % (hf_script.ROWS // 2)}" for i in range(hf_script.ROWS)])
        privacy["privacy_unit_column"] = "user"
    return ObservedDeepSpeed(model=model, args=args, train_dataset=data,
                             data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
                             privacy_args=PrivacyArguments(sampling_seed=hf_script.SAMPLING_SEED, **privacy))


def trained(trainer, **train) -> dict:
    trainer.train(**train)
    engine = trainer.model_wrapped
    with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):  # ZeRO-3: from the partitions
        report = hf_script.summary(trainer)
    report["dtype"] = str(next(trainer.model.parameters()).dtype)
    if trainer.is_deepspeed_enabled:
        report.update(global_steps=engine.global_steps, ds_accumulation=engine.gradient_accumulation_steps(),
                      zero_stage=engine.zero_optimization_stage())
    return report


@contextmanager
def accelerate_deepspeed_plugin(stage: int):
    """What ``accelerate launch --use_deepspeed --zero_stage STAGE`` sets in the environment (no DeepSpeed config)."""
    names = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage)}
    os.environ.update(names)
    try:
        yield
    finally:
        for name in names:
            os.environ.pop(name)


def refusal(call, *args, **kwargs) -> str:
    """The ValueError ``call(*args, **kwargs)`` raises (``"accepted"`` if none)."""
    try:
        call(*args, **kwargs)
    except ValueError as error:
        return str(error)
    return "accepted"


def main(out: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = word_tokenizer()
    zero1 = ds_trainer(out / "zero1", tokenizer, config(1), save_strategy="no")
    report = {"zero1": trained(zero1), "refused-second-train": refusal(zero1.train)}
    zero2 = ds_trainer(out / "zero2", tokenizer, config(2))
    report["zero2"] = trained(zero2)
    # "gradient_clipping": "auto" with the default max_grad_norm=1.0: the private Trainer ignores max_grad_norm
    # as under DDP and sets DeepSpeed's clipping to 0
    auto = ds_trainer(out / "auto-clipping", tokenizer, config(2), max_grad_norm=1.0, save_strategy="no")
    report["auto-clipping"] = dict(trained(auto), clipping=auto.model_wrapped.gradient_clipping())
    report["checkpoint"] = sorted(os.listdir(out / "zero2" / "checkpoint-2"))
    report["resumed"] = trained(ds_trainer(out / "resumed", tokenizer, config(2)),
                                resume_from_checkpoint=str(out / "zero2" / "checkpoint-2"))
    zero3 = ds_trainer(out / "zero3", tokenizer, config(3))
    report["zero3"] = trained(zero3)
    report["checkpoint-zero3"] = sorted(os.listdir(out / "zero3" / "checkpoint-2"))
    report["resumed-zero3"] = trained(ds_trainer(out / "resumed3", tokenizer, config(3)),
                                      resume_from_checkpoint=str(out / "zero3" / "checkpoint-2"))
    init = ds_trainer(out / "init", tokenizer, config(3), init=True, save_strategy="no")
    frozen = [p for p in init.model.parameters() if not p.requires_grad]  # partitioned before train() built the engine
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in frozen)
    report["zero3-init"] = dict(trained(init), partitioned=partitioned)
    report["zero2-bf16"] = trained(ds_trainer(out / "bf16", tokenizer, config(2), bf16=True, save_strategy="no"))
    report["zero3-bf16"] = trained(ds_trainer(out / "bf16-3", tokenizer, config(3), bf16=True, save_strategy="no"))
    report["zero3-full"] = trained(ds_trainer(out / "full3", tokenizer, config(3), full=True, save_strategy="no"))
    report["ddp-full"] = trained(ds_trainer(out / "full-ddp", tokenizer, None, full=True, save_strategy="no"))
    report["units-zero1"] = trained(ds_trainer(out / "units", tokenizer, config(1), units=True, save_strategy="no"))
    report["units-ddp"] = trained(ds_trainer(out / "units-ddp", tokenizer, None, units=True, save_strategy="no"))
    with accelerate_deepspeed_plugin(2):
        report["plugin-zero2"] = trained(ds_trainer(out / "plugin", tokenizer, None, save_strategy="no"))
    report.update({
        "seed": zero2._dp_sampling_seed, "sample_rate": zero2.privacy_plan.sample_rate,
        "steps_per_epoch": zero2.privacy_plan.steps_per_epoch, "micro_batches": zero2.sampling_plan.micro_batches,
        "noise_multiplier": zero2.noise_multiplier,
        "rows": [list(r) for r in lm_dataset(tokenizer, hf_script.ROWS)["input_ids"]],
        "refused-zero3-granularity": refusal(ds_trainer, out / "r3", tokenizer, config(
            3, zero_optimization={"stage": 3, "stage3_module_granularity_threshold": 1000})),
        "refused-stage0": refusal(ds_trainer, out / "r0", tokenizer, config(0)),
        "refused-clipping": refusal(ds_trainer, out / "rc", tokenizer, config(2, gradient_clipping=1.0)),
        "refused-offload": refusal(ds_trainer, out / "ro", tokenizer, config(
            2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})),
        "refused-fp16": refusal(ds_trainer, out / "rf", tokenizer,
                                config(1, fp16={"enabled": True}, bf16={"enabled": False})),
    })
    rank = torch.distributed.get_rank()
    (out / f"hf-deepspeed-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
