"""Microsoft dp-transformers names mapped onto dptorch: the one place that says where each lives.

A script written for dp-transformers (its ``fine-tune-dp.py`` examples) runs after replacing
``dp_transformers`` with ``dptorch.integrations.hf`` in its imports and names:

* ``dp_transformers.TrainingArguments`` -> :class:`TrainingArguments` (``transformers.TrainingArguments``
  plus dp-transformers' ``dry_run`` flag);
* ``dp_transformers.PrivacyArguments`` -> dptorch's
  :class:`~dptorch.integrations.hf.PrivacyArguments` (same ``per_sample_max_grad_norm``,
  ``noise_multiplier``, ``target_epsilon``, ``target_delta`` fields);
* ``dp_transformers.DataCollatorForPrivateCausalLanguageModeling(tokenizer)`` -> dptorch's collator
  (per-row ``position_ids``, labels from the attention mask);
* ``dp_transformers.dp_utils.OpacusDPTrainer(..., privacy_args=, author_mapping=)`` ->
  :class:`OpacusDPTrainer`, a :class:`~dptorch.integrations.hf.DPTrainer` whose privacy units are
  the authors of ``author_mapping`` (user-level DP), with ``get_rdp_epsilon`` / ``get_prv_epsilon``;
* ``dp_transformers.dp_utils.create_author_mapping(dataset, author)`` -> :func:`create_author_mapping`;
* ``dp_transformers.PrivacyEngineCallback`` -> :class:`~dptorch.integrations.hf.callback.DPCallback`
  (a plain-Trainer callback; it takes ``PrivacyArguments``, not an Opacus 0.x engine);
* ``dp_transformers.register_grad_sampler_gpt2()`` / ``register_grad_sampler_gpt2_lora()`` -> no-ops:
  dptorch has per-sample gradients for GPT-2's ``Conv1D`` and PEFT's LoRA layers built in (the
  ``from dp_transformers.grad_sample... import ...`` lines of newer scripts are simply dropped).

``dptorch.integrations.hf`` and ``dptorch.integrations.hf.dp_utils`` re-export these names. Names
with no counterpart raise :class:`~dptorch.compat.unmapped.OpacusCompatibilityError` naming the
replacement. What differs on purpose: Poisson sampling of authors instead of shuffled batches
(dp-transformers' ``ShuffledAuthorSampler``), so epsilon is a proven bound; ``target_delta``
defaults to 1e-5 and must be below 1/N (dp-transformers defaults it to 1/N, which allows releasing
one unit outright); ``disable_dp`` does not exist (use ``transformers.Trainer``); gradient
accumulation is supported (each logical batch is one Poisson sample, split into micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import numpy as np
import transformers
from transformers.trainer_utils import IntervalStrategy

from dptorch.accounting import create_accountant
from dptorch.compat.unmapped import unmapped_names as _unmapped_names
from dptorch.grad_sample import GradSampleModule
from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.callback import DPCallback
from dptorch.integrations.hf.collator import DataCollatorForPrivateCausalLanguageModeling
from dptorch.integrations.hf.trainer import DPTrainer
from dptorch.integrations.hf.units import PrivacyUnits

#: dp-transformers' plain-Trainer callback: dptorch's :class:`DPCallback` (takes ``PrivacyArguments``).
PrivacyEngineCallback = DPCallback


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``dp_transformers.TrainingArguments``: ``transformers.TrainingArguments`` plus ``dry_run``.

    ``dry_run=True`` trains 2 steps and logs every step (evaluating every step when an eval
    strategy is set), for a quick check of a configuration.
    """

    dry_run: bool = field(
        default=False,
        metadata={"help": "Train 2 steps and log every step, to check the arguments quickly."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dry_run:
            self.max_steps = 2
            self.logging_steps = 1
            self.logging_strategy = IntervalStrategy.STEPS
            if self.eval_strategy != IntervalStrategy.NO:
                self.eval_strategy = IntervalStrategy.STEPS
                self.eval_steps = 1


def create_author_mapping(dataset: Any, author: str) -> List[List[int]]:
    """``dp_utils.create_author_mapping``: the row indices of each author, from column ``author``.

    Authors are ordered by first appearance; each list holds an author's rows in dataset order.
    """
    values = dataset[author] if hasattr(dataset, "column_names") else [dataset[i][author] for i in range(len(dataset))]
    units = PrivacyUnits.from_values(list(values), author)
    return [units.rows_of([unit]) for unit in range(units.num_units)]


def units_from_author_mapping(author_mapping: Sequence[Sequence[int]], num_rows: int) -> PrivacyUnits:
    """The privacy units of ``author_mapping`` (each author's row indices) over ``num_rows`` rows.

    Every row must belong to exactly one author: a row in two authors would be clipped twice, and a
    row in none would never be trained on while counting in nobody's privacy. Both are refused.
    """
    unit_of_row = np.full(num_rows, -1, dtype=np.int64)
    for unit, rows in enumerate(author_mapping):
        rows = np.asarray(list(rows), dtype=np.int64).reshape(-1)
        if rows.size == 0:
            raise ValueError(f"author_mapping[{unit}] has no rows; drop authors without data")
        if rows.min() < 0 or rows.max() >= num_rows:
            raise ValueError(f"author_mapping[{unit}] holds row indices outside the {num_rows} training rows")
        taken = rows[unit_of_row[rows] != -1]
        if taken.size or np.unique(rows).size != rows.size:
            row = int(taken[0]) if taken.size else int(rows[np.argmax(np.bincount(rows))])
            raise ValueError(f"row {row} appears twice in author_mapping: every row must belong to exactly one author")
        unit_of_row[rows] = unit
    missing = np.flatnonzero(unit_of_row == -1)
    if missing.size:
        raise ValueError(
            f"{missing.size} training row(s) belong to no author in author_mapping (first: {int(missing[0])}); map "
            "every row of train_dataset to an author, or remove those rows"
        )
    return PrivacyUnits(unit_of_row, column=None)


class OpacusDPTrainer(DPTrainer):
    """``dp_transformers.dp_utils.OpacusDPTrainer`` on dptorch's DPTrainer.

    Same keywords: ``OpacusDPTrainer(model=, args=, train_dataset=, data_collator=, privacy_args=,
    author_mapping=None, ...)``. ``author_mapping`` (a list of row-index lists, one per author, as
    :func:`create_author_mapping` makes) makes each author one privacy unit: an author's rows are
    sampled together and their gradients summed before clipping (user-level DP); without it each
    row is its own unit. Sampling is Poisson over units (dp-transformers shuffles), so the reported
    epsilon is a bound for the batches really drawn. ``get_rdp_epsilon()`` and
    ``get_prv_epsilon()`` compose the steps taken so far with the RDP and PRV accountants at
    ``privacy_args.target_delta``; the logs carry ``epsilon`` from ``privacy_args.accountant``.
    """

    def __init__(self, *args: Any, author_mapping: Optional[Sequence[Sequence[int]]] = None, **kwargs: Any) -> None:
        self.author_mapping = author_mapping
        super().__init__(*args, **kwargs)

    def _build_privacy_units(self, dataset: Any) -> PrivacyUnits:
        if self.author_mapping is None:
            return super()._build_privacy_units(dataset)
        if self.privacy_args.privacy_unit_column is not None:
            raise ValueError("give author_mapping or PrivacyArguments.privacy_unit_column, not both")
        return units_from_author_mapping(self.author_mapping, len(dataset))

    def privacy_report(self):
        report = super().privacy_report()
        if self.author_mapping is not None:
            report["privacy_unit"] = "author (author_mapping)"
        return report

    def get_rdp_epsilon(self) -> float:
        """Epsilon so far at ``target_delta`` by the RDP accountant (Opacus' ``RDPAccountant`` figure)."""
        return self._epsilon_by("rdp")

    def get_prv_epsilon(self) -> float:
        """Epsilon so far at ``target_delta`` by the PRV accountant."""
        return self._epsilon_by("prv")

    def _epsilon_by(self, accountant: str) -> float:
        plan = self.privacy_plan
        if plan.unprotected_steps:
            return float("inf")
        history = plan.accountant.history
        if not history:
            return 0.0
        composer = create_accountant(accountant)
        composer.load_state_dict({"mechanism": accountant, "history": history})
        return composer.get_epsilon(self.privacy_args.target_delta)


def register_grad_sampler_gpt2() -> None:
    """No-op: dptorch computes per-sample gradients of GPT-2's ``Conv1D`` (and tied embeddings) itself."""


def register_grad_sampler_gpt2_lora() -> None:
    """No-op: dptorch computes per-sample gradients of PEFT's LoRA layers itself (use ``peft.get_peft_model``)."""


#: dp-transformers names with no counterpart, and what to use instead.
UNMAPPED = {
    "ShuffledAuthorSampler": "dptorch samples authors by Poisson sampling inside OpacusDPTrainer/DPTrainer "
    "(author_mapping= or PrivacyArguments.privacy_unit_column); a shuffled sampler gives no proven epsilon",
    "PoissonAuthorSampler": "pass author_mapping= to OpacusDPTrainer (or privacy_unit_column to DPTrainer): the "
    "trainer draws authors by Poisson sampling itself",
    "find_noise_multiplier": "dptorch.accounting.get_noise_multiplier(target_epsilon=, target_delta=, sample_rate=, "
    "steps=, accountant='prv'), or PrivacyArguments(target_epsilon=...)",
    "DifferentiallyPrivateDistributedDataParallel": "the private trainer runs on one device for now",
}


def unmapped_names(module_name: str):
    """A module ``__getattr__`` raising ``OpacusCompatibilityError`` (an ImportError) for the names of
    :data:`UNMAPPED`, with the replacement; other missing names raise the usual AttributeError."""
    return _unmapped_names(module_name, UNMAPPED, foreign_path="dp_transformers",
                           guide="docs/migrating-from-opacus.md, section dp-transformers")


__getattr__ = unmapped_names(__name__)

__all__ = [
    "DataCollatorForPrivateCausalLanguageModeling",
    "GradSampleModule",
    "OpacusDPTrainer",
    "PrivacyArguments",
    "PrivacyEngineCallback",
    "TrainingArguments",
    "UNMAPPED",
    "create_author_mapping",
    "register_grad_sampler_gpt2",
    "register_grad_sampler_gpt2_lora",
    "units_from_author_mapping",
]
