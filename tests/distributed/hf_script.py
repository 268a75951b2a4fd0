"""The private HF trainers under ``torchrun`` (2 or 4 processes, gloo, CPU), launched by the test_hf_*.py tests.

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/hf_script.py OUT ddp|fsdp|offload
    python -m torch.distributed.run --nproc-per-node 4 tests/distributed/hf_script.py OUT hsdp|ddp-only

``ddp``: DDP. ``fsdp``: FSDP2 through Accelerate, sharded checkpoints: for DPTrainer from
``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})``, for the TRL trainers from the
environment ``accelerate launch --config_file examples/accelerate_fsdp2.yaml`` sets (``cpu_fsdp``
lets Accelerate take its FSDP path in CPU processes). ``offload``: DPTrainer only, as ``fsdp`` with
``fsdp_config["cpu_offload"] = True`` (Accelerate's ``CPUOffloadPolicy`` on every ``fully_shard``).
``hsdp`` (4 processes): DPTrainer only, as ``fsdp`` with Accelerate's
``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` (a 2 x 2 ``(replicate, shard)`` mesh);
``ddp-only``: DPTrainer only under DDP, its reference. Runs, one after the other, 4 steps each,
micro-batches of 1 unit per device on average (some empty on one rank, one on both):

* ``full``: DPTrainer, LoRA Llama, a checkpoint at step 2; ``resumed``: resumed from it;
* ``sft``: ``private(trl.SFTTrainer)``, LoRA Llama; ``dpo``: ``private(trl.DPOTrainer)``, LoRA GPT-2,
  a user (2 examples, 4 rows) per privacy unit (its ``compute_loss`` gathers metrics over the ranks
  on every micro-batch); when TRL is installed;
* ``ddp`` only: ``fp16``, the ``full`` run with ``fp16=True`` and a GPU's fp16 set-up (autocast, a GradScaler that
  DPTrainer replaces by a DPGradScaler); ``seq2seq``, ``private(Seq2SeqTrainer)`` on a T5 whose decoder inputs the trainer builds from each
  row's labels; ``skipping``, the full run with empty micro-batches skipped instead of run as
  phantoms (DDP runs no collective per micro-batch); ``secret_seed``: the sampling seed of a trainer
  built without one (it must be rank 0's secret seed, broadcast); ``disagreeing``: the error of a
  trainer whose per-device batch size differs between the ranks.

Both modes use the same sampling and noise seeds, and ``ShardedNoise`` (noise per parameter element,
a function of the seed only), so DDP and FSDP2 draw the same noise. Each rank writes
``OUT/<mode>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments  # noqa: E402

from dptorch.distributed import ShardedNoise  # noqa: E402
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from dptorch.integrations.hf import private  # noqa: E402
from dptorch.integrations.hf.trainer import _find_dp_optimizer  # noqa: E402
from tests.integrations.tiny import (  # noqa: E402
    cpu_training_args,
    lm_dataset,
    place_dataset,
    preference_dataset,
    text_dataset,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
    without_dropout,
    word_tokenizer,
)

ROWS = 32
SAMPLING_SEED = 6  # draws with empty micro-batches on one rank and on both, and sizes that differ (tests check)
USERS, DPO_SAMPLING_SEED = 16, 1  # DPO: 2 examples per user (the privacy unit); the same properties of the draws
PRIVACY = dict(noise_multiplier=0.8, target_delta=1e-3, per_sample_max_grad_norm=1.0, noise_seed=11)
TRAINING = dict(max_steps=4, per_device_train_batch_size=1, gradient_accumulation_steps=2, optim="sgd",
                lr_scheduler_type="constant", learning_rate=0.5, max_grad_norm=0.0)
SHARDED = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"})
OFFLOADED = dict(fsdp=True, fsdp_config={**SHARDED["fsdp_config"], "cpu_offload": True})
DPTRAINER_ONLY = ("offload", "hsdp", "ddp-only")


def mode_args(mode: str) -> dict:
    """The TrainingArguments a mode adds."""
    if mode == "hsdp":
        from accelerate import ParallelismConfig

        return dict(**SHARDED, parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    return {"fsdp": SHARDED, "offload": OFFLOADED}.get(mode, {})
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast", "all_gather",
               "all_gather_object", "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce_scatter", "scatter", "gather", "send", "recv")


class Observed:
    """Records each micro-batch's rows (unpadded token ids, ``[]`` when empty), its phantoms, and the
    collectives of training (not those of preparing the model, nor of saving checkpoints); draws its
    noise as ``ShardedNoise``. ``skip_empty``: skip empty micro-batches instead of running phantoms."""

    skip_empty = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.phantoms, self.collectives = [], 0, Recorder()

    def train(self, *args, **kwargs):
        with self.collectives.recording():
            return super().train(*args, **kwargs)

    def _prepare_for_training(self, *args, **kwargs):
        with self.collectives.paused():
            return super()._prepare_for_training(*args, **kwargs)

    def _save_checkpoint(self, *args, **kwargs):
        with self.collectives.paused():
            return super()._save_checkpoint(*args, **kwargs)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        dp = _find_dp_optimizer(optimizer)
        dp.noise_generator = ShardedNoise(dp.noise_generator)  # the same values under DDP and FSDP2
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        if "input_ids" in inputs:
            mask = inputs["attention_mask"].bool()
            self.seen.append([ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask)])
        else:
            self.seen.append([])
        return super().training_step(model, inputs, num_items_in_batch)

    def _phantom_step(self, model):
        self.phantoms += 1
        if not self.skip_empty:
            super()._phantom_step(model)


class Recorder(list):
    """``[collective, shapes of its tensor arguments]`` for each top-level ``torch.distributed`` collective call."""

    def __init__(self):
        super().__init__()
        self.depth = 0

    @contextmanager
    def recording(self):
        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        for name, fn in originals.items():
            setattr(dist, name, self._wrap(name, fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    @contextmanager
    def paused(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            if self.depth == 0:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                self.append([name, [list(t.shape) for t in tensors]])
            with self.paused():  # collectives inside a collective are its own business
                return fn(*args, **kwargs)
        return call


class ObservedDPTrainer(Observed, DPTrainer):
    pass


def dp_trainer(output_dir: Path, tokenizer, mode: str, seed=SAMPLING_SEED, **training) -> ObservedDPTrainer:
    """DPTrainer on a LoRA Llama; ``training``: TrainingArguments that replace those of ``TRAINING``."""
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(without_dropout(tiny_llama(tokenizer)), config)
    args = cpu_training_args(
        str(output_dir), save_strategy="steps", save_steps=2, **{**TRAINING, **training},
        **mode_args(mode),
        include_num_input_tokens_seen="all",  # gathers over the ranks for every micro-batch, empty ones too
    )
    return ObservedDPTrainer(model=model, args=args, train_dataset=lm_dataset(tokenizer, ROWS),
                             data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
                             privacy_args=PrivacyArguments(sampling_seed=seed, **PRIVACY))


def fp16_run(output_dir: Path, tokenizer, mode: str) -> dict:
    """The ``full`` run with ``fp16=True`` and what Accelerate sets up for it on a GPU (autocast to float16, a
    ``torch.amp.GradScaler``; on CPU Accelerate 1.15 runs fp16 in float32), which DPTrainer swaps for a DPGradScaler."""
    trainer = dp_trainer(output_dir, tokenizer, mode, fp16=True)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    start = {name: p.detach().flatten().tolist() for name, p in trainer.model.named_parameters() if p.requires_grad}
    dtypes = set()
    mlp = trainer.model.get_base_model().model.layers[0].mlp
    handle = mlp.register_forward_hook(lambda module, args, output: dtypes.add(str(output.dtype)))
    trainer.train()
    handle.remove()
    scaler = trainer.accelerator.scaler
    return {**summary(trainer), "scaler": type(scaler).__name__, "scale": float(scaler.get_scale()),
            "dtypes": sorted(dtypes), "start": start}


def seq2seq_trainer(output_dir: Path, tokenizer):
    """``private(Seq2SeqTrainer)`` on a T5 (no dropout), decoder inputs built by the trainer from the labels."""
    torch.manual_seed(0)
    args = cpu_training_args(str(output_dir), Seq2SeqTrainingArguments, **TRAINING)
    return type("ObservedSeq2Seq", (Observed, private(Seq2SeqTrainer)), {})(
        model=tiny_t5(tokenizer), args=args, train_dataset=place_dataset(tokenizer, ROWS),
        data_collator=DataCollatorForSeq2Seq(tokenizer), privacy_args=PrivacyArguments(sampling_seed=SAMPLING_SEED,
                                                                                         **PRIVACY))


def trl_trainer(kind: str, output_dir: Path, tokenizer, mode: str):
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    torch.manual_seed(0)
    settings = dict(output_dir=str(output_dir), use_cpu=True, bf16=False, report_to=[], disable_tqdm=True,
                    logging_steps=1, save_strategy="no", max_length=32, **TRAINING)
    if mode == "fsdp":
        os.environ.update(accelerate_launch_env(ROOT / "examples" / "accelerate_fsdp2.yaml"))
    if kind == "sft":
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
        return type("ObservedSFT", (Observed, private(SFTTrainer)), {})(
            model=tiny_llama(tokenizer), args=SFTConfig(**settings), train_dataset=text_dataset(ROWS),
            processing_class=tokenizer, peft_config=config,
            privacy_args=PrivacyArguments(sampling_seed=SAMPLING_SEED, **PRIVACY))
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0, task_type="CAUSAL_LM")
    data = preference_dataset(ROWS).add_column("user", [f"user{i % USERS}" for i in range(ROWS)])
    return type("ObservedDPO", (Observed, private(DPOTrainer)), {})(
        model=tiny_gpt2(tokenizer), args=DPOConfig(beta=0.1, **settings), train_dataset=data,
        processing_class=tokenizer, peft_config=config,
        privacy_args=PrivacyArguments(sampling_seed=DPO_SAMPLING_SEED, privacy_unit_column="user", **PRIVACY))


def accelerate_launch_env(config_file: Path) -> dict:
    """The FSDP variables ``accelerate launch --config_file CONFIG`` sets (Accelerator() reads them)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    return {k: v for k, v in env.items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}


def summary(trainer) -> dict:
    """What the tests compare: parameters (gathered when sharded), epsilon, steps, logs, micro-batches, collectives."""
    params = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: gathered from the shards
            params[name] = full.detach().flatten().tolist()
    return {
        "epsilon": trainer.get_epsilon(), "steps": trainer.privacy_plan.steps, "params": params,
        "logged": [h["epsilon"] for h in trainer.state.log_history if "epsilon" in h],
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "tokens": trainer.state.num_input_tokens_seen, "seen": trainer.seen, "phantoms": trainer.phantoms,
        "collectives": list(trainer.collectives),
        "sharded": [type(p).__name__ == "DTensor" for p in trainer.model.parameters() if p.requires_grad],
        "offloaded": offloaded(trainer.model),
        "meshes": sorted({(p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)), p.device_mesh.size())
                          for p in trainer.model.parameters() if p.requires_grad and hasattr(p, "device_mesh")}),
    }


def offloaded(model) -> list:
    """For each parameter ``fully_shard`` manages, whether FSDP2 keeps its shard offloaded to the CPU."""
    from dptorch.distributed.fsdp import is_fully_sharded_module

    return [fsdp_param.offload_to_cpu for sub in model.modules() if is_fully_sharded_module(sub)
            for group in sub._get_fsdp_state()._fsdp_param_groups for fsdp_param in group.fsdp_params]


def disagreeing_trainer(output_dir: Path, tokenizer, mode: str, rank: int) -> str:
    """The error a DPTrainer raises when the ranks' per_device_train_batch_size differ (1 and 2); ``"accepted"``
    if none."""
    try:
        dp_trainer(output_dir, tokenizer, mode, per_device_train_batch_size=1 + rank)
    except ValueError as error:
        return str(error)
    return "accepted"


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    if mode in ("fsdp", "offload", "hsdp"):
        from tests.distributed.cpu_fsdp import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
    rank = int(os.environ["RANK"])
    tokenizer = word_tokenizer()
    full = dp_trainer(out / "full", tokenizer, mode)
    full.train()
    resumed = dp_trainer(out / "resumed", tokenizer, mode)
    resumed.train(resume_from_checkpoint=str(out / "full" / "checkpoint-2"))
    report = {
        "rank": rank, "world_size": full.args.world_size, "mode": mode, "seed": full._dp_sampling_seed,
        "sample_rate": full.privacy_plan.sample_rate, "steps_per_epoch": full.privacy_plan.steps_per_epoch,
        "micro_batches": full.sampling_plan.micro_batches, "noise_multiplier": full.noise_multiplier,
        "expected_batch_size": full.privacy_plan.expected_batch_size,
        "checkpoint": sorted(os.listdir(out / "full" / "checkpoint-2")),
        "rows": [list(r) for r in lm_dataset(tokenizer, ROWS)["input_ids"]],
        "full": summary(full), "resumed": summary(resumed),
    }
    if mode == "ddp":
        skipping = dp_trainer(out / "skipping", tokenizer, mode)
        skipping.skip_empty = True
        skipping.train()
        report["skipping"] = summary(skipping)
        report["secret_seed"] = dp_trainer(out / "secret", tokenizer, mode, seed=None)._dp_sampling_seed
        report["disagreeing"] = disagreeing_trainer(out / "disagreeing", tokenizer, mode, rank)
        report["fp16"] = fp16_run(out / "fp16", tokenizer, mode)
        seq2seq = seq2seq_trainer(out / "seq2seq", tokenizer)
        seq2seq.train()
        report["seq2seq"] = summary(seq2seq)
    try:
        import trl  # noqa: F401
    except ImportError:
        pass
    else:
        for kind in () if mode in DPTRAINER_ONLY else ("sft", "dpo"):
            trainer = trl_trainer(kind, out / kind, tokenizer, mode)
            trainer.train()
            report[kind] = summary(trainer)
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
