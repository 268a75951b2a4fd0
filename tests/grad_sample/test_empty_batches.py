"""An empty (Poisson) batch is a result, not a crash: for every layer with a grad or norm sampler,
in every mode, 0 rows give per-sample norms of shape (0,), a zero clipped sum, and a noiseless step
that changes nothing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dptorch import PrivacyEngine
from dptorch.grad_sample import GradSampleHooks, UnsupportedModuleError, registry
from dptorch.grad_sample.layers.chunked_lm_head import ChunkedLMHead
from dptorch.grad_sample.modes.names import GRAD_SAMPLE_MODES
from dptorch.grad_sample.layers.embedding import RenormedEmbedding, RenormedEmbeddingBag
from dptorch.layers import DPGRU, DPLSTM, DPMultiheadAttention, DPRNN
from dptorch.layers.attention import AppendedVector
from dptorch.layers.sequence_bias import SequenceBias
from dptorch.layers.rnn import RecurrentSweep
from dptorch.optim import DPOptimizer
from tests.helpers import projection_loss


def renormed(cls, *args, **kwargs):
    module = cls(*args, **kwargs)
    module.renorm_max_norm = 1.0
    return module


class Attention(nn.Module):
    """A ``DPMultiheadAttention`` self-attention call (its ``AppendedVector`` holds bias_k / bias_v)."""

    def __init__(self):
        super().__init__()
        self.inner = DPMultiheadAttention(8, 2, add_bias_kv=True, batch_first=True)

    def forward(self, x):
        return self.inner(x, x, x)[0]


def hf_conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D(5, 4)


def hf_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(6)


def tokens(n, d):
    return lambda rows: (torch.randn(rows, 3, d),)


def ids(vocab):
    return lambda rows: (torch.randint(0, vocab, (rows, 3)),)


def channels(c, *spatial):
    return lambda rows: (torch.randn(rows, c, *spatial),)


class HeadLosses(nn.Module):
    """A chunked LM head's per-row losses, as a column (one output entry per row)."""

    def __init__(self):
        super().__init__()
        self.head = ChunkedLMHead(nn.Parameter(torch.randn(11, 4)), block_elements=8)

    def forward(self, hidden, targets):
        return self.head(hidden, targets)[:, None]


#: One model per registered layer type (or duck rule), and its inputs for ``rows`` rows.
LAYERS = {
    nn.Linear: (lambda: nn.Linear(4, 5), tokens(3, 4)),
    nn.Conv1d: (lambda: nn.Conv1d(2, 3, 2), channels(2, 5)),
    nn.Conv2d: (lambda: nn.Conv2d(2, 3, 2, groups=1), channels(2, 4, 4)),
    nn.Conv3d: (lambda: nn.Conv3d(2, 2, 2), channels(2, 3, 3, 3)),
    nn.Embedding: (lambda: nn.Embedding(7, 4, padding_idx=0), ids(7)),
    RenormedEmbedding: (lambda: renormed(RenormedEmbedding, 7, 4), ids(7)),
    nn.EmbeddingBag: (lambda: nn.EmbeddingBag(7, 4, mode="mean"), ids(7)),
    RenormedEmbeddingBag: (lambda: renormed(RenormedEmbeddingBag, 7, 4, mode="sum"), ids(7)),
    nn.LayerNorm: (lambda: nn.LayerNorm(6), tokens(3, 6)),
    nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), channels(4, 5)),
    nn.InstanceNorm1d: (lambda: nn.InstanceNorm1d(3, affine=True), channels(3, 5)),
    nn.InstanceNorm2d: (lambda: nn.InstanceNorm2d(3, affine=True), channels(3, 4, 4)),
    nn.InstanceNorm3d: (lambda: nn.InstanceNorm3d(3, affine=True), channels(3, 3, 3, 3)),
    RecurrentSweep: (lambda: DPLSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True), tokens(3, 4)),
    AppendedVector: (Attention, tokens(3, 8)),
    SequenceBias: (lambda: SequenceBias(4, batch_first=True), tokens(3, 4)),
    "hf_conv1d": (hf_conv1d, tokens(3, 4)),
    "hf_rms_norm": (hf_rms_norm, tokens(3, 6)),
    "dpgru": (lambda: DPGRU(4, 3, batch_first=True), tokens(3, 4)),
    "dprnn": (lambda: DPRNN(4, 3, batch_first=True), tokens(3, 4)),
    ChunkedLMHead: (lambda: HeadLosses(), lambda rows: (torch.randn(rows, 3, 4), torch.randint(0, 11, (rows, 3)))),
}
if hasattr(nn, "RMSNorm"):
    LAYERS[nn.RMSNorm] = (lambda: nn.RMSNorm(6), tokens(3, 6))


def test_every_registered_layer_is_covered():
    registered = {t for t in set(registry._GRAD_SAMPLERS) | set(registry._NORM_SAMPLERS)
                  if t.__module__.startswith(("torch.", "dptorch.", "transformers."))}  # not other tests' own layers
    assert registered <= set(LAYERS), registered - set(LAYERS)
    # hf_conv1d, hf_rms_norm, the expert banks (grad and norm rules)
    assert len(registry._DUCK_RULES) == 3 and len(registry._NORM_DUCK_RULES) == 2


def empty_step(model, inputs, mode):
    """Per-sample norms, the clipped sum for no factors, and the parameters after a noiseless step."""
    try:
        hooks = GradSampleHooks(model, grad_sample_mode=mode, loss_reduction="sum")
    except UnsupportedModuleError:
        assert mode == "ew"  # expanded weights refuse some layers at attach, whatever the batch
        pytest.skip("refused by expanded weights at attach time")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = DPOptimizer(torch.optim.SGD(params, lr=1.0), hooks=hooks, noise_multiplier=0.0, max_grad_norm=1.0,
                            expected_batch_size=4, loss_reduction="sum")
    seen = {}

    def listen(h):
        seen["norms"] = {p: n.clone() for p, n in h.per_sample_norms().items()}
        seen["sums"] = h.clipped_sums({p: torch.zeros(0) for p in params})
        seen["batch"] = h.batch_size

    hooks.add_backward_listener(listen)
    try:
        projection_loss(model(*inputs)).sum().backward()
        optimizer.step()
    finally:
        hooks.cleanup()
    return seen


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("layer", list(LAYERS), ids=lambda k: k if isinstance(k, str) else k.__name__)
def test_an_empty_batch_is_a_zero_step(layer, mode):
    build, make_inputs = LAYERS[layer]
    torch.manual_seed(0)
    model = build()
    inputs = make_inputs(0)
    plain = copy.deepcopy(model)  # the state a forward alone leaves (Renormed* renormalise every row)
    try:
        with torch.no_grad():
            plain(*inputs)
    except (IndexError, RuntimeError) as error:  # torch's InstanceNorm cannot run on 0 rows
        pytest.skip(f"torch's own forward fails on 0 rows: {error}")
    before = plain.state_dict()
    params = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = empty_step(model, inputs, mode)
    assert seen["batch"] == 0
    assert set(seen["norms"]) == set(params)
    for norm in seen["norms"].values():
        assert norm.shape == (0,)
    assert set(seen["sums"]) == set(params)
    for p, summed in seen["sums"].items():
        assert summed.shape == p.shape and not summed.any()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_an_empty_poisson_batch_with_an_embedding_through_make_private():
    """Opacus' char-LSTM case: the default mode (bk) with an embedding, a Poisson draw of 0 rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Flatten(), nn.Linear(12, 2))
    data = TensorDataset(torch.randint(0, 11, (20, 3)), torch.randint(0, 2, (20,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=1), noise_multiplier=0.0,
            max_grad_norm=1.0,
        )
    empty = 0
    for x, y in loader:
        before = copy.deepcopy(model.state_dict())
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if x.shape[0] == 0:
            empty += 1
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert empty > 0  # at q = 1/20 an epoch of 20 draws has empty ones (seeded)
