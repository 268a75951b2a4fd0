"""examples/distributed_trainer.py --fsdp where Accelerate will not shard (no accelerator): it stops
before building anything, with exit status 2 on every rank and one line from rank 0 only."""

import pytest
import torch

REASON = ("FSDP was asked for, but Accelerate uses FSDP on accelerators (GPUs) only and this process has none; "
          "run the DDP variant here (without --fsdp), or this one where each process has a GPU")


def example():
    pytest.importorskip("peft")
    from tests.integrations.test_examples import load  # how the examples are loaded (they import `common`)

    return load("distributed_trainer")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="with an accelerator, --fsdp trains")
@pytest.mark.parametrize("rank, said", [("0", REASON + "\n"), ("1", "")])
def test_fsdp_without_an_accelerator_stops_every_rank_with_status_2_and_rank_0_says_why(rank, said, monkeypatch,
                                                                                           capsys):
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as stopped:
        example().main(2, fsdp=True)
    assert stopped.value.code == 2
    assert capsys.readouterr() == ("", said)
