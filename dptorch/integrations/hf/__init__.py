"""DP-SGD for the HuggingFace stack: Trainer, TRL (SFT, DPO), PEFT adapters, Accelerate.

```python
from dptorch.integrations.hf import DPTrainer, PrivacyArguments, private

trainer = DPTrainer(model=model, args=training_args, train_dataset=ds,
                    privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-5))
trainer.train()                                # logs include "epsilon"
SFT = private(trl.SFTTrainer)                  # any Trainer subclass, e.g. trl.DPOTrainer
```

See ``docs/hf.md`` for the guide.
"""

from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.budget import PrivacyBudget, PrivacyBudgetCallback
from dptorch.integrations.hf.collator import DataCollatorForPrivateCausalLanguageModeling
from dptorch.integrations.hf.losses import causal_lm_per_sample_loss, default_per_sample_loss
from dptorch.integrations.hf.sampling import EmptyBatch, PoissonMicroBatchSampler, SamplingPlan
from dptorch.integrations.hf.trainer import PRIVACY_STATE_NAME, DPTrainer, PrivateTrainerMixin, private
from dptorch.integrations.hf.units import PrivacyUnits

__all__ = [
    "DPTrainer",
    "DataCollatorForPrivateCausalLanguageModeling",
    "EmptyBatch",
    "PRIVACY_STATE_NAME",
    "PoissonMicroBatchSampler",
    "PrivacyArguments",
    "PrivacyBudget",
    "PrivacyBudgetCallback",
    "PrivacyUnits",
    "PrivateTrainerMixin",
    "SamplingPlan",
    "causal_lm_per_sample_loss",
    "default_per_sample_loss",
    "private",
]
