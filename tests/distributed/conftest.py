"""Launches shared by the distributed tests: one for every engine-level scenario, one per Trainer set-up."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session")
def spawned():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from tests.distributed.workers import spawn_all

    return spawn_all()


@pytest.fixture
def result(spawned):
    """``result(name, rank)``: what scenario ``name`` returned on ``rank`` (its traceback if it failed)."""
    from tests.distributed.workers import reader

    return reader(spawned)


def _hf_launch(tmp_path_factory, mode, world=None):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from tests.distributed.launch import WORLD, torchrun

    return torchrun("hf_script.py", tmp_path_factory.mktemp(f"hf-{mode}"), mode, reports=mode, world=world or WORLD)


@pytest.fixture(scope="session")
def hf_ddp(tmp_path_factory):
    """(reports, stdout) of ``hf_script.py ddp``: DPTrainer (and TRL's SFT and DPO trainers) under DDP."""
    return _hf_launch(tmp_path_factory, "ddp")


@pytest.fixture(scope="session")
def hf_fsdp(tmp_path_factory):
    """(reports, stdout) of ``hf_script.py fsdp``: the same under FSDP2 through Accelerate."""
    return _hf_launch(tmp_path_factory, "fsdp")


@pytest.fixture(scope="session")
def hf_offload(tmp_path_factory):
    """(reports, stdout) of ``hf_script.py offload``: DPTrainer under FSDP2 with Accelerate's CPU offloading."""
    return _hf_launch(tmp_path_factory, "offload")


@pytest.fixture(scope="session")
def hf_hsdp(tmp_path_factory):
    """(reports, stdout) of ``hf_script.py hsdp`` on 4 processes: DPTrainer under HSDP (Accelerate's
    ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)`` with FSDP2)."""
    return _hf_launch(tmp_path_factory, "hsdp", world=4)


@pytest.fixture(scope="session")
def hf_ddp4(tmp_path_factory):
    """(reports, stdout) of ``hf_script.py ddp-only`` on 4 processes: the same DPTrainer run under DDP."""
    return _hf_launch(tmp_path_factory, "ddp-only", world=4)
