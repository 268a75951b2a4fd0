"""What a private Trainer refuses, and why: checked at construction, before any training step.

Each refusal names the setting and the fix. Anything here would otherwise give a silently
non-private gradient, a wrong epsilon, or a crash in the middle of training.
"""

from __future__ import annotations

import warnings
from typing import Any, List

from torch.utils.data import IterableDataset

from dptorch.distributed.fsdp import fully_shard_params, is_sharded
from dptorch.distributed.tensor_parallel import transformers_style
from dptorch.integrations.hf.arguments import PrivacyArguments
from dptorch.integrations.hf.deepspeed import config_problems, deepspeed_config, written_gradient_clipping


def _tensor_parallel(model: Any) -> bool:
    """Whether ``model`` holds tensor-parallel slices (DTensors FSDP2 does not gather, or transformers'
    tensor-parallel styles); False for a model without any."""
    if model is None:
        return False
    if any(transformers_style(sub) is not None for sub in model.modules()):
        return True
    sharded = [p for p in model.parameters() if is_sharded(p)]
    return bool(sharded) and not set(sharded) <= set(fully_shard_params(model))


#: Why an iterable (streaming) train_dataset is refused, and how to go on.
STREAMING_REFUSAL = (
    "an iterable (streaming) train_dataset cannot be Poisson-sampled: each step must include every privacy unit "
    "independently with probability q, which needs random access to all N units and N itself (q, delta < 1/N and "
    "the accounting depend on it). Materialize it first: datasets' `Dataset.from_generator(lambda: iter(stream))` "
    "or `Dataset.from_list(list(stream))` (written to disk and read by index, so it need not fit in memory), or "
    "load_dataset(..., streaming=False); then pass that map-style dataset. Reading the stream in order in "
    "fixed-size batches is not a selection the private Trainer accounts: it accounts Poisson sampling (and cyclic "
    "Poisson sampling for bandmf) only. The engine accounts fixed-size batches of a map-style dataset "
    "(make_private(poisson_sampling=False): each pass one Gaussian of sigma/2 at rate 1, replace-one adjacency, "
    "no amplification, so a far larger epsilon), which also needs the materialized dataset"
)


def setup_problems(trainer: Any, privacy_args: PrivacyArguments) -> List[str]:
    """Every reason ``trainer`` cannot train privately as configured (empty when it can)."""
    args, dataset = trainer.args, trainer.train_dataset
    state = getattr(getattr(trainer, "accelerator", None), "state", None)
    fsdp = getattr(state, "fsdp_plugin", None) if getattr(trainer, "is_fsdp_enabled", False) else None
    optimizer_name = str(getattr(args.optim, "value", args.optim)).lower()
    parallelism = getattr(state, "parallelism_config", None) or getattr(args, "parallelism_config", None)
    refusals = [
        (dataset is None,
         "train_dataset is required at construction: the sampling rate and the noise depend on its size"),
        (isinstance(dataset, IterableDataset) or (dataset is not None and not hasattr(dataset, "__getitem__")),
         STREAMING_REFUSAL),
        (args.n_gpu > 1,
         "torch.nn.DataParallel (several GPUs in one process) is not supported: its replicas run the forward without "
         "the per-sample hooks; launch one process per GPU (torchrun / accelerate launch: DDP), which is supported"),
        (fsdp is not None and getattr(fsdp, "fsdp_version", 1) != 2,
         "FSDP1 (fsdp_version 1) is not supported: it flattens each wrapped module's parameters into one "
         "FlatParameter, which the per-sample hooks cannot key their gradients by. Use FSDP2 "
         "(fsdp_config={'version': 2}, or fsdp_version: 2 in the Accelerate config), which is supported"),
        (getattr(trainer, "is_fsdp_xla_enabled", False),
         "FSDP on XLA is not supported: its sharded parameters are not the DTensors the DP optimizer reduce-scatters "
         "and noises; use FSDP2 on GPUs"),
        (parallelism is not None and _splits_samples(parallelism),
         "parallelism_config with tensor / context / sequence parallelism (tp_size, cp_size or sp_size > 1) is not "
         "supported: it splits one sample's activations or gradient across ranks, and the per-sample norms would "
         "then be partial. Data parallelism only (dp_replicate_size, dp_shard_size) is supported under FSDP2"),
        (parallelism is not None and not _splits_samples(parallelism) and getattr(fsdp, "fsdp_version", None) != 2,
         "parallelism_config without FSDP2 is not supported (untested); for HSDP set dp_replicate_size and "
         "dp_shard_size with fsdp_config={'version': 2}, for DDP leave parallelism_config unset"),
        (_tensor_parallel(trainer.model),
         "a tensor-parallel model (from_pretrained(tp_plan=...), parallelize_module) is not supported in the private "
         "Trainer yet: its sampler deals each rank other samples, while tensor parallelism needs one batch on every "
         "rank of a group (Accelerate's tensor parallelism needs a GPU and is untested here). The engine supports it "
         "(PrivacyEngine.make_private on the split model: docs/distributed.md, Tensor parallelism)"),
        (args.fp16 and args.world_size > 1 and fsdp is not None,
         "fp16 under FSDP is not supported yet: the fixed-scale DPGradScaler that replaces Accelerate's GradScaler is "
         "tested on one process and under DDP, not with FSDP2's sharded gradients. Use bf16 (supported everywhere), "
         "or fp16 under DDP"),
        (trainer.model_init is not None and (args.world_size > 1 or deepspeed_config(trainer) is not None),
         "model_init (a new model, and a new private run, at each train(): hyperparameter_search) is supported on "
         "one process without DeepSpeed; pass model= there"),
        (args.auto_find_batch_size and (args.world_size > 1 or deepspeed_config(trainer) is not None),
         "auto_find_batch_size is supported on one process without DeepSpeed: it cuts a micro-batch into more "
         "forward and backward passes after an out-of-memory error, and on several processes (or under DeepSpeed, "
         "whose engine counts the passes of a step) every rank must run the same passes. Set "
         "per_device_train_batch_size yourself"),
        (args.use_liger_kernel,
         "Liger kernels replace the model's forward and fuse the LM head; unset use_liger_kernel"),
        (args.ignore_data_skip,
         "ignore_data_skip=True would replay used Poisson batches on resume, which the accountant does not cover"),
        (optimizer_name in ("lomo", "adalomo"),
         "LOMO optimizers update the parameters inside backward, before clipping and noise; choose another optim"),
        (getattr(args, "train_sampling_strategy", "random") in ("group_by_length", "batch_rebalance"),
         "train_sampling_strategy must be 'random' (Poisson sampling replaces it); length grouping is data-dependent"),
        (getattr(privacy_args, "banded", None) is not None and args.world_size > 1,
         "noise_mechanism='bandmf' is not supported on several processes yet: the banded noise state and the cyclic "
         "Poisson partitions would have to be shared by every rank. Use one process, or noise_mechanism='independent'"),
        (getattr(privacy_args, "banded", None) is not None and args.save_only_model,
         "save_only_model=True does not save the optimizer, which holds the banded noise state (the last bands-1 "
         "noise draws): a resumed bandmf run could not continue its correlated noise; unset save_only_model"),
        (args.save_only_model and privacy_args.noise_seed is not None,
         "save_only_model=True does not save the noise generator, so with noise_seed a resumed run would replay "
         "noise it already used; drop one of them"),
    ]
    deepspeed = deepspeed_config(trainer)
    if deepspeed is not None:  # ZeRO-1, 2 and 3 train privately (.deepspeed); the rest is refused
        written = written_gradient_clipping(args)
        refusals += [(True, f"DeepSpeed: {problem}") for problem in config_problems(deepspeed, written)]
    return [message for refused, message in refusals if refused]


def _splits_samples(parallelism_config: Any) -> bool:
    """Whether Accelerate's ``ParallelismConfig`` splits a sample over ranks (any size but the data-parallel ones
    above 1; HSDP's ``dp_replicate_size`` x ``dp_shard_size`` splits none)."""
    return any((getattr(parallelism_config, f"{name}_size", 1) or 1) > 1 for name in ("tp", "cp", "sp"))


def check_setup(trainer: Any, privacy_args: PrivacyArguments) -> None:
    """Raise ValueError listing every problem of :func:`setup_problems`; warn about ignored settings."""
    problems = setup_problems(trainer, privacy_args)
    if problems:
        raise ValueError("cannot train privately with this Trainer set-up:\n" + "\n".join(f"  - {p}" for p in problems))
    if trainer.args.max_grad_norm not in (0, 1.0):
        warnings.warn(
            f"TrainingArguments.max_grad_norm={trainer.args.max_grad_norm} is ignored by the private trainer: each "
            f"unit's gradient is clipped to PrivacyArguments.per_sample_max_grad_norm="
            f"{privacy_args.per_sample_max_grad_norm} instead",
            stacklevel=3,
        )
