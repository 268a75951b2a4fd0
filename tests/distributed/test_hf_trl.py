"""``private(trl.SFTTrainer)`` and ``private(trl.DPOTrainer)`` on 2 processes, DDP and FSDP2 (runs of ``hf_script.py``).

Micro-batches differ in size across the ranks and some are empty on one rank or on both (phantoms).
DPO's ``compute_loss`` gathers its metrics over the ranks on every micro-batch: with Accelerate's
gathers, ranks holding different row counts abort (gloo) or hang (NCCL); the private trainer's
gathers take any row count, and a phantom sends none.
"""

import math

import pytest

from tests.distributed.test_hf_ddp import assert_close_params

pytest.importorskip("trl")


@pytest.fixture(params=["ddp", "fsdp"])
def runs(request):
    return request.getfixturevalue(f"hf_{request.param}")[0]


def test_sft_and_dpo_train_with_phantoms_and_agree_across_ranks(runs):
    first, second = runs
    for name in ("sft", "dpo"):
        assert first[name]["params"] == second[name]["params"]
        assert first[name]["steps"] == 4 and first[name]["epsilon"] == second[name]["epsilon"] > 0
        for report in runs:
            assert report[name]["phantoms"] == report[name]["seen"].count([]) > 0
    sizes = [[len(batch) for batch in r["dpo"]["seen"]] for r in runs]
    assert any(a and b and a != b for a, b in zip(*sizes))  # different (non-zero) sizes in one micro-batch
    assert any(not a and not b for a, b in zip(*sizes))  # a micro-batch empty on both ranks
    assert all(n % 4 == 0 for n in sizes[0] + sizes[1])  # DPO by user: 2 examples, each a chosen and a rejected row


def test_fsdp2_ends_where_ddp_ends(hf_ddp, hf_fsdp):
    for name in ("sft", "dpo"):
        ddp, fsdp = hf_ddp[0][0][name], hf_fsdp[0][0][name]
        assert fsdp["sharded"] and all(fsdp["sharded"])
        assert_close_params(fsdp["params"], ddp["params"], rtol=1e-5, atol=1e-6)
        assert fsdp["epsilon"] == ddp["epsilon"]


def test_dpo_metrics_are_those_of_the_real_rows_on_every_rank(runs):
    first, second = runs
    logs = [[{k: v for k, v in h.items() if k not in ("train_runtime",)} for h in r["dpo"]["logs"]] for r in runs]
    assert logs[0] == logs[1] and len(logs[0]) == 4  # the same gathered values everywhere, phantom ranks included
    assert all(math.isfinite(v) for h in logs[0] for v in h.values() if isinstance(v, float))
    # TRL's token count: the attention masks of the real micro-batches of both ranks, no phantom token
    assert logs[0][-1]["num_tokens"] == sum(len(row) for r in runs for batch in r["dpo"]["seen"] for row in batch)
