"""Which DTensors FSDP2 manages is read from its internals; where they are not found, FSDP2 is refused
(a DTensor it does not gather, such as a tensor-parallel weight, would split each sample's gradient)."""

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptorch.grad_sample import GradSampleHooks


@pytest.fixture
def one_process_group():
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo, and no process group in this process")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_fully_shard_params_are_accepted_and_refused_when_fsdp2_internals_are_not_found(one_process_group, monkeypatch):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = nn.Sequential(nn.Linear(4, 3))
    fully_shard(model)
    GradSampleHooks(model, loss_reduction="sum").cleanup()  # its shards: found, accepted

    def moved(self):
        raise AttributeError("'FSDPState' object has no attribute '_fsdp_param_groups'")

    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", moved)
    with pytest.raises(ValueError, match="cannot tell which parameters fully_shard manages in this torch version"):
        GradSampleHooks(model, loss_reduction="sum")
