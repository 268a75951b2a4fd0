"""DPRNN, DPGRU, DPLSTM: drop-in replacements for torch's fused recurrent layers.

Each layer-direction is a ``RecurrentSweep``: a small module that owns that layer-direction's
weights (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``, ``weight_hr``) and runs the
whole batch-first sequence in one call, so the controller sees one call per layer-direction with
the batch along dim 0. Its registered grad sampler recomputes the sweep in backward and turns
the per-step backprops into per-sample gradients with one contraction over time per weight.

The parent module presents torch's interface: constructor arguments, ``batch_first``,
``PackedSequence`` in and out, initial states, output shapes, and torch's parameter names in
``state_dict`` (``weight_ih_l0``, ``bias_hh_l1_reverse``, ``weight_hr_l0``...) and as
attributes, so weights load both ways. Sequences in a ``PackedSequence`` run padded with a mask:
every call keeps one row per sample and a finished sequence keeps its last state.

Opacus' submodule paths resolve too (``lstm.get_submodule("l0.ih")``, ``l1_reverse.hh.bias``): ``l0``
is a :class:`SweepView` made on access, whose ``ih`` and ``hh`` hold that sweep's very parameters as
``weight`` and ``bias`` (reading, and assigning, as transformers' weight tying does). The views are not
registered, so ``state_dict``, ``named_parameters()`` and the modules the controller hooks are unchanged;
only where torch lists every path to a parameter (``remove_duplicate=False``) are Opacus' paths listed too.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from typing import Any, Dict, Iterator, List, MutableMapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from dptorch.grad_sample.errors import PerSampleGradientError
from dptorch.grad_sample.layers.linear import linear_map_grad_samples
from dptorch.grad_sample.layers.registry import register_grad_sampler
from dptorch.layers.recurrence import CELL_KINDS, CellKind, sweep, sweep_backprops

_TORCH_NAME = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh|weight_hr)_(l\d+(?:_reverse)?)$")
_SWEEPS = "sweeps"

HiddenState = Union[Tensor, Tuple[Tensor, Tensor]]


class RecurrentSweep(nn.Module):
    """One layer of a recurrent network, in one direction, over a whole batch-first sequence.

    ``forward(x, state0, mask=None)``: ``x`` is ``(B, T, input_size)``, ``state0`` is
    ``(B, state_size)`` (``h0``, then ``c0`` for an LSTM), ``mask`` is an optional ``(B, T)`` bool
    tensor of real steps. Returns the state after every step, ``(B, T, state_size)``.
    """

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        *,
        bias: bool = True,
        proj_size: int = 0,
        reverse: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        self.mode = mode
        self.kind: CellKind = CELL_KINDS[mode]
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.proj_size = proj_size
        self.reverse = reverse
        factory = dict(device=device, dtype=dtype)
        gate_size = self.kind.gates * hidden_size
        self.weight_ih = nn.Parameter(torch.empty(gate_size, input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(gate_size, self.output_size, **factory))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(gate_size, **factory))
            self.bias_hh = nn.Parameter(torch.empty(gate_size, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        if proj_size > 0:
            self.weight_hr = nn.Parameter(torch.empty(proj_size, hidden_size, **factory))
        else:
            self.register_parameter("weight_hr", None)

    @property
    def output_size(self) -> int:
        """Size of ``h``: the projection size if any, else the hidden size."""
        return self.proj_size or self.hidden_size

    @property
    def state_size(self) -> int:
        return self.output_size + (self.hidden_size if self.kind.has_cell_state else 0)

    def split_state(self, state: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
        """``(B, state_size)`` -> ``(h, (c,))`` for an LSTM, ``(h, ())`` otherwise."""
        h = state[:, : self.output_size]
        return h, ((state[:, self.output_size :],) if self.kind.has_cell_state else ())

    def forward(self, x: Tensor, state0: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        gi = F.linear(x, self.weight_ih, self.bias_ih)
        h0, extra0 = self.split_state(state0)
        return sweep(self.kind.step, gi, h0, extra0, self.weight_hh, self.bias_hh, self.weight_hr, mask, self.reverse)

    def extra_repr(self) -> str:
        proj = f", proj_size={self.proj_size}" if self.proj_size else ""
        return f"{self.mode}, {self.input_size}, {self.hidden_size}{proj}, reverse={self.reverse}"


@register_grad_sampler(RecurrentSweep)
def recurrent_sweep_grad_sampler(
    module: RecurrentSweep, activations: Tuple[Tensor, ...], backprops: Tensor
) -> Dict[nn.Parameter, Tensor]:
    """Per-sample grads of a sweep: recompute it, then contract each map's backprops over time."""
    x, state0, *rest = activations
    mask = rest[0] if rest else None
    if tuple(state0.shape) != (x.shape[0], module.state_size):
        raise PerSampleGradientError(
            f"{type(module).__name__} got its inputs with the batch moved off dim 0: DP recurrent layers present "
            "batch-first calls whatever their batch_first, so attach the controller with batch_first=True"
        )
    h0, extra0 = module.split_state(state0)
    maps = sweep_backprops(
        module.kind.step, x, h0, extra0, module.weight_ih, module.bias_ih, module.weight_hh, module.bias_hh,
        module.weight_hr, mask, module.reverse, backprops,
    )
    grads = linear_map_grad_samples(module.weight_ih, module.bias_ih, *maps.input_map)
    grads.update(linear_map_grad_samples(module.weight_hh, module.bias_hh, *maps.hidden_map))
    if maps.projection_map is not None:
        grads.update(linear_map_grad_samples(module.weight_hr, None, *maps.projection_map))
    return grads


class _MapParameters(MutableMapping):
    """A sweep's parameters of one linear map (``"ih"``: ``weight_ih``, ``bias_ih``) under ``nn.Linear``'s
    names, read from and written to the sweep itself: the ``_parameters`` of a :class:`MapView`."""

    def __init__(self, sweep: RecurrentSweep, which: str) -> None:
        self._sweep = sweep
        self._names = {"weight": f"weight_{which}", "bias": f"bias_{which}"}

    def __getitem__(self, key: str) -> Optional[nn.Parameter]:
        return getattr(self._sweep, self._names[key])

    def __setitem__(self, key: str, value: Optional[nn.Parameter]) -> None:
        if key not in self._names:
            raise KeyError(f"{key!r}: a recurrent map holds only 'weight' and 'bias'")
        setattr(self._sweep, self._names[key], value)

    def __delitem__(self, key: str) -> None:
        raise TypeError("the parameters of a DP recurrent layer cannot be deleted through Opacus' submodule view")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class MapView(nn.Module):
    """Opacus' ``l0.ih`` / ``l0.hh`` (an ``nn.Linear`` there): ``weight`` and ``bias`` are the sweep's
    ``weight_ih`` and ``bias_ih`` (or ``_hh``), the same Parameter objects. It runs nothing: the sweep
    runs the whole sequence."""

    def __init__(self, sweep: RecurrentSweep, which: str) -> None:
        super().__init__()
        self.__dict__["_parameters"] = _MapParameters(sweep, which)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Opacus' l{i}.ih / l{i}.hh of a DP recurrent layer is a view of its weights, not a layer: "
                        "call the recurrent layer itself")


class SweepView(nn.Module):
    """Opacus' ``l0`` (a cell there) of one layer-direction: ``ih`` and ``hh``, views of the sweep's maps."""

    def __init__(self, sweep: RecurrentSweep) -> None:
        super().__init__()
        self.ih, self.hh = MapView(sweep, "ih"), MapView(sweep, "hh")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("Opacus' l{i} of a DP recurrent layer is a view of its weights, not a cell: call the "
                        "recurrent layer itself")


class DPRNNBase(nn.Module):
    """The machinery shared by DPRNN, DPGRU and DPLSTM (``mode`` as in ``nn.RNNBase``)."""

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        _check_arguments(mode, hidden_size, num_layers, dropout, proj_size)
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        self.sweeps = nn.ModuleDict()
        directions = ("", "_reverse") if bidirectional else ("",)
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else self._output_size * len(directions)
            for suffix in directions:
                self.sweeps[f"l{layer}{suffix}"] = RecurrentSweep(
                    mode, layer_input, hidden_size, bias=bias, proj_size=proj_size,
                    reverse=bool(suffix), device=device, dtype=dtype,
                )
        self.reset_parameters()
        self.register_state_dict_post_hook(_rename_to_torch_names)
        self.register_load_state_dict_pre_hook(_rename_from_torch_names)

    @property
    def _output_size(self) -> int:
        return self.proj_size or self.hidden_size

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def reset_parameters(self) -> None:
        """torch's initialisation: every weight uniform in ``(-1/sqrt(H), 1/sqrt(H))``."""
        bound = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0.0
        for param in self.parameters():
            nn.init.uniform_(param, -bound, bound)

    def flatten_parameters(self) -> None:
        """No-op, for code written for cuDNN's fused layers."""

    @property
    def all_weights(self) -> List[List[nn.Parameter]]:
        """Parameters per layer-direction, in torch's order."""
        return [[p for p in sweep.parameters()] for sweep in self.sweeps.values()]

    def _torch_named(self, name: str) -> Optional[Tuple[nn.Module, str]]:
        """``weight_ih_l0_reverse`` -> (the ``l0_reverse`` sweep, ``"weight_ih"``); None otherwise."""
        match = _TORCH_NAME.match(name)
        sweeps = self.__dict__.get("_modules", {}).get(_SWEEPS)
        if match is None or sweeps is None or match.group(2) not in sweeps:
            return None
        return sweeps[match.group(2)], match.group(1)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            sweeps = self.__dict__.get("_modules", {}).get(_SWEEPS)
            if sweeps is not None and name in sweeps:  # Opacus' l0, l1_reverse
                return SweepView(sweeps[name])
            target = self._torch_named(name)
            if target is None:
                raise
            return getattr(*target)

    def __setattr__(self, name: str, value: Any) -> None:
        target = self._torch_named(name)
        if target is None:
            super().__setattr__(name, value)
        else:
            setattr(*target, value)

    def named_modules(self, memo: Optional[set] = None, prefix: str = "", remove_duplicate: bool = True):
        """torch's; with ``remove_duplicate=False`` (every path a module is reachable by, as tied weights are
        listed) also Opacus' views (``l0``, ``l0.ih``, ...), so ``named_parameters(remove_duplicate=False)``
        lists ``l0.ih.weight`` beside ``sweeps.l0.weight_ih`` (transformers expands tied-weight keys from it)."""
        yield from super().named_modules(memo, prefix, remove_duplicate)
        if not remove_duplicate:
            for name, sweep in self.sweeps.items():
                yield from SweepView(sweep).named_modules(None, f"{prefix}.{name}" if prefix else name, False)

    def forward(self, input: Union[Tensor, PackedSequence], hx: Optional[HiddenState] = None):
        if isinstance(input, PackedSequence):
            x, lengths = pad_packed_sequence(input, batch_first=True)
            steps = torch.arange(x.shape[1], device=x.device)
            mask = steps[None, :] < lengths.to(x.device)[:, None]
            batched = True
        else:
            batched = input.dim() == 3
            if input.dim() not in (2, 3):
                raise ValueError(f"{type(self).__name__}: expected a 2-D or 3-D input, got {input.dim()}-D")
            x = input if batched else input.unsqueeze(0 if self.batch_first else 1)
            x = x if self.batch_first else x.transpose(0, 1)
            mask = None
        if x.shape[1] == 0:
            raise RuntimeError("Expected sequence length to be larger than 0 in RNN")
        if x.shape[-1] != self.input_size:
            raise RuntimeError(f"{type(self).__name__}: input.size(-1) must be equal to input_size. Expected {self.input_size}, got {x.shape[-1]}")
        states0 = self._initial_states(hx, x, batched)
        layer_input, finals = x, []
        sweeps = iter(zip(self.sweeps.values(), states0))
        for layer in range(self.num_layers):
            outputs = []
            for _ in range(self._num_directions):
                sweep_module, state0 = next(sweeps)
                states = sweep_module(layer_input, state0) if mask is None else sweep_module(layer_input, state0, mask)
                finals.append(states[:, 0] if sweep_module.reverse else states[:, -1])
                outputs.append(states[..., : self._output_size])
            layer_input = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, training=True)
        return self._format_output(input, layer_input, finals, batched)

    def _initial_states(self, hx: Optional[HiddenState], x: Tensor, batched: bool) -> List[Tensor]:
        """One ``(B, state_size)`` initial state per layer-direction, from torch's ``hx`` layout."""
        count, batch = self.num_layers * self._num_directions, x.shape[0]
        has_cell = self.mode == "LSTM"
        if hx is None:
            size = self._output_size + (self.hidden_size if has_cell else 0)
            return list(x.new_zeros(count, batch, size).unbind(0))
        parts = tuple(hx) if has_cell else (hx,)
        if has_cell and len(parts) != 2:
            raise RuntimeError(f"{type(self).__name__}: hx must be a tuple (h_0, c_0)")
        sizes = (self._output_size, self.hidden_size) if has_cell else (self.hidden_size,)
        checked = []
        for part, size in zip(parts, sizes):
            part = part if batched else part.unsqueeze(1)
            if tuple(part.shape) != (count, batch, size):
                raise RuntimeError(
                    f"{type(self).__name__}: expected hidden size {(count, batch, size)}, got {tuple(part.shape)}"
                )
            checked.append(part.to(x.dtype))
        return list(torch.cat(checked, dim=-1).unbind(0))

    def _format_output(self, input: Any, output: Tensor, finals: List[Tensor], batched: bool):
        final = torch.stack(finals, dim=0)  # (layers * directions, B, state_size)
        h_n = final[..., : self._output_size]
        hidden: HiddenState = (h_n, final[..., self._output_size :]) if self.mode == "LSTM" else h_n
        if isinstance(input, PackedSequence):
            return _pack_like(output, input), hidden
        if not self.batch_first:
            output = output.transpose(0, 1)
        if not batched:
            output = output.squeeze(0 if self.batch_first else 1)
            hidden = tuple(h.squeeze(1) for h in hidden) if isinstance(hidden, tuple) else hidden.squeeze(1)
        return output, hidden

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        defaults = dict(num_layers=1, bias=True, batch_first=False, dropout=0.0, bidirectional=False, proj_size=0)
        for name, default in defaults.items():
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)}"
        return s


class DPRNN(DPRNNBase):
    """Drop-in ``nn.RNN`` (Elman, tanh or relu) with exact per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"Unknown nonlinearity '{nonlinearity}'. Select from 'tanh' or 'relu'.")
        super().__init__(
            f"RNN_{nonlinearity.upper()}", input_size, hidden_size, num_layers, bias, batch_first,
            dropout, bidirectional, device=device, dtype=dtype,
        )
        self.nonlinearity = nonlinearity


class DPGRU(DPRNNBase):
    """Drop-in ``nn.GRU`` with exact per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            "GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            device=device, dtype=dtype,
        )


class DPLSTM(DPRNNBase):
    """Drop-in ``nn.LSTM`` (``proj_size`` included) with exact per-sample gradients."""

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(
            "LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
            proj_size, device=device, dtype=dtype,
        )


def _check_arguments(mode: str, hidden_size: int, num_layers: int, dropout: float, proj_size: int) -> None:
    """torch's argument checks, with the same messages where they exist."""
    if not isinstance(dropout, numbers.Number) or not 0 <= dropout <= 1 or isinstance(dropout, bool):
        raise ValueError("dropout should be a number in range [0, 1] representing the probability of an element being zeroed")
    if dropout > 0 and num_layers == 1:
        warnings.warn(
            "dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects "
            f"num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}"
        )
    if not isinstance(hidden_size, int) or hidden_size <= 0:
        raise ValueError(f"hidden_size must be a positive integer, got {hidden_size!r}")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if proj_size < 0:
        raise ValueError("proj_size should be a positive integer or zero to disable projections")
    if proj_size >= hidden_size:
        raise ValueError("proj_size has to be smaller than hidden_size")
    if proj_size and mode != "LSTM":
        raise ValueError("proj_size argument is only supported for LSTM, not RNN or GRU")


def _pack_like(padded: Tensor, like: PackedSequence) -> PackedSequence:
    """Pack a batch-first ``padded`` output exactly as ``like`` is packed (same order and sizes)."""
    batch_sizes = like.batch_sizes
    lengths = (batch_sizes[:, None] > torch.arange(int(batch_sizes[0]))[None, :]).sum(0)  # sorted lengths
    order = like.sorted_indices
    sorted_padded = padded if order is None else padded.index_select(0, order.to(padded.device))
    data = pack_padded_sequence(sorted_padded, lengths, batch_first=True, enforce_sorted=True).data
    return PackedSequence(data, batch_sizes, like.sorted_indices, like.unsorted_indices)


def _rename_to_torch_names(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: ``sweeps.l0_reverse.weight_ih`` -> ``weight_ih_l0_reverse``."""
    head = f"{prefix}{_SWEEPS}."
    for key in [k for k in state_dict if k.startswith(head)]:
        sweep_name, _, param = key[len(head) :].partition(".")
        state_dict[f"{prefix}{param}_{sweep_name}"] = state_dict.pop(key)


def _rename_from_torch_names(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: ``weight_ih_l0_reverse`` -> ``sweeps.l0_reverse.weight_ih``."""
    for key in list(state_dict):
        if not key.startswith(prefix):
            continue
        match = _TORCH_NAME.match(key[len(prefix) :])
        if match is not None:
            state_dict[f"{prefix}{_SWEEPS}.{match.group(2)}.{match.group(1)}"] = state_dict.pop(key)
