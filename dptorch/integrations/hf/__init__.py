"""DP-SGD for the HuggingFace stack: Trainer, TRL (SFT, DPO), PEFT adapters, Accelerate.

```python
from dptorch.integrations.hf import DPTrainer, PrivacyArguments, private

trainer = DPTrainer(model=model, args=training_args, train_dataset=ds,
                    privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-5))
trainer.train()                                # logs include "epsilon"
SFT = private(trl.SFTTrainer)                  # any Trainer subclass, e.g. trl.DPOTrainer
Trainer(..., callbacks=[DPCallback(privacy_args)])  # a Trainer class you cannot swap (see its limits)
```

See ``docs/hf.md`` for the guide. dp-transformers scripts run with ``dp_transformers`` renamed to
``dptorch.integrations.hf`` (``TrainingArguments``, ``dp_utils.OpacusDPTrainer``, ...; see
:mod:`.dp_transformers_compat`).
"""

from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.budget import PrivacyBudget, PrivacyBudgetCallback
from dptorch.integrations.hf.callback import EPSILON_IF_POISSON, DPCallback
from dptorch.integrations.hf.collator import DataCollatorForPrivateCausalLanguageModeling
from dptorch.grad_sample.units.chunked_lm_loss import ChunkedCausalLMLoss
from dptorch.grad_sample.units.per_sample_losses import causal_lm_per_sample_loss, default_per_sample_loss
from dptorch.integrations.hf.deepspeed_notice import leave_out_cpu_fallback_notice
from dptorch.integrations.hf.sampling import EmptyBatch, PoissonMicroBatchSampler, SamplingPlan
from dptorch.integrations.hf.trainer import PRIVACY_STATE_NAME, DPTrainer, PrivateTrainerMixin, private
from dptorch.integrations.hf.units import PrivacyUnits

leave_out_cpu_fallback_notice()  # the HF Trainer imports DeepSpeed, which alarms on a CPU-only machine

# dp-transformers' names (``dp_transformers`` -> ``dptorch.integrations.hf``); after the above.
from dptorch.integrations.hf import dp_utils  # noqa: E402  (dp_transformers.dp_utils)
from dptorch.integrations.hf.dp_transformers_compat import (  # noqa: E402
    OpacusDPTrainer,
    PrivacyEngineCallback,
    TrainingArguments,
    register_grad_sampler_gpt2,
    register_grad_sampler_gpt2_lora,
)

__all__ = [
    "ChunkedCausalLMLoss",
    "DPCallback",
    "DPTrainer",
    "DataCollatorForPrivateCausalLanguageModeling",
    "EPSILON_IF_POISSON",
    "EmptyBatch",
    "OpacusDPTrainer",
    "PRIVACY_STATE_NAME",
    "PoissonMicroBatchSampler",
    "PrivacyArguments",
    "PrivacyBudget",
    "PrivacyBudgetCallback",
    "PrivacyEngineCallback",
    "PrivacyUnits",
    "PrivateTrainerMixin",
    "SamplingPlan",
    "TrainingArguments",
    "causal_lm_per_sample_loss",
    "default_per_sample_loss",
    "dp_utils",
    "private",
    "register_grad_sampler_gpt2",
    "register_grad_sampler_gpt2_lora",
]
