"""One privacy plan for all ranks: what the accounting assumes is compared across the processes.

On several processes every rank builds its own :class:`~dptorch.plan.PrivacyPlan` from its own
data loader and arguments, while the DP optimizer adds up the clipped sums of all ranks into one
noised step. The guarantee holds only when every rank's plan is the same: a rank whose loader has
another batch size samples at another rate (its rows spend more privacy than the others report),
one with another dataset length draws from another N (data pre-sharded per rank: part of each
shard is never drawn, and no rank's accountant describes the union), one with another clipping
bound or noise multiplier breaks the sensitivity or the noise the accountant assumes, and ranks
with other steps per epoch wait for each other in the step's collective until it times out.

``check_ranks_agree(plan, **extra)``, called wherever a plan is built, gathers every rank's
``plan_terms`` (one ``all_gather_object`` of the default process group, in which every rank takes
part) and raises the same ``ValueError`` on every rank when any term differs, before anything is
attached or any parameter changes. Without a process group, or on one process, it does nothing.

Data pre-sharded per rank (each rank its own part of the data) is refused, not supported: the
library could not prove that the parts are disjoint pieces of one dataset (the same rows on two
ranks would be drawn twice per step), so every rank must hold the whole dataset and dptorch's
distributed sampler splits each global Poisson draw over the ranks (docs/distributed.md).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch.distributed as dist

#: Terms of the sampling: a rank that differs samples at another rate or takes other steps.
_SAMPLING = ("sample_rate", "steps_per_epoch", "expected_batch_size", "planned_steps", "steps", "sampling",
             "micro_batches")


def plan_terms(plan: Any, **extra: Any) -> Dict[str, Any]:
    """What the accounting of ``plan`` assumes, as plain values, with ``extra`` (e.g. ``loss_reduction``).

    A calibrated plan is compared by its calibration's inputs (target epsilon and delta, sample rate,
    planned steps, accountant), not by the noise multiplier the search found: each rank's search
    meets the same target, and its last bits may differ between CPUs.
    """
    strategy = plan.strategy
    return {
        "num_units": plan.num_units,
        "sample_rate": plan.sample_rate,
        "steps_per_epoch": plan.steps_per_epoch,
        "expected_batch_size": plan.expected_batch_size,
        "planned_steps": plan.planned_steps,
        "steps": plan.steps,
        "sampling": plan.sampling,
        "mechanism": plan.mechanism,
        "bands": plan.bands,
        "strategy_horizon": None if strategy is None else strategy.horizon,
        "noise_multiplier": plan.noise_multiplier if plan.target_epsilon is None else "calibrated",
        "target_epsilon": plan.target_epsilon,
        "target_delta": plan.target_delta,
        "max_grad_norm": plan.max_grad_norm,
        "clipping": plan.clipping,
        "gamma": plan.gamma,
        "adaptive": None if plan.adaptive is None else plan.adaptive.as_dict(),
        "clipping_stats": plan.clipping_stats,
        "unclipped_num_std": plan.unclipped_num_std,
        "accountant": None if plan.accountant is None else str(plan.accountant.mechanism),
        "secure_mode": plan.secure_mode,
        **extra,
    }


def check_ranks_agree(plan: Any, **extra: Any) -> None:
    """Refuse, on every rank with one message, a ``plan`` (and ``extra`` terms) that differs between the ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, plan_terms(plan, **extra))
    message = disagreement(gathered)
    if message:
        raise ValueError(message)


def disagreement(terms: List[Dict[str, Any]]) -> str:
    """Why the ranks' ``terms`` (rank order) cannot share one guarantee; '' when they are all equal."""
    differing = [key for key in terms[0] if any(rank.get(key) != terms[0][key] for rank in terms)]
    if not differing:
        return ""
    listed = "; ".join(f"{key}: {_by_value([rank.get(key) for rank in terms])}" for key in differing)
    message = (
        f"the {len(terms)} ranks would train under different privacy plans ({listed}). The DP optimizer adds up "
        "the clipped sums of all ranks into one noised step, but each rank accounts its own plan: no rank's epsilon "
        "would describe the run (rows drawn at a larger rate spend more privacy than any rank reports), and ranks "
        "that take different steps wait for each other until the collective times out."
    )
    if "num_units" in differing:
        message += (
            " The ranks' datasets differ in size: data pre-sharded per rank is not supported, because dptorch cannot "
            "check that the shards are disjoint parts of one dataset, and each rank draws its share rank::world_size "
            "of one Poisson draw over the dataset every rank holds. Pass the whole dataset to every rank and let "
            "make_private (or DPDataLoader(..., distributed=True), or DPTrainer) split each draw over the ranks."
        )
    if set(differing) & set(_SAMPLING):
        message += (
            " Give every rank the same data loader settings (batch size or sample rate, steps; for DPTrainer "
            "per_device_train_batch_size, gradient_accumulation_steps and the training steps)."
        )
    if set(differing) - set(_SAMPLING) - {"num_units"}:
        message += (
            " Pass the same privacy arguments on every rank (noise multiplier or target epsilon and delta, clipping "
            "bound and mode, accountant, secure mode, loss reduction, noise mechanism)."
        )
    return message + " Nothing was changed; every rank refuses with this message."


def _by_value(values: List[Any]) -> str:
    """``values`` (one per rank) grouped: ``0.2 on ranks 0, 2 vs 0.025 on rank 1``."""
    ranks: Dict[str, List[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value), []).append(rank)
    return " vs ".join(f"{value} on rank{'s' if len(at) > 1 else ''} {_ranks(at)}" for value, at in ranks.items())


def _ranks(at: List[int]) -> str:
    shown = ", ".join(map(str, at[:8]))
    return shown + (f" and {len(at) - 8} more" if len(at) > 8 else "")
