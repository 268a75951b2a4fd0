"""Private LoRA fine-tuning of a tiny Llama with ``DPTrainer`` on several processes (DDP or FSDP2).

Each process takes its share of every Poisson-sampled logical batch; the clipped gradients of all
processes are added up and the noise is drawn once per step. Epsilon is the same on every rank and
is logged by rank 0. A micro-batch that sampling left empty on a rank runs there as a phantom (a
stand-in that adds and counts nothing), so every rank runs the same forwards and collectives.

    torchrun --nproc-per-node 2 examples/distributed_trainer.py                  # DDP
    accelerate launch --config_file examples/accelerate_ddp.yaml examples/distributed_trainer.py
    torchrun --nproc-per-node 2 examples/distributed_trainer.py --fsdp           # FSDP2 (GPUs)
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/distributed_trainer.py

DDP runs on the CPU (gloo) when there is no GPU, one process per GPU (NCCL) otherwise. FSDP2:
Accelerate shards each decoder layer and the whole model with ``fully_shard`` (``--fsdp`` asks for it
through ``TrainingArguments(fsdp=True, fsdp_config={"version": 2})``, the FSDP2 Accelerate config
through the environment); Accelerate uses FSDP only on accelerators. Several machines: run the same
command on each, e.g. ``torchrun --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500
--nproc-per-node 8 examples/distributed_trainer.py`` on the first and ``--node-rank 1`` on the
second (or ``accelerate launch`` with ``num_machines``/``machine_rank``/``main_process_ip``).
"""

from __future__ import annotations

import os
import sys

import torch
from peft import LoraConfig, get_peft_model

from common import cpu_training_args, lm_dataset, one_thread, output_folder, tiny_llama, word_tokenizer
from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments

NO_FSDP_HERE = ("FSDP was asked for, but Accelerate uses FSDP on accelerators (GPUs) only and this process has none; "
                "run the DDP variant here (without --fsdp), or this one where each process has a GPU")


def main(max_steps: int = 20, fsdp: bool = False) -> dict:
    wants_fsdp = fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if wants_fsdp and not torch.accelerator.is_available():  # before anything is built or launched
        stop(NO_FSDP_HERE, rank_zero=int(os.environ.get("RANK", "0")) == 0)
    with output_folder("distributed") as output_dir:
        return run(output_dir, max_steps, fsdp, wants_fsdp)


def stop(reason: str, rank_zero: bool) -> None:
    """Every rank stops with exit status 2; rank 0 alone says why, on one line (no traceback)."""
    if rank_zero:
        print(reason, file=sys.stderr, flush=True)
    sys.exit(2)


def run(output_dir: str, max_steps: int, fsdp: bool, wants_fsdp: bool) -> dict:
    one_thread()
    torch.manual_seed(0)  # the same base model and adapters on every rank (DDP also broadcasts rank 0's)
    tokenizer = word_tokenizer()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(tiny_llama(tokenizer), config)
    sharding = dict(fsdp=True, fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}) if fsdp else {}
    # per_device_train_batch_size * gradient_accumulation_steps * processes = expected logical batch (32 here on 2)
    args = cpu_training_args(output_dir, max_steps=max_steps, per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, optim="sgd", learning_rate=0.5, logging_steps=5,
                             use_cpu=not torch.cuda.is_available(), **sharding)
    trainer = DPTrainer(
        model=model, args=args, train_dataset=lm_dataset(tokenizer, 512),
        data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-4, per_sample_max_grad_norm=1.0),
    )
    if wants_fsdp and not trainer.is_fsdp_enabled:  # Accelerate dropped FSDP all the same: never train as DDP instead
        stop(NO_FSDP_HERE, trainer.is_world_process_zero())
    trainer.train()
    epsilon = trainer.get_epsilon()
    if trainer.is_world_process_zero():
        kind = "FSDP2" if trainer.is_fsdp_enabled else "DDP"
        print(f"{args.world_size} processes ({kind}), {trainer.state.global_step} steps, expected logical batch "
              f"{trainer.privacy_plan.expected_batch_size:g} (sample rate {trainer.privacy_plan.sample_rate:g})")
        print(f"epsilon = {epsilon:.3f} at delta = 1e-4 (noise multiplier {trainer.noise_multiplier:.3f})")
    return {"epsilon": epsilon}


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    unknown = set(flags) - {"--fsdp"}
    if unknown:
        raise SystemExit(f"unknown option(s) {sorted(unknown)}; usage: distributed_trainer.py [MAX_STEPS] [--fsdp]")
    main(*(int(a) for a in sys.argv[1:] if not a.startswith("--")), fsdp="--fsdp" in flags)
