"""The private Trainer under DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (``TrainingArguments(deepspeed=config)``, or
Accelerate's DeepSpeed plugin that ``accelerate launch --use_deepspeed`` sets up).

The Trainer builds DeepSpeed's engine through Accelerate in ``train()`` and runs every micro-batch as
``engine.backward(loss)``, calling ``engine.step()`` after the last micro-batch of a logical step
(Accelerate's ``DeepSpeedEngineWrapper``). The private Trainer makes that engine private as
:mod:`dptorch.distributed.deepspeed` does for the engine API (``engine.step()`` becomes the DP
optimizer's step, which hands the noised gradient to ZeRO), so the Trainer's loop stays as it is.

Under ZeRO-3 the controller attaches at construction, to the model's parameters as they are (whole, or
already partitioned when the model was built after the ``TrainingArguments``, under
``deepspeed.zero.Init``), and DeepSpeed partitions the rest in place when ``train()`` builds the engine
(the same ``nn.Parameter`` objects); a model whose trainable layers ZeRO-3 cannot train privately
(samplers that read released parameters, e.g. a full fine-tune's embedding:
:mod:`dptorch.distributed.deepspeed_zero3`) is refused then, before any step.

The configuration, after the Trainer filled its ``"auto"`` values, is checked at construction
(:func:`config_problems`) and once more on the engine before its first step (``check_engine``), and
two values are set:

* ``gradient_accumulation_steps`` becomes 1 for DeepSpeed (``train_batch_size`` with it). The
  Trainer's own ``gradient_accumulation_steps`` still splits each Poisson logical batch into that
  many micro-batches and calls ``engine.step()`` once per logical batch; DeepSpeed needs no count of
  its own (it would divide the loss by it and step on a fixed count, which a Poisson batch has not),
  and the Trainer's backward never scales by it (``scale_wrt_gas=False``).
* ``gradient_clipping`` becomes 0 where the configuration leaves it to the Trainer: ``"auto"`` (as
  HF's documented configurations write it) or no key at all. The Trainer would fill ``"auto"`` from
  ``TrainingArguments.max_grad_norm`` (default 1.0), which the private Trainer ignores on every path
  (its clipping is each unit's, at ``PrivacyArguments.per_sample_max_grad_norm``), and DeepSpeed's
  default is 1.0; either would clip the averaged, noised gradient once more. A number written in the
  configuration is the user's explicit wish for that second clipping: above 0 it is refused, with
  that reason (the update would no longer be the DP-SGD step the privacy report describes).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

#: :func:`written_gradient_clipping` when the configuration has no ``"gradient_clipping"`` key, or
#: when what was written is not known (Accelerate's plugin: only the filled configuration is seen).
ABSENT, UNKNOWN = "absent", "unknown"


def deepspeed_config(trainer: Any) -> Optional[Dict[str, Any]]:
    """The DeepSpeed configuration the Trainer's engine will be built from (None: DeepSpeed is off)."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    return trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config


def written_gradient_clipping(args: Any) -> Any:
    """``"gradient_clipping"`` as the user wrote it in ``TrainingArguments(deepspeed=...)`` (a dict, a JSON
    file or a JSON string), before the Trainer filled ``"auto"``: the value, :data:`ABSENT` or :data:`UNKNOWN`."""
    written = getattr(args, "deepspeed", None)
    if isinstance(written, str):
        try:
            if os.path.isfile(written):
                with open(written, encoding="utf-8") as handle:
                    written = json.load(handle)
            else:
                written = json.loads(written)
        except (OSError, ValueError):
            return UNKNOWN
    if not isinstance(written, dict):
        return UNKNOWN
    return written.get("gradient_clipping", ABSENT)


def left_to_the_trainer(written_clipping: Any) -> bool:
    """Whether the configuration leaves ``gradient_clipping`` to the Trainer (``"auto"``, or no key)."""
    return written_clipping in ("auto", ABSENT)


def clip_each_unit_only(config: Dict[str, Any], args: Any, per_sample_max_grad_norm: float) -> None:
    """Set ``"gradient_clipping"`` to 0 in place where the configuration leaves it to the Trainer, and say so."""
    written = written_gradient_clipping(args)
    if left_to_the_trainer(written) and config.get("gradient_clipping", 1.0) != 0:
        config["gradient_clipping"] = 0.0
        logger.info('DeepSpeed "gradient_clipping" (%s) set to 0: the private Trainer clips each unit at '
                    "per_sample_max_grad_norm=%g instead, and max_grad_norm is ignored as on every other path",
                    '"auto"' if written == "auto" else "absent", per_sample_max_grad_norm)


def config_problems(config: Dict[str, Any], written_clipping: Any = UNKNOWN) -> List[str]:
    """What in a DeepSpeed configuration the private Trainer refuses (the engine's list, read from the config);
    ``written_clipping`` is :func:`written_gradient_clipping` (``"auto"`` or absent there: set to 0, not refused)."""
    zero = config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    problems: List[str] = []
    if stage not in (1, 2, 3):
        problems.append(f'ZeRO stage {stage}: use "zero_optimization": {{"stage": 1}}, 2 or 3 (stage 0 is plain data '
                        "parallelism: launch without a DeepSpeed config for DDP)")
    if stage == 3 and int(zero.get("stage3_module_granularity_threshold", 0) or 0) > 0:
        problems.append('"stage3_module_granularity_threshold" makes small modules ZeRO-3 leaf modules, which reduce '
                        "their parameters' gradients in a module backward hook of their own: remove it")
    if _enabled(config.get("fp16")):
        problems.append("fp16 with DeepSpeed's loss scaling skips a step when a scaled gradient overflows, a data-"
                        'dependent event the accountant does not cover: use bf16=True ("bf16": {"enabled": "auto"}) '
                        "or fp32")
    clipping = config.get("gradient_clipping", 1.0)  # DeepSpeed's default when the key is absent
    if not left_to_the_trainer(written_clipping) and (clipping == "auto" or float(clipping) > 0):
        problems.append(f'"gradient_clipping" is {clipping}: it would clip the averaged, noised gradient a second '
                        "time, and the update would no longer be the DP-SGD step the privacy report describes. Set "
                        '"gradient_clipping": "auto" or 0 in the DeepSpeed config (the private Trainer then clips '
                        "each unit only, at PrivacyArguments.per_sample_max_grad_norm)")
    offloaded = [name for name in ("offload_optimizer", "offload_param")
                 if str((zero.get(name) or {}).get("device", "none")).lower() != "none"]
    if offloaded:
        problems.append(f"ZeRO offloading ({', '.join(offloaded)}) moves the gradients through buffers that dptorch "
                        "does not hand its gradient to: remove the offload sections")
    for section in ("zenflow", "pipeline"):
        if config.get(section):
            problems.append(f'the "{section}" section splits or schedules a step in a way dptorch does not follow: '
                            "remove it")
    return problems


def one_deepspeed_step_per_logical_batch(config: Dict[str, Any], args: Any) -> None:
    """Set DeepSpeed's ``gradient_accumulation_steps`` to 1 (and ``train_batch_size`` to match) in place: the
    Trainer's accumulation splits the Poisson logical batch, and ``engine.step()`` runs once per logical batch."""
    config["gradient_accumulation_steps"] = 1
    if isinstance(config.get("train_batch_size"), int):
        config["train_batch_size"] = args.per_device_train_batch_size * args.world_size


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) not in (False, "false", None)


__all__ = [
    "clip_each_unit_only",
    "config_problems",
    "deepspeed_config",
    "one_deepspeed_step_per_logical_batch",
    "written_gradient_clipping",
]
