"""DeepSpeed ZeRO stages 1, 2 and 3 under DP-SGD: each rank's partition of the noised gradient handed to ZeRO.

At every stage the controller keeps each hooked layer's own parameters out of autograd, so ``engine.backward``
produces no ``p.grad``; ZeRO's gradient hooks are removed while the engine is private (a gradient by a path the
controller does not see, which it refuses, never enters ZeRO's buckets) and DeepSpeed's reduction in backward is
switched off (``engine.enable_backward_allreduce = False``, the flag its pipeline engine uses). The DP optimizer
clips every sample and its gradient writer reduce-scatters the clipped sums into ZeRO's partition layout at the
end of every backward pass (:mod:`dptorch.distributed.partitions`: each rank holds only its partition of them
between micro-batches); at the step each rank adds its partition's slice of the noise (every element drawn once,
by its owner, the values of one process's ``ShardedNoise`` stream), divides by the plan's divisor and hands the
partition to ZeRO, which steps its partitioned fp32 master weights from it and all-gathers the weights:

* ZeRO-1 and ZeRO-2 (:mod:`dptorch.distributed.deepspeed_zero12`): each parameter group's flat buffer is
  partitioned; the partition becomes ZeRO's ``averaged_gradients`` (what its backward epilogue would fill);
* ZeRO-3 (:mod:`dptorch.distributed.deepspeed_zero3`): the parameters themselves are partitioned; each
  parameter's partition is written with ZeRO-3's ``set_local_grad_for_param`` (layers whose samplers would read a
  released parameter are refused).

Nothing is averaged and nothing full-size is drawn: the partition is the sum of the ranks' clipped sums plus noise.

``engine.step()`` on a private engine is the DP optimizer's step (an instance attribute that
shadows DeepSpeed's method until ``detach``), so DeepSpeed's loop ``loss = engine(x);
engine.backward(loss); engine.step()`` is private as written, virtual steps (``BatchMemoryManager``)
included: a skipped step never reaches DeepSpeed.

Refused before any step (``check_engine``), each with its reason: ZeRO stage 0, fp16 (loss
scaling that skips steps on overflow), DeepSpeed's ``gradient_clipping`` (its default is 1.0: it
would clip the averaged, noised gradient, not each sample), ``gradient_accumulation_steps`` other
than 1 (DeepSpeed divides the loss by it and steps on a fixed count; a Poisson logical batch has no
fixed count), CPU/NVMe offloading, pipeline parallelism, ZenFlow, unmanaged gradient accumulation,
a data-parallel group smaller than the world (model or sequence parallelism), the client torch
optimizer passed instead of ``engine.optimizer``, and at stage 3 leaf modules and parameters
partitioned over fewer ranks than the world (and, when the private engine is made, the layers
and modes of :mod:`~dptorch.distributed.deepspeed_zero3`, and bandmf noise). Checkpoints
of the hand-over's state are refused too: DeepSpeed's partitioned state is saved by DeepSpeed.

Memory: at every stage the clipped sums are reduce-scattered at the end of every backward pass, and between the
micro-batches of a step each rank holds its partition of them only (``1 / world`` of the trainable parameters,
fp32); the price is one reduce-scatter of the trainable parameters' size per backward pass instead of one
all-reduce per step.

Why ``engine.step`` is replaced on the engine instance: DeepSpeed 0.19.8 has no hook before its step, and its
``step()`` at a boundary always counts a global step and steps the learning-rate schedule (``_take_model_step``;
an ``overflow`` flag skips the update, not the count), so a virtual step (``BatchMemoryManager``) can only stay
invisible to DeepSpeed if its ``step()`` does not run; the optimizer ``step()`` consults (``engine.optimizer``)
is DeepSpeed's own ZeRO optimizer, which would have to be replaced on the engine instead. ``detach`` restores it.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, List, Optional

import torch

from dptorch.distributed import deepspeed_zero12 as zero12
from dptorch.distributed import deepspeed_zero3 as zero3
from dptorch.distributed.partitions import noise_problems


def is_deepspeed_engine(module: Any) -> bool:
    """Whether ``module`` is a ``deepspeed.DeepSpeedEngine`` (False when DeepSpeed was never imported)."""
    deepspeed = sys.modules.get("deepspeed")
    engine_type = getattr(deepspeed, "DeepSpeedEngine", None) if deepspeed is not None else None
    return engine_type is not None and isinstance(module, engine_type)


def engine_problems(engine: Any) -> List[str]:
    """What in a DeepSpeed engine's set-up private training cannot keep exact and private (empty: none)."""
    problems: List[str] = []
    stage = int(engine.zero_optimization_stage())
    if stage == 0:
        problems.append('ZeRO stage 0 is DeepSpeed\'s plain data parallelism: use "zero_optimization": {"stage": 1}, '
                        "2 or 3, or torch's DistributedDataParallel")
    elif stage not in (1, 2, 3):
        problems.append(f"ZeRO stage {stage} is unknown to dptorch: use stage 1, 2 or 3")
    if engine.fp16_enabled():
        problems.append('fp16 with DeepSpeed\'s loss scaling skips a step when a scaled gradient overflows, a data-'
                        'dependent event the accountant does not cover: use "bf16" or fp32')
    if float(engine.gradient_clipping() or 0.0) > 0.0:
        problems.append(f'"gradient_clipping": {engine.gradient_clipping()} (DeepSpeed\'s default is 1.0) would clip '
                        "the averaged, noised gradient, not each sample, and change the update: set "
                        '"gradient_clipping": 0 in the config; dptorch clips every sample at max_grad_norm')
    if int(engine.gradient_accumulation_steps()) != 1:
        problems.append(f'"gradient_accumulation_steps": {engine.gradient_accumulation_steps()}: DeepSpeed divides '
                        "the loss by it and steps on a fixed count of micro-batches, while a Poisson logical batch "
                        'has none: set it to 1 and split a logical batch with BatchMemoryManager')
    if _offloads(engine):
        problems.append("ZeRO offloading (offload_optimizer / offload_param) moves the gradients through other "
                        "buffers that dptorch does not hand its gradient to: remove the offload sections")
    if getattr(engine, "pipeline_parallelism", False):
        problems.append("pipeline parallelism (PipelineModule) splits one sample's gradient over the stages: "
                        "use data parallelism only")
    if getattr(engine, "zenflow", False):
        problems.append("ZenFlow updates parts of the model on its own schedule: remove the zenflow section")
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if managed is not None and not managed():
        problems.append('"managed_gradient_accumulation": false moves the gradient reduction into step(): '
                        "remove it (dptorch's BatchMemoryManager accumulates)")
    parts = {1: zero12.ZERO12_PARTS, 2: zero12.ZERO12_PARTS, 3: zero3.ZERO3_PARTS}.get(stage, ())
    missing = [name for name in parts if not hasattr(engine.optimizer, name)]
    if missing:
        problems.append(f"this DeepSpeed's ZeRO optimizer ({type(engine.optimizer).__name__}) has no "
                        f"{', '.join(missing)}, through which dptorch hands it the noised gradient (tested with "
                        "deepspeed 0.19.8): install that version")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if stage in (1, 2) and not missing:
        problems += zero12.engine_problems(engine.optimizer, world)
    if stage == 3 and not missing:
        problems += zero3.engine_problems(engine.optimizer, world)
    if int(getattr(engine, "dp_world_size", world)) != world:
        problems.append(f"the data-parallel group has {engine.dp_world_size} of {world} ranks (model, tensor or "
                        "sequence parallelism), which splits one sample's gradient: use data parallelism only")
    return problems


def _offloads(engine: Any) -> bool:
    """Whether ZeRO offloads the optimizer or the parameters (a section with ``"device": "none"``, as Accelerate's
    plugin writes, offloads nothing)."""
    for name in ("zero_offload_optimizer", "zero_offload_param"):
        section = getattr(engine, name, lambda: None)()
        device = getattr(section, "device", None)
        if getattr(device, "value", device) not in (None, "none"):
            return True
    return False


def check_engine(engine: Any, optimizer: Any = None) -> None:
    """Refuse, before anything is attached, a DeepSpeed set-up that private training does not support."""
    if optimizer is not None and optimizer is not engine.optimizer:
        raise ValueError(
            "with a DeepSpeed engine, pass the optimizer deepspeed.initialize returned (engine.optimizer): got "
            f"{type(optimizer).__name__}, whose parameters DeepSpeed replaced by its own partitions"
        )
    problems = engine_problems(engine)
    if problems:
        raise ValueError("private training under DeepSpeed refuses this set-up: " + "; ".join(problems))


class DeepSpeedHandOver(torch.optim.Optimizer):
    """The DP optimizer's inner optimizer under DeepSpeed: its parameters are the model's that ZeRO steps. By its
    ``step()`` the DP optimizer's gradient writer has handed ZeRO each rank's partition of the noised gradient
    (``deepspeed_zero12``, ``deepspeed_zero3``); ``step()`` runs ZeRO-3's backward epilogue (which only points its
    step at the partitions written; ZeRO-1/2's would overwrite them) and DeepSpeed's own ``engine.step()``.

    Learning rates and schedules are DeepSpeed's (its optimizer and scheduler); this optimizer has none.
    """

    def __init__(self, engine: Any) -> None:
        zero = engine.optimizer
        self.stage = int(engine.zero_optimization_stage())
        if self.stage == 3:
            params = zero3.trainable_params(zero)
        else:
            params = [p for group in zero.bit16_groups for p in group if p.requires_grad]  # what ZeRO steps
        super().__init__(params, defaults={})
        self.engine = engine
        self._lr_kwargs: Optional[Dict[str, Any]] = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: D102 - see the class
        if closure is not None:
            raise ValueError("DeepSpeed's step takes no closure")
        if self.stage == 3:  # its reduce-scatter buckets are empty
            self.engine.allreduce_gradients()
        type(self.engine).step(self.engine, lr_kwargs=self._lr_kwargs)  # DeepSpeed's own step (the instance's is ours)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError(
            "dptorch does not checkpoint a private DeepSpeed run yet: DeepSpeed's partitioned optimizer state is "
            "saved by engine.save_checkpoint, and the privacy state (accountant, noise generator, sampler) with it "
            "is not wired; a resumed run would not be exact"
        )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.state_dict()


def attach(engine: Any, dp_optimizer: Any) -> None:
    """Make ``engine.backward`` reduce nothing and ``engine.step()`` the DP optimizer's step; ``detach`` undoes it."""
    hand_over = dp_optimizer.original_optimizer
    if not isinstance(hand_over, DeepSpeedHandOver) or hand_over.engine is not engine:
        raise TypeError("the DP optimizer does not hand its gradient to this DeepSpeed engine")

    def private_step(self: Any, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        check_engine(self)  # the set-up again (gradient_accumulation_steps can be changed), before the noise
        hand_over._lr_kwargs = lr_kwargs
        try:
            dp_optimizer.step()
        finally:
            hand_over._lr_kwargs = None

    zero = engine.optimizer
    layers = zero3.layer_problems(dp_optimizer.hooks) if hand_over.stage == 3 else []
    problems = layers + noise_problems(dp_optimizer)
    if problems:  # before anything on the engine changes; the controller and the optimizer's listener removed
        dp_optimizer.detach()
        dp_optimizer.hooks.cleanup()
        advice = ". Or use ZeRO stage 1 or 2, which keep whole parameters on every rank" if layers else ""
        raise ValueError(f"private training under DeepSpeed ZeRO-{hand_over.stage} refuses this model: "
                         + "; ".join(problems) + advice)
    if hand_over.stage == 3:
        engine.__dict__["_dptorch_markers"] = zero3.attach(engine, dp_optimizer)
    else:
        dp_optimizer.use_gradient_writer(zero12.Zero12Partitions(zero))
    engine.__dict__["_dptorch_saved"] = (engine.enable_backward_allreduce, bool(zero._grad_acc_hooks))
    # ZeRO's gradient hooks would put any gradient autograd still gives a parameter (a path the controller does not
    # see, which it refuses at the end of that backward) into ZeRO's buckets, where a later step would add it raw
    for handle in zero._grad_acc_hooks:
        handle.remove()
    zero._grad_acc_hooks = []
    engine.enable_backward_allreduce = False
    engine.step = types.MethodType(private_step, engine)


def detach(engine: Any) -> None:
    """DeepSpeed's own gradient hooks, backward reduction and step again."""
    if "_dptorch_saved" in engine.__dict__:
        engine.enable_backward_allreduce, had_hooks = engine.__dict__.pop("_dptorch_saved")
        engine.__dict__.pop("step", None)
        zero3.restore_markers(engine.__dict__.pop("_dptorch_markers", {}))
        if had_hooks and int(engine.zero_optimization_stage()) == 3:
            engine.optimizer._partition_all_parameters()  # a backward refused half-way leaves some gathered
            engine.optimizer.create_reduce_and_remove_grad_hooks()
        elif had_hooks:
            engine.optimizer.create_gradient_handling_hooks()


__all__ = ["DeepSpeedHandOver", "attach", "check_engine", "detach", "engine_problems", "is_deepspeed_engine"]
