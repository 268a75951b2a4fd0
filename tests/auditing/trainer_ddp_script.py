"""DPTrainer with audit canaries under DDP or FSDP2 (``torchrun --nproc-per-node 2``, gloo, CPU), for
test_trainer_ddp_audit.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/auditing/trainer_ddp_script.py OUT [fsdp]

Each rank writes ``OUT/audit-rank<r>.json``: its logged audit numbers, its audit history, its scores, the
privacy report's ``audit`` entry, and (rank 0) the saved model card.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments  # noqa: E402
from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_gpt2, word_tokenizer  # noqa: E402


def main(out: Path, mode: str) -> None:
    torch.set_num_threads(1)
    sharded = {}
    if mode == "fsdp":  # FSDP2 through Accelerate (test-only: its FSDP path in CPU processes)
        from tests.distributed.cpu_fsdp import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
        sharded = dict(fsdp=True, fsdp_config={"version": 2})
    rank = int(os.environ["RANK"])
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    args = cpu_training_args(str(out / "run"), max_steps=3, per_device_train_batch_size=4, logging_steps=1, **sharded)
    trainer = DPTrainer(model=tiny_gpt2(tokenizer), args=args, train_dataset=lm_dataset(tokenizer, 32),
                        data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
                        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-4, sampling_seed=0,
                                                      noise_seed=0, audit_canaries=200,
                                                      audit_seed=None if rank else 3))  # rank 0's seed is the run's
    trainer.train()
    trainer.save_model(str(out / "final"))
    card = out / "final" / "README.md"
    report = {
        "logged": [{k: v for k, v in e.items() if k.startswith("audit_") or k in ("epsilon", "step")}
                   for e in trainer.state.log_history if "loss" in e],
        "history": [audit.to_dict() for audit in trainer.dp_audit.history],
        "scores": trainer.audit_canaries.scores.tolist(),
        "times_added": trainer.audit_canaries.times_added.tolist(),
        "seed": trainer.audit_canaries.seed,
        "audit": trainer.privacy_report()["audit"],
        "card": card.read_text() if rank == 0 else None,
    }
    (out / f"audit-rank{rank}.json").write_text(json.dumps(report))
    if torch.distributed.is_initialized():  # every rank done before any leaves (a rank exiting while gloo's threads
        torch.distributed.barrier()  # still serve another's collectives aborts it)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "ddp")
