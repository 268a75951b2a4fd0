"""The backward round: one backward pass, whose layer calls' per-sample gradients the mode's strategy
sums per parameter. It begins at the first captured gradient, and at its end the parameters that got a
gradient without a per-sample one are refused, the ranks' parts are summed, ``p.grad_sample`` is set
and the listeners (the DP optimizer) are told; a further backward pass while a round's results are
still held, and nobody consumed them, is an error rather than a silent mix."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from dptorch.grad_sample.capture.attachment import Attachment, HookTarget
from dptorch.grad_sample.capture.settings import Settings, Switches
from dptorch.grad_sample.capture.sharding import Sharding
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.modes.buffers import BufferPool
from dptorch.grad_sample.modes.book_keeping import BookKeeping
from dptorch.grad_sample.modes.instantiate import Instantiate
from dptorch.grad_sample.modes.layer_call import LayerCall
from dptorch.grad_sample.tracking import watch as draw_watch
from dptorch.grad_sample.tracking.reads import ParameterReads
from dptorch.grad_sample.units.token_tracker import refuse as refused_for_tokens
from dptorch.grad_sample.units.token_units import TokenUnits


class Rounds(HookTarget):
    """The held round of ``hooks`` (the controller, whose public API it uses: ``clear()``,
    ``parameter_name()``, ``last_batch_size``, ``unit_kind``, and which it hands to the listeners): its
    strategy, the parameters autograd gave a gradient, its privacy units, and the kept ``p.grad_sample``."""

    def __init__(self, hooks: Any, settings: Settings, switches: Switches, attachment: Attachment,
                 sharding: Sharding) -> None:
        self._hooks, self._settings, self._switches = hooks, settings, switches
        self._attachment, self._sharding = attachment, sharding
        self.buffers = BufferPool()  # per-sample gradient memory, lent again each round (CPU)
        self.strategy = self._new_strategy()
        self.reads = ParameterReads(attachment.owners, hooks.parameter_name, self.read_backward)  # tracking/reads.py
        self.listeners: List[Callable[[Any], None]] = []
        self.unit_ids: Optional[torch.Tensor] = None  # set_privacy_units of row ids
        self.units: Optional[TokenUnits] = None  # the token units of the held round
        self.uncaptured: List[str] = []  # parameters the last backward gave gradients but no capture
        self._received: Dict[nn.Parameter, None] = {}
        self._kept_grad_samples: List[nn.Parameter] = []  # p.grad_sample left after a step, until the next forward
        self.in_backward = False
        self.done = False
        self.consumed = False
        self._outer_task: Optional[int] = None  # the graph task of the backward pass through the model's outputs
        self._nested_round = False  # the held round began in a pass nested in the outer one

    def on_outputs_backward(self) -> None:
        """The model's outputs got their gradient: the graph task running now is the outer backward pass. A
        round begun inside another (the backward of a segment of reentrant activation checkpointing, which
        torch runs nested in the outer one) ends with the outer pass, not with that segment: each sample is
        clipped once per pass."""
        task = torch._C._current_graph_task_id()
        if task != self._outer_task:  # (one left by a backward that raised is stale: its callback never ran)
            self._outer_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_outer)

    def _end_outer(self) -> None:
        self._outer_task = None
        if self.in_backward and self._nested_round:  # begun in a nested pass, not ended there
            self._end_round()

    def _new_strategy(self):
        if self._settings.grad_sample_mode in ("bk", "ghost"):
            return BookKeeping(self._hooks.parameter_name, self.buffers)
        return Instantiate(self._hooks.parameter_name, self.buffers)

    def reset(self, keep_grad_samples: bool) -> None:
        """The round's part of ``clear()``: forget the held per-sample gradients (see there)."""
        self._drop_kept_grad_samples()
        if keep_grad_samples:
            self._kept_grad_samples = [p for p in self.strategy.grads if "grad_sample" in p.__dict__]
        else:
            for param in self.strategy.grads:
                param.__dict__.pop("grad_sample", None)
        self.strategy = self._new_strategy()
        if not keep_grad_samples:  # (kept ones are taken back when they are dropped)
            self.buffers.reclaim()  # the dropped round's memory, where nothing else holds it
        self.done = False
        self.consumed = False
        self.units = None

    def abandon(self) -> bool:
        """A pass raised before its round reached the listeners: forget its partial round (a failed backward never
        runs the end-of-round callback). False when the error came from the listeners (the round is done but not
        consumed): what they did with it is unknown, and nothing is reset."""
        if self.done and not self.consumed:
            return False
        self.in_backward = False
        self._received = {}
        self.reads.delivered.clear()
        return True

    def _drop_kept_grad_samples(self) -> None:
        for param in self._kept_grad_samples:
            param.__dict__.pop("grad_sample", None)
        self._kept_grad_samples = []

    def free_kept_grad_samples(self) -> None:
        """A training forward starts: the ``p.grad_sample`` a step kept go, and their memory is lent again."""
        if self._kept_grad_samples:
            self._drop_kept_grad_samples()
            self.buffers.reclaim()

    def enter_units(self, units: Optional[TokenUnits]) -> None:
        """This backward pass's calls all come from forwards with the same privacy units."""
        if self.units is not units and (self.units is not None or self.strategy.covers()):
            raise PerSampleGradientError(
                "one backward pass reached layer calls of forwards with different privacy units (a packed forward and "
                "another): run the backward of each packed forward before the next forward"
            )
        self.units = units

    def read_backward(self, param: nn.Parameter, grads: torch.Tensor) -> None:
        """Per-sample gradients of a parameter read outside its module's call (``tracking/reads.py``)."""
        if self._switches.suspended:
            return
        if self._hooks.unit_kind == "tokens":
            raise refused_for_tokens(f"{self._hooks.parameter_name(param)} is read outside its module's call")
        self.begin_round()
        grads = self._settings.per_sample_scale(grads, grads.shape[0])
        call = LayerCall(self._hooks.parameter_name(param), self._attachment.module, {"read": param}, None, None, (), grads)
        self.strategy.add(call, {param: grads})

    def on_grad_accumulated(self, param: nn.Parameter) -> None:
        param = self._sharding.canonical.get(param, param)  # FSDP2: a gathered parameter stands for its shard
        names = self._attachment.param_names
        if self._switches.paused and param.requires_grad and param in names:
            self._switches.paused_gradients[param] = None  # never used by a DP step (DPOptimizer.pre_step)
            return
        if param.requires_grad and param in names and not self._switches.suspended:
            self.begin_round()
            self._received[param] = None

    def begin_round(self) -> None:
        if self.in_backward:
            return
        if self.done:
            if not self.consumed:
                raise PerSampleGradientError(
                    "a second backward pass ran while the per-sample gradients of the previous one were still held. "
                    "Call optimizer.step() or optimizer.zero_grad() (or hooks.clear()) between backward passes; for "
                    "gradient accumulation use the DP optimizer, which clips after every backward pass."
                )
            self._hooks.clear()
        self.in_backward = True
        self._nested_round = self._outer_task is not None and torch._C._current_graph_task_id() != self._outer_task
        if not self._nested_round:  # (nested: reentrant checkpointing; the round ends with the outer pass)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_round)

    def _end_round(self) -> None:
        self.in_backward = False
        self.done = True
        if self._settings.grad_sample_mode == "ew":
            self._collect_expanded_grad_samples()
        covered = self.strategy.covers()
        received, self._received = list(self._received), {}
        if self._settings.suppressing or self._settings.grad_sample_mode == "ew":  # (expanded weights never write p.grad)
            self._refuse_unseen_paths([p for p in received if p in covered and p not in self.reads.delivered])
        self.reads.delivered.clear()
        missing = [p for p in received if p not in covered] + self._attachment.unwatched_parameters_with_grads(covered)
        self.uncaptured = [self._hooks.parameter_name(p) for p in missing]
        if missing and (covered or self._attachment.module.training):
            self._hooks.clear()
            raise PerSampleGradientError(
                f"parameters {_name_list([self._hooks.parameter_name(p) for p in missing])} received a gradient but no "
                "per-sample gradient. They were used outside a hooked forward: a forward run before the hooks "
                "attached, a module added after they attached (attach after PEFT/model surgery), a module in eval "
                "mode, or a weight read directly by another module's code (e.g. a fused LM head)."
            )
        summed = []
        partial = self._sharding.partial_params()
        if partial:  # each rank holds part of these per-sample gradients: the sum is the gradient
            summed = self._sharding.sum_partials(self.strategy.grads, partial)
        self.strategy.finish_round(self.unit_ids if self.units is None else None)
        unsummed = self._unsummed_partial_gradients(partial, summed) if partial else []
        if unsummed:  # held in a form the sum cannot reach (a weight shared by several calls): not the gradient
            self._hooks.clear()
            raise PerSampleGradientError(
                f"parameters {_name_list([self._hooks.parameter_name(p) for p in unsummed])} hold part of each sample's "
                "gradient on every tensor-parallel rank (replicated_with_grad_allreduce, SequenceParallel), but this "
                "backward pass formed them where the parts cannot be summed before their norms; use "
                "grad_sample_mode='hooks'"
            )
        for param, grad in self.strategy.grads.items():
            param.__dict__["grad_sample"] = grad
        if self.listeners:
            for listener in list(self.listeners):
                listener(self._hooks)
            self.consumed = True
        draw_watch.resume()  # the loop's code until the next forward is the draw's watch's to follow

    def _unsummed_partial_gradients(self, partial: List[nn.Parameter], summed: List[nn.Parameter]) -> List[nn.Parameter]:
        covered, summed_ids = self.strategy.covers(), {id(p) for p in summed}
        return [p for p in partial if p in covered and id(p) not in summed_ids]

    def _collect_expanded_grad_samples(self) -> None:
        """Move the ``grad_sample`` torch wrote on each parameter into the strategy's table."""
        for param in self._attachment.param_names:
            grad = param.__dict__.pop("grad_sample", None)
            if grad is None and self._hooks.last_batch_size == 0 and self._received.pop(param, False) is None:
                grad = param.new_zeros((0, *param.shape))  # an empty Poisson batch: no sample, no row
            if grad is not None:
                self.strategy.grads[param] = grad

    def _refuse_unseen_paths(self, params: List[nn.Parameter]) -> None:
        """Covered parameters that also got an autograd gradient: a path the controller does not see."""
        if not params:
            return
        self._hooks.clear()
        raise PerSampleGradientError(
            f"parameters {_name_list([self._hooks.parameter_name(p) for p in params])} got gradient by a path outside "
            "their own module's call: the weight is read directly elsewhere (a tied head computed as "
            "h @ emb.weight.T, a penalty on the weight added to the loss, another module's code using it). That "
            "gradient has no per-sample counterpart, so it cannot be clipped. Call the module instead (e.g. "
            "nn.Linear with the tied weight as lm_head), or apply weight decay in the optimizer, not in the loss."
        )


def _name_list(names: List[str], shown: int = 5) -> str:
    """``a, b, c and 4 more``: a list cut with its count, never silently."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
