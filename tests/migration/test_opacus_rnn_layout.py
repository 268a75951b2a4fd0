"""Opacus' DPRNN/DPGRU/DPLSTM submodule paths (``l{i}.ih``, ``l{i}_reverse.hh``) resolve to views holding the
very parameters of dptorch's sweeps; the state dict, ``named_parameters()`` and the hooked layers are unchanged."""

import pytest
import torch

from dptorch.grad_sample import GradSampleHooks
from dptorch.layers import DPGRU, DPLSTM, DPRNN
from tests.helpers import check_per_sample_grads


@pytest.mark.parametrize("cls", [DPRNN, DPGRU, DPLSTM])
def test_opacus_paths_hold_the_same_parameters_in_every_direction(cls):
    layer = cls(3, 4, num_layers=2, bidirectional=True, batch_first=True)
    keys, names = list(layer.state_dict()), [n for n, _ in layer.named_parameters()]
    for i in range(2):
        for suffix in ("", "_reverse"):
            for which in ("ih", "hh"):
                view = layer.get_submodule(f"l{i}{suffix}.{which}")
                assert view.weight is getattr(layer, f"weight_{which}_l{i}{suffix}")
                assert view.bias is getattr(layer, f"bias_{which}_l{i}{suffix}")
    assert list(layer.state_dict()) == keys and [n for n, _ in layer.named_parameters()] == names
    assert len(list(layer.parameters())) == 16
    aliases = {n for n, _ in layer.named_parameters(remove_duplicate=False)}
    assert {"l1_reverse.hh.bias", "sweeps.l1_reverse.bias_hh"} <= aliases  # listed where torch lists every path
    with pytest.raises(TypeError, match="not a layer"):
        layer.l0.ih(torch.randn(2, 3))


def test_assigning_through_a_view_replaces_the_sweeps_parameter_and_capture_follows():
    torch.manual_seed(0)
    layer = DPLSTM(3, 3, num_layers=2, batch_first=True)
    layer.l1.ih.weight = layer.l0.ih.weight  # tied the way transformers ties (setattr on the parent module)
    assert layer.weight_ih_l1 is layer.weight_ih_l0 and len(list(layer.parameters())) == 7
    with GradSampleHooks(layer) as hooks:
        assert {type(m).__name__ for m in hooks._layers} == {"RecurrentSweep"}  # views are not hooked
    check_per_sample_grads(layer, (torch.randn(4, 5, 3),))  # the shared weight's per-sample gradients stay exact
