"""PrivacyArguments: the DP-SGD settings of a private Trainer, as a dataclass for HfArgumentParser.

Field names never collide with ``TrainingArguments``, ``SFTConfig`` or ``DPOConfig``, so one
parser can hold them all: the clipping bound is ``per_sample_max_grad_norm`` because
``TrainingArguments.max_grad_norm`` (the Trainer's own, non-private clipping) already exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from dptorch.accounting import check_accountant_name, check_calibration_accountant
from dptorch.grad_sample.modes.auto import MODES as _ACCEPTED_MODES
from dptorch.noise.banded.mechanism import NOISE_MECHANISMS, _check_mechanism
from dptorch.clipping.adaptive import CLIPPING_STATS, clipping_plan_fields
from dptorch.clipping.factors import CLIPPING_MODES
from dptorch.optim.captured_step import check_row_options
from dptorch.optim.loss_scaling import check_schedule

#: "auto" (the default: bk where a layer has a norm sampler, else hooks) and every controller mode; "ghost" is
#: book-keeping under Opacus' name (one backward pass).
GRAD_SAMPLE_MODES = _ACCEPTED_MODES


@dataclass
class PrivacyArguments:
    """How to train privately: noise (or a target epsilon), clipping, sampling, accounting.

    Give exactly one of ``noise_multiplier`` and ``target_epsilon``; with ``target_epsilon`` the
    noise is calibrated so that the planned training (``max_steps`` or ``num_train_epochs``) ends
    at that epsilon. A "sample" is a privacy unit: one dataset row by default, or all rows that
    share a value of ``privacy_unit_column`` (user-level DP).
    """

    noise_multiplier: Optional[float] = field(
        default=None, metadata={"help": "Std of the Gaussian noise relative to per_sample_max_grad_norm."}
    )
    target_epsilon: Optional[float] = field(
        default=None, metadata={"help": "Calibrate the noise so the planned training spends this epsilon."}
    )
    target_delta: float = field(
        default=1e-5, metadata={"help": "The delta of the (epsilon, delta) guarantee; must be < 1/(number of units)."}
    )
    per_sample_max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clipping bound C of each privacy unit's gradient (the sensitivity)."}
    )
    clipping: str = field(default="flat", metadata={"help": f"Clipping mode, one of {CLIPPING_MODES}."})
    accountant: str = field(
        default="pld",
        metadata={"help": "Privacy accountant: pld, prv, rdp or gdp (gdp, an approximation, cannot calibrate target_epsilon)."},
    )
    max_epsilon: Optional[float] = field(
        default=None,
        metadata={
            "help": "Stop training before epsilon would exceed this value (default: target_epsilon when it is given)."
        },
    )
    poisson_sampling: bool = field(
        default=True,
        metadata={"help": "Poisson-sample each logical batch; False is refused (it would understate epsilon)."},
    )
    privacy_unit_column: Optional[str] = field(
        default=None,
        metadata={"help": "Dataset column with each row's privacy unit (a user id...); rows sharing it are one unit."},
    )
    grad_sample_mode: str = field(
        default="auto",
        metadata={"help": f"Per-sample gradients: {GRAD_SAMPLE_MODES}. 'auto' runs 'bk' (book-keeping: norms and "
                  "clipped sums without per-sample gradients, one backward pass) when a trainable layer has a norm "
                  "sampler (Linear, Conv1D, Embedding), else 'hooks'; the mode that ran is logged and reported."},
    )
    capture_step: Optional[bool] = field(
        default=None,
        metadata={"help": "The captured private step (dptorch.capture_step): each micro-batch shape's forward, backward "
                  "and clipping traced once under the batch tracker and replayed, compiled when torch_compile=True. "
                  "None (default): captured when torch_compile=True and the set-up allows it, else eager (a step "
                  "that does not trace warns and runs eagerly); True: captured, refusing a set-up it cannot be; "
                  "False: eager. Give fixed shapes: the collator's pad_to_multiple_of for lengths, "
                  "capture_rows_per_replay (or capture_pad_to_multiple_of) for rows."},
    )
    capture_pad_to_multiple_of: Optional[int] = field(
        default=None,
        metadata={"help": "Captured step: pad each Poisson micro-batch with masked rows (exactly 0 to the sums, not "
                  "counted) to a multiple of this many rows, one shape traced and compiled per multiple, instead of "
                  "replays of capture_rows_per_replay rows."},
    )
    capture_rows_per_replay: Optional[int] = field(
        default=None,
        metadata={"help": "Captured step: run each Poisson micro-batch as replays of exactly this many rows (the last "
                  "padded with masked rows), so that one batch shape is traced and compiled whatever the draw's size. "
                  "None: per_device_train_batch_size, unless capture_pad_to_multiple_of is given (1: trace each size)."},
    )
    secure_mode: bool = field(
        default=False, metadata={"help": "Draw the noise and the Poisson sampling from the OS CSPRNG (not replayable)."}
    )
    sampling_seed: Optional[int] = field(
        default=None,
        metadata={"help": "Seed of the Poisson sampler; default: a secret seed from OS entropy, kept in checkpoints."},
    )
    noise_seed: Optional[int] = field(
        default=None,
        metadata={"help": "Seed of the noise generator; default: OS entropy. Never publish a seed you used."},
    )
    clipping_gamma: Optional[float] = field(
        default=None,
        metadata={"help": "clipping='automatic': each unit's gradient is scaled by 1/(norm + gamma); default 0.01."},
    )
    target_unclipped_quantile: Optional[float] = field(
        default=None,
        metadata={"help": "clipping='adaptive': the fraction of units the bound should leave unclipped; default 0.5."},
    )
    clipbound_learning_rate: Optional[float] = field(
        default=None,
        metadata={"help": "clipping='adaptive': learning rate of the geometric bound update; default 0.2."},
    )
    max_clipbound: Optional[float] = field(
        default=None, metadata={"help": "clipping='adaptive': largest bound; default no limit."}
    )
    min_clipbound: Optional[float] = field(
        default=None, metadata={"help": "clipping='adaptive': smallest bound; default 0."}
    )
    unclipped_num_std: Optional[float] = field(
        default=None,
        metadata={"help": "Noise std of the released count of unclipped units (adaptive clipping, private "
                  "clipping_stats); default expected batch size / 20. The gradient noise is raised to pay for it."},
    )
    clipping_stats: Optional[str] = field(
        default=None,
        metadata={"help": f"Clipping statistics in the logs, one of {CLIPPING_STATS}: 'raw' (exact fraction "
                  "clipped and norm quantiles, NOT covered by epsilon) or 'private' (noised fraction, accounted)."},
    )

    noise_mechanism: str = field(
        default="independent",
        metadata={"help": f"Noise across steps, one of {NOISE_MECHANISMS}: 'independent' (DP-SGD) or 'bandmf' (banded "
                  "matrix-factorisation noise, correlated over `bands` steps, with b-min-separated cyclic Poisson "
                  "sampling; see docs/correlated-noise.md)."},
    )
    # Union[int, str]: HfArgumentParser reads it as a string, and __post_init__ turns "4" into 4.
    bands: Optional[Union[int, str]] = field(
        default=None,
        metadata={"help": "noise_mechanism='bandmf': the number of bands b of the noise correlation, or 'auto' "
                  "(with target_epsilon): the b of lowest expected error, DP-SGD's b=1 where no band is lower."},
    )

    fp16_loss_scale: Optional[float] = field(
        default=None,
        metadata={"help": "fp16=True: the loss scale of the DPGradScaler that replaces Accelerate's GradScaler, a power "
                  "of two (default: Accelerate's initial scale, 2^16). Fixed: no step is skipped or scale lowered for "
                  "an overflow; an overflowed unit contributes zero (docs/privacy.md, fp16 loss scaling)."},
    )
    fp16_scale_growth_interval: Optional[int] = field(
        default=None,
        metadata={"help": "fp16=True: double the loss scale every this many steps, up to 2^24 (a schedule of the step "
                  "count only); default None keeps it fixed."},
    )

    audit_canaries: int = field(
        default=0,
        metadata={"help": "Gradient canaries for the one-run audit of this run (0: none): extra privacy units, each "
                  "included with probability 1/2; the logs and the model card then hold two lower bounds on epsilon "
                  "(docs/auditing.md). 1,000 or more for a useful bound."},
    )
    audit_confidence: float = field(default=0.95, metadata={"help": "Confidence of the audited lower bounds."})
    audit_seed: Optional[int] = field(
        default=None, metadata={"help": "Seed of the audit canaries (which are in, their draws); default OS entropy."}
    )

    def __post_init__(self) -> None:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                "PrivacyArguments needs exactly one of noise_multiplier (the noise to add) and target_epsilon (the "
                f"budget to calibrate the noise to); got noise_multiplier={self.noise_multiplier}, "
                f"target_epsilon={self.target_epsilon}"
            )
        sigma = self.noise_multiplier
        if sigma is not None and not (sigma >= 0 and math.isfinite(sigma)):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {self.noise_multiplier}")
        for name in ("target_epsilon", "max_epsilon"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.target_delta < 1:
            raise ValueError(f"target_delta must be in (0, 1), got {self.target_delta}")
        if not (self.per_sample_max_grad_norm > 0 and math.isfinite(self.per_sample_max_grad_norm)):
            raise ValueError(
                f"per_sample_max_grad_norm must be a finite number > 0, got {self.per_sample_max_grad_norm}"
            )
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {self.clipping!r}")
        self.clipping_options()  # refuses options the clipping mode does not use
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ValueError(f"grad_sample_mode must be one of {GRAD_SAMPLE_MODES}, got {self.grad_sample_mode!r}")
        self.accountant = check_accountant_name(self.accountant)
        if self.target_epsilon is not None:
            check_calibration_accountant(self.accountant)
        if not self.poisson_sampling:
            raise ValueError(
                "poisson_sampling=False is refused: the Trainer's shuffled fixed-size batches do not give the "
                "subsampling guarantee the accountant assumes, so the reported epsilon would be too small. Keep "
                "poisson_sampling=True (each logical batch then has per_device_train_batch_size * "
                "gradient_accumulation_steps units on average)."
            )
        if not (isinstance(self.audit_canaries, int) and (self.audit_canaries == 0 or self.audit_canaries >= 2)):
            raise ValueError(f"audit_canaries must be 0 (no audit) or a whole number >= 2, got {self.audit_canaries!r}")
        if not 0 < self.audit_confidence < 1:
            raise ValueError(f"audit_confidence must be in (0, 1), got {self.audit_confidence}")
        if self.capture_step is not None and not isinstance(self.capture_step, bool):
            raise ValueError(f"capture_step must be None (auto), True or False, got {self.capture_step!r}")
        check_row_options(self.capture_pad_to_multiple_of, self.capture_rows_per_replay, prefix="capture_")
        for name in ("capture_pad_to_multiple_of", "capture_rows_per_replay"):
            if getattr(self, name) is not None and self.capture_step is False:
                raise ValueError(f"{name} shapes the captured step's batches, but capture_step=False")
        if self.secure_mode and self.noise_seed is not None:
            raise ValueError("secure_mode draws noise from the OS CSPRNG and takes no noise_seed; remove one of them")
        if self.secure_mode and self.sampling_seed is not None:
            raise ValueError(
                "secure_mode draws the Poisson sampling from the OS CSPRNG and takes no sampling_seed; remove one of them"
            )

        if self.fp16_loss_scale is not None or self.fp16_scale_growth_interval is not None:
            check_schedule(2.0**16 if self.fp16_loss_scale is None else self.fp16_loss_scale,
                           growth_interval=self.fp16_scale_growth_interval)

        if isinstance(self.bands, str) and self.bands.strip().isdecimal():
            self.bands = int(self.bands)  # the command line's --bands 4
        if self.noise_mechanism == "bandmf" and self.bands == "auto":
            if self.target_epsilon is None:
                raise ValueError(
                    "bands='auto' chooses the bands of lowest expected error at a target epsilon, but "
                    f"noise_multiplier={self.noise_multiplier} is given instead: give target_epsilon (the noise is "
                    "then calibrated for the chosen bands), or a whole number of bands"
                )
        else:
            _check_mechanism(self.noise_mechanism, self.bands)
        if self.noise_mechanism == "bandmf" and (self.clipping == "adaptive" or self.clipping_stats == "private"):
            raise ValueError(
                "noise_mechanism='bandmf' with a released count of unclipped units (clipping='adaptive' or "
                "clipping_stats='private') is not covered by the amplified banded MF accounting; use clipping='flat' "
                "(or 'per_layer', 'automatic') and clipping_stats None or 'raw' with bandmf"
            )

    @property
    def banded(self) -> Optional[Union[int, str]]:
        """The bands b of a bandmf run, None for independent noise.

        ``"auto"`` until a private Trainer resolves it: ``trainer.privacy_args`` is a copy with the b it chose."""
        return self.bands if self.noise_mechanism == "bandmf" else None

    def clipping_options(self) -> Dict[str, Any]:
        """The privacy plan's clipping fields (gamma, adaptive settings, count noise, statistics)."""
        return clipping_plan_fields(
            self.clipping, gamma=self.clipping_gamma, target_unclipped_quantile=self.target_unclipped_quantile,
            clipbound_learning_rate=self.clipbound_learning_rate, max_clipbound=self.max_clipbound,
            min_clipbound=self.min_clipbound, unclipped_num_std=self.unclipped_num_std,
            clipping_stats=self.clipping_stats,
        )

    @property
    def budget_cap(self) -> Optional[float]:
        """The epsilon training must not exceed: ``max_epsilon``, else ``target_epsilon``, else None."""
        return self.max_epsilon if self.max_epsilon is not None else self.target_epsilon
