"""What sharding changes for the capture: tensor parallelism's split and replicated layers (checked at
attach; their layout answered once per backward round; the ranks' partial per-sample gradients summed)
and FSDP2's gathered parameters (aliases of the registered ones during a call)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from dptorch.distributed.tensor_parallel import (
    check_sharding,
    partial_gradient_params,
    sum_partial_gradients,
    tensor_parallel_group,
    token_split_part,
    whole_on_every_rank,
)
from dptorch.grad_sample.capture.attachment import HookedLayer
from dptorch.grad_sample.capture.settings import Settings
from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.layers.registry import find_grad_sampler
from dptorch.grad_sample.tracking import INNER, CallBatch
from dptorch.grad_sample.units.token_units import TokenUnits


class Sharding:
    """The tensor-parallel plan of ``module`` (``tensor_parallel``: parameter -> layout) and the layouts
    of this round's calls; FSDP2's gathered parameters, by the registered ones (``canonical``)."""

    def __init__(self, module: nn.Module, settings: Settings) -> None:
        self.module = module
        self._settings = settings
        # tensor parallelism splits one sample's gradient across ranks: only the splits it can add up
        self.tensor_parallel = check_sharding(module)
        self._whole: Dict[nn.Parameter, bool] = {}  # split layers computed whole this round
        self._partial_gradients = partial_gradient_params(module) if self.tensor_parallel else []
        self.tensor_parallel_modules = [m for m in module.modules()
                                        if any(p in self.tensor_parallel for p in m.parameters(recurse=False))]
        self.replicated = {id(m) for m in self.tensor_parallel_modules  # SequenceParallel's norms
                           if not any(self.tensor_parallel[p].sharded for p in m.parameters(recurse=False))}
        self._token_split: Dict[nn.Parameter, bool] = {}  # replicated layers whose inputs were split along the tokens
        # Parameter a sharding wrapper (FSDP2's fully_shard) swaps in for the call -> registered one
        self.canonical: Dict[torch.Tensor, nn.Parameter] = {}
        self._check_replicated_tensor_parallel()

    def _check_replicated_tensor_parallel(self) -> None:
        """Refuse a layer with replicated tensor-parallel weights (SequenceParallel) that no grad sampler
        covers: the ranks' parts of its per-sample gradients are summed only on the grad samplers' path."""
        mode = self._settings.grad_sample_mode
        for name, sub in self.module.named_modules():
            if id(sub) not in self.replicated or not any(p.requires_grad for p in sub.parameters(False)):
                continue
            if mode in ("functorch", "ew") or find_grad_sampler(sub) is None:
                raise ValueError(
                    f"{name} ({type(sub).__name__}) has weights replicated over the tensor-parallel group "
                    f"(SequenceParallel) and no grad sampler in grad_sample_mode={mode!r}: each rank "
                    "holds part of every sample's tokens, and only a grad sampler's per-sample gradients (of a layer "
                    "that acts on each token on its own: LayerNorm, RMSNorm) are summed over the ranks. Register a "
                    "grad sampler for it, use grad_sample_mode 'hooks', 'bk' or 'ghost', or leave it out of the plan"
                )

    def new_round(self) -> None:
        """Forget the layouts the last round's calls answered."""
        self._whole = {}
        self._token_split = {}

    @property
    def whole_params(self) -> set:
        """The split parameters whose per-sample gradients this round formed whole on every rank."""
        return {p for p, whole in self._whole.items() if whole}

    def local_sums(self, sums: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
        """Clipped sums formed whole on every rank cut to this rank's slice (in place)."""
        for p, whole in self._whole.items():  # formed whole on every rank: keep this rank's slice
            if whole and p in sums:
                sums[p] = self.tensor_parallel[p].local_of(sums[p].reshape(self.tensor_parallel[p].shape))
        return sums

    def partial_params(self) -> List[nn.Parameter]:
        """The parameters of which each rank holds part of every per-sample gradient this round."""
        return self._partial_gradients + [p for p, split in self._token_split.items() if split]

    def sum_partials(self, grads: Dict[nn.Parameter, torch.Tensor], partial: List[nn.Parameter]) -> List[nn.Parameter]:
        """Sum the ranks' parts of ``partial``'s per-sample gradients (those summed)."""
        return sum_partial_gradients(grads, partial, tensor_parallel_group(self.tensor_parallel))

    def replicated_call(self, layer: HookedLayer, params, call: CallBatch, units: Optional[TokenUnits],
                        activations, grad_outputs):
        """The local inputs and output gradients of a layer whose weights are whole on every rank; under
        ``SequenceParallel`` they hold this rank's tokens, so its per-sample gradients are this rank's part,
        summed over the group at the end of the pass (one answer per parameter and pass)."""
        batched = call.kind == "batched"
        batch_dim = self._settings.batch_dim
        in_dims = call.input_dims if batched else (batch_dim,) * len(activations)
        out_dim = call.output_dims[0] if batched else batch_dim
        width = max(len(p.shape) for p in params.values())
        try:
            split_in = [token_split_part(a, None if d is None else d % INNER, width) for a, d in zip(activations, in_dims)]
            split_out = [token_split_part(g, None if out_dim is None else out_dim % INNER, width) for g in grad_outputs]
        except ValueError as error:
            raise PerSampleGradientError(f"{layer.name} ({type(layer.module).__name__}): {error}") from None
        splits = {dim for (_, dim), d in zip(split_in, in_dims) if d is not None} | {split_out[0][1]}
        if len(splits) > 1 or (None not in splits and not layer.token_wise):
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}): its weights are replicated over the tensor-parallel "
                f"group, but its input and output gradient are split along dims {sorted(splits, key=str)} (None: whole) "
                "and the layer is not one that acts on each token on its own: its per-sample gradients cannot be "
                "formed from each rank's tokens. Use SequenceParallel on norm layers only"
            )
        split = None not in splits
        if split and units is not None:
            raise PerSampleGradientError(
                f"{layer.name} ({type(layer.module).__name__}): privacy units of tokens (packed sequences) and "
                "SequenceParallel, which gives each rank a slice of the tokens, are not supported together"
            )
        for p in params.values():
            if self._token_split.setdefault(p, split) != split:
                raise PerSampleGradientError(
                    f"{layer.name}: one backward pass reached calls of this layer with inputs split along the tokens "
                    "and with whole inputs; its per-sample gradients need one layout per pass"
                )
        return tuple(t for t, _ in split_in), tuple(t for t, _ in split_out)

    def note_call(self, layer: HookedLayer, params, activations, backprops) -> None:
        """Whether this call of a split layer gives each sample's whole gradient on every rank, or this
        rank's slice (``tensor_parallel.whole_on_every_rank``); one answer per parameter and round."""
        for p in params.values():
            layout = self.tensor_parallel.get(p)
            if layout is None or not layout.sharded:
                continue
            whole = whole_on_every_rank(layer.module, layout, activations, backprops)
            if self._whole.setdefault(p, whole) != whole:
                raise PerSampleGradientError(
                    f"{layer.name}: one backward pass reached calls of this split layer with whole and with sliced "
                    "inputs; per-sample gradients of a split weight need one layout per pass"
                )

    def live_params(self, module: nn.Module, layer: HookedLayer) -> Dict[str, torch.Tensor]:
        """The parameter tensors this call of ``layer`` uses, by name: the registered ones, or the
        ones a sharding wrapper swapped in for the call (FSDP2's all-gathered parameters), which
        are then remembered as aliases of the registered ones (``canonical``)."""
        if self._settings.grad_sample_mode == "ew":  # expanded weights stand in for the parameters: not aliases
            return dict(layer.params)
        live = {}
        for name, param in layer.params.items():
            current = module._parameters.get(name)
            if isinstance(current, nn.Parameter) and current is not param:
                self.canonical[current] = param
                live[name] = current
            else:
                live[name] = param
        return live

    def keyed_by_registered(self, fn: Optional[Callable]) -> Optional[Callable]:
        """``fn``, a function returning a dict by parameter, with its keys mapped to the registered
        parameters (a sampler run while FSDP2 has its gathered parameters in place)."""
        canonical = self.canonical
        if fn is None or not canonical:
            return fn

        def keyed(*args: Any, **kwargs: Any) -> Dict[nn.Parameter, Any]:
            return {canonical.get(p, p): value for p, value in fn(*args, **kwargs).items()}

        return keyed
