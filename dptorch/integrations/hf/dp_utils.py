"""``dp_transformers.dp_utils`` for scripts renamed to dptorch: re-exports of
:mod:`dptorch.integrations.hf.dp_transformers_compat`, which says where each name lives."""

from dptorch.integrations.hf.dp_transformers_compat import (  # noqa: F401
    DataCollatorForPrivateCausalLanguageModeling,
    GradSampleModule,
    OpacusDPTrainer,
    PrivacyEngineCallback,
    create_author_mapping,
    unmapped_names,
)

__getattr__ = unmapped_names(__name__)

__all__ = [
    "DataCollatorForPrivateCausalLanguageModeling",
    "GradSampleModule",
    "OpacusDPTrainer",
    "PrivacyEngineCallback",
    "create_author_mapping",
]
