"""DP-SGD under tensor parallelism (``parallelize_module``, ColwiseParallel / RowwiseParallel), 2 processes (gloo).

Every rank runs the same Poisson batch with its slice of the split weights: the partial per-sample
norms are added up over the ranks before clipping, each rank keeps its slice of the clipped sum and
of the one noise stream, so the run ends where one process ends.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dptorch import PrivacyEngine
from dptorch.data import DPDataLoader
from dptorch.distributed import ShardedNoise
from dptorch.grad_sample import GradSampleHooks
from dptorch.noise import SecureNoiseGenerator
from dptorch.optim import DPOptimizer
from tests.distributed import workers

WORLD = 2
WIDE_IN, WIDE_MID, WIDE_OUT = 60, 40, 50  # noise-only model: enough elements for a std check


def tp_model() -> nn.Module:
    """Column-wise, then row-wise (a split pair, as in a transformer MLP), then replicated layers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


TOKENS = 4  # SequenceParallel: each rank 2 of every sample's 4 tokens


class TokenModel(nn.Module):
    """The Megatron recipe at toy scale, the residual stream split along the tokens between the split layers:
    each sample's row becomes TOKENS tokens; ``embed`` (column-wise, its output scattered over the tokens);
    a block ``h + down(tanh(up(norm1(h))))`` (``norm1`` under SequenceParallel, ``up`` column-wise gathering
    the tokens, ``down`` row-wise scattering its sums over them); ``norm2`` (SequenceParallel); ``head``
    (column-wise gathering the tokens, its output replicated); the mean over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("positions", torch.linspace(0.5, 2.0, TOKENS))
        self.embed, self.norm1, self.up, self.down = nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 6), nn.Linear(6, 4)
        self.norm2, self.head = nn.LayerNorm(4), nn.Linear(4, 2)
        with torch.no_grad():  # norms that are not the identity at the start
            for norm in (self.norm1, self.norm2):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.embed(x[:, None, :] * self.positions[None, :, None])
        h = h + self.down(torch.tanh(self.up(self.norm1(h))))
        return self.head(self.norm2(h)).mean(1)


def sequence_split(model: TokenModel, fsdp: bool = False) -> TokenModel:
    """``model`` under tensor and sequence parallelism (torch's styles), on a 1-D mesh of the world, or
    (``fsdp``) on the tp dim of a (dp, tp) mesh, FSDP2 sharding the whole model over dp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tokens, mesh = Shard(1), Split(fsdp=fsdp).mesh()
    parallelize_module(model, mesh["tp"] if fsdp else mesh, {
        "embed": ColwiseParallel(output_layouts=tokens), "norm1": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=tokens), "down": RowwiseParallel(output_layouts=tokens),
        "norm2": SequenceParallel(), "head": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate())})
    if fsdp:
        fully_shard(model, mesh=mesh["dp"])
    return model


def sequence_step(mode: str, split: bool) -> dict:
    """One noiseless DP step of ``TokenModel`` on 5 samples: the per-sample norms over the group (those of
    one process without ``split``) and the updated parameters."""
    from dptorch.distributed.tensor_parallel import complete_norms

    model = sequence_split(TokenModel()) if split else TokenModel()
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=0.5, expected_batch_size=5.0)
    x = torch.randn(5, 5, generator=torch.Generator().manual_seed(2))
    model(x).pow(2).sum().backward()
    norms = hooks.per_sample_norms()
    if split:
        norms = complete_norms(norms, hooks.tensor_parallel, hooks.tensor_parallel_whole)
    norms = {hooks.parameter_name(p): value for p, value in norms.items()}
    optimizer.step()
    hooks.cleanup()
    return {"params": workers.flat_params(model), "norms": norms, "clipped": optimizer.last_clipped_fraction}


def sequence_empty_step(split: bool) -> dict:
    """A noise-only step on an empty Poisson batch: every rank meets in every collective, and the noise is
    the one-process stream. The forward is skipped, on every rank alike (the group runs one batch): torch's
    DTensor cannot run a (0, T, H) batch through a tensor-parallel Linear (torch 2.13: an uneven unflatten)."""
    model = sequence_split(TokenModel()) if split else TokenModel()
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), hooks=hooks, noise_multiplier=workers.SIGMA,
                            max_grad_norm=workers.CLIP, expected_batch_size=4.0,
                            noise_generator=ShardedNoise(seed=workers.NOISE_SEED, chunk_size=workers.CHUNK))
    optimizer.step()
    hooks.cleanup()
    return {"params": workers.flat_params(model)}


class Gain(nn.Module):
    """A per-feature gain with no grad sampler (the torch.func fallback would replay it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.weight


def sequence_refusal(kind: str) -> str:
    """SequenceParallel where the ranks' parts of a per-sample gradient cannot be summed: on a layer with no
    grad sampler (refused when the controller attaches), or splitting a convolution's length, a dim its
    weights act on (refused in the backward pass); on every rank."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    torch.manual_seed(0)
    if kind == "no-sampler":
        model, plan, x = nn.Sequential(nn.Linear(4, 4), Gain()), {"1": SequenceParallel()}, torch.randn(3, 4, 4)
    else:
        model, plan, x = nn.Sequential(nn.Conv1d(3, 3, 1)), {"0": SequenceParallel(sequence_dim=2)}, torch.randn(3, 3, 4)
    parallelize_module(model, Split().mesh(), plan)
    try:
        hooks = GradSampleHooks(model, loss_reduction="sum")
    except ValueError as error:
        return f"attach: {error}"
    try:
        model(x).to_local().pow(2).sum().backward()
    except Exception as error:  # noqa: BLE001 - the message says which
        return f"{type(error).__name__}: {error}"
    finally:
        hooks.cleanup()
    return "accepted"


def noise_only(generator, split=None) -> dict:
    """Two noise-only steps (empty batches): every gradient is the noise / B (``split``: its tensor-parallel
    layout, None for one process)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDE_IN, WIDE_MID), nn.Linear(WIDE_MID, WIDE_OUT))
    if split is not None:
        split(model)
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), hooks=hooks, noise_multiplier=workers.SIGMA,
                            max_grad_norm=workers.CLIP, expected_batch_size=workers.BIG_BATCH, noise_generator=generator)
    draws = []
    for _ in range(2):
        model(torch.zeros(0, WIDE_IN)).sum().backward()
        optimizer.step()
        draws.append({
            "full": torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                               for p in optimizer.params]),
            "local": [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).flatten() for p in optimizer.params],
        })
        optimizer.zero_grad()
    hooks.cleanup()
    return {"draws": draws}


def different_data(rank: int) -> str:
    """Each rank feeds its own batch: refused on every rank."""
    model = Split()(tp_model())
    hooks = GradSampleHooks(model, loss_reduction="sum")
    try:
        model(torch.randn(3, 5, generator=torch.Generator().manual_seed(rank)))
    except ValueError as error:
        return str(error)
    finally:
        hooks.cleanup()
    return "accepted"


def refusal(kind: str, split=None) -> str:
    """The error make_private (or attaching) raises for a tensor-parallel set-up it cannot keep exact."""
    split = split or Split()
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    torch.manual_seed(0)
    try:
        if kind == "distributed-loader":  # sharded over the world, not over the data-parallel ranks
            model = split(tp_model())
            loader = DPDataLoader(workers.dataset(), sample_rate=workers.SAMPLE_RATE, seed=1, distributed=True)
            PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False)
        elif kind == "sequence-parallel":  # accepted: a norm's weights replicated, each rank its tokens
            model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
            parallelize_module(model, split.mesh(), {"1": SequenceParallel()})
            GradSampleHooks(model).cleanup()
        elif kind == "sequence-parallel-linear":  # a Linear's weights replicated: neither column- nor row-wise
            model = nn.Sequential(nn.Linear(4, 4))
            parallelize_module(model, split.mesh(), {"0": SequenceParallel()})
            GradSampleHooks(model).cleanup()
        elif kind == "embedding":  # scale_grad_by_freq counts ids over the whole vocabulary
            model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 2))
            parallelize_module(model, split.mesh(), {"0": RowwiseParallel(input_layouts=Replicate())})
            GradSampleHooks(model).cleanup()
        elif kind == "shuffled":
            model = split(tp_model())
            loader = torch.utils.data.DataLoader(workers.dataset(), batch_size=4, shuffle=True)
            PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, wrap_model=False,
                                         poisson_sampling=False)
        elif kind == "colwise-only":  # accepted: one split layer alone
            model = nn.Sequential(nn.Linear(4, 6))
            parallelize_module(model, split.mesh(), {"0": ColwiseParallel()})
            GradSampleHooks(model).cleanup()
    except ValueError as error:
        return str(error)
    return "accepted"


def unseen_path_refusal() -> str:
    """A penalty on a split weight in the loss (its gradient reaches the weight outside the layer's call)."""
    model = Split()(tp_model())
    hooks = GradSampleHooks(model, loss_reduction="sum")
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=1.0, expected_batch_size=3.0)
    try:
        loss = model(torch.ones(3, 5)).sum() + model[0].weight.full_tensor().pow(2).sum()
        loss.backward()
        optimizer.step()
    except Exception as error:  # noqa: BLE001 - the message says which
        return f"{type(error).__name__}: {error}"
    finally:
        hooks.cleanup()
    return "accepted"


def token_split_refusals() -> list:
    """local_part on DTensors split along the tokens (a Linear's input) and along the ids (an embedding's)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from dptorch.distributed.tensor_parallel import local_part

    mesh = Split().mesh()
    cases = [(distribute_tensor(torch.zeros(2, 4, 6), mesh, [Shard(1)]), True),  # (B, T, D) split over T
             (distribute_tensor(torch.zeros(2, 4, dtype=torch.long), mesh, [Shard(1)]), False),  # ids split over T
             (distribute_tensor(torch.zeros(2, 4, 6), mesh, [Shard(2)]), True)]  # features: accepted
    found = []
    for t, linear in cases:
        try:
            found.append(tuple(local_part(t, 0, linear).shape))
        except ValueError as error:
            found.append(str(error))
    return found


def context_parallel_refusal() -> str:
    """A forward under torch's context_parallel (each rank a slice of every sequence): refused."""
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    hooks = GradSampleHooks(model, loss_reduction="sum")
    x = torch.randn(2, 4, 4)
    try:
        with context_parallel(Split().mesh(), buffers=[x], buffer_seq_dims=[1]):
            model(x)
    except Exception as error:  # noqa: BLE001 - the message says which
        return f"{type(error).__name__}: {error}"
    finally:
        hooks.cleanup()
    return "accepted"


def secure_run(split=None) -> dict:
    """Secure sampling and secure noise under TP from a plain DataLoader (make_private builds the Poisson
    loader): rank 0's draws on every rank of a tensor-parallel group, replicas identical."""
    model = (split or Split())(tp_model())
    engine = PrivacyEngine(secure_mode=True)
    loader = torch.utils.data.DataLoader(workers.dataset(), batch_size=6)
    _hooks, optimizer, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), data_loader=loader,
        noise_multiplier=workers.SIGMA, max_grad_norm=workers.CLIP, loss_reduction="sum", wrap_model=False)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        ((model(x) - y) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"params": workers.flat_params(model), "sizes": sizes, "epsilon": engine.get_epsilon(workers.DELTA)}


LLAMA_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col", "self_attn.o_proj": "row",
              "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}


def tiny_causal_lm(arch: str = "llama"):
    """A tiny Llama or Qwen3 (which has per-head q/k norms) from a config, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32, head_dim=4)
    config, model = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    return model(config(**shape, attn_implementation="sdpa")).train()


def llama_step(mode: str, how: str = "", arch: str = "llama") -> dict:
    """One noiseless DP step on a tiny Llama: per-sample norms and the updated parameters. ``how``:
    ``"torch"``, heads and MLP split by torch's ``parallelize_module`` (the usual plan); ``"transformers"``,
    loaded with ``from_pretrained(tp_plan="auto")`` (transformers' plan: the embedding split by rows and
    the LM head by columns too); ``""``: one process."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = tiny_causal_lm(arch)
    if how == "torch":
        styles = {"col": ColwiseParallel, "row": RowwiseParallel}
        for layer in model.model.layers:
            parallelize_module(layer, Split().mesh(), {name: styles[kind]() for name, kind in LLAMA_PLAN.items()})
    elif how == "transformers":
        model = from_pretrained_split(model)
    elif how == "sequence":
        sequence_split_llama(model)
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=0.3, expected_batch_size=3.0)
    start = workers.flat_params(model)
    ids = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    nn.functional.cross_entropy(logits.reshape(-1, 50).float(), ids.reshape(-1), reduction="sum").backward()
    optimizer.step()
    hooks.cleanup()
    return {"params": workers.flat_params(model), "start": start, "clipped": optimizer.last_clipped_fraction}


def sequence_split_llama(model: nn.Module) -> nn.Module:
    """torch's Megatron-style plan with sequence parallelism (as torchtitan splits its Llama): the embedding
    split by rows, its output scattered over the tokens; every norm under SequenceParallel; attention and MLP
    gather the tokens (PrepareModuleInput), their output projections scatter their sums over them; the LM
    head gathers them. The residual stream between them is split along the tokens."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh, tokens = Split().mesh(), Shard(1)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens, use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate())})
    gathered = Replicate()
    for layer in model.model.layers:
        plan = {name: ColwiseParallel() if kind == "col" else RowwiseParallel(output_layouts=tokens, use_local_output=False)
                for name, kind in LLAMA_PLAN.items()}
        plan.update({
            "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": tokens},
                                            desired_input_kwarg_layouts={"hidden_states": gathered}),
            "mlp": PrepareModuleInput(input_layouts=(tokens,), desired_input_layouts=(gathered,))})
        parallelize_module(layer, mesh, plan)
    return model


def from_pretrained_split(model: nn.Module) -> nn.Module:
    """``model`` saved by rank 0 and loaded on every rank with transformers' ``tp_plan="auto"``."""
    import tempfile

    from transformers import DistributedConfig

    launcher_environment()

    box = [tempfile.mkdtemp(prefix="dptorch-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() == 0:
        model.save_pretrained(box[0])
    dist.barrier()
    return type(model).from_pretrained(box[0], distributed_config=DistributedConfig(tp_plan="auto"),
                                       attn_implementation="sdpa").train()


def launcher_environment() -> None:
    """What torchrun would set (transformers and Accelerate read it; the workers here are spawned)."""
    import os

    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))


def style_refusal() -> str:
    """A layer under a transformers tensor-parallel style there is no rule for (AllReduceParallel)."""
    from transformers.distributed.tensor_parallel import AllReduceParallel

    model = Split()(tp_model())
    AllReduceParallel().install_forward(model[3], Split().mesh())
    model[3]._is_hooked = True  # as transformers' apply_tensor_parallelism marks it
    try:
        GradSampleHooks(model).cleanup()
    except ValueError as error:
        return str(error)
    return "accepted"


def trainer_refusal() -> str:
    """DPTrainer on a model split by parallelize_module: refused at construction."""
    import tempfile

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from dptorch.integrations.hf import DataCollatorForPrivateCausalLanguageModeling, DPTrainer, PrivacyArguments
    from tests.integrations.tiny import cpu_training_args, lm_dataset, tiny_llama, word_tokenizer

    launcher_environment()
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    model = tiny_llama(tokenizer)
    styles = {"col": ColwiseParallel, "row": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, Split().mesh(), {name: styles[kind]() for name, kind in LLAMA_PLAN.items()})
    try:
        DPTrainer(model=model, args=cpu_training_args(tempfile.mkdtemp(), max_steps=1, ddp_backend="gloo"),
                  train_dataset=lm_dataset(tokenizer, 8), data_collator=DataCollatorForPrivateCausalLanguageModeling(tokenizer),
                  privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-3, per_sample_max_grad_norm=1.0))
    except ValueError as error:
        return str(error)
    return "accepted"


def embedding_step(mode: str, split: bool) -> dict:
    """One noiseless DP step on an embedding split by rows (torch's RowwiseParallel, ids replicated),
    then a column- and a row-wise Linear."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=7), nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    if split:
        parallelize_module(model, Split().mesh(), {"0": RowwiseParallel(input_layouts=Replicate()),
                                                   "1": ColwiseParallel(), "3": RowwiseParallel()})
    hooks = GradSampleHooks(model, loss_reduction="sum", grad_sample_mode=mode)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), hooks=hooks, noise_multiplier=0.0,
                            max_grad_norm=0.2, expected_batch_size=4.0)
    ids = torch.tensor([[1, 7, 9], [2, 2, 6], [0, 5, 7], [8, 3, 4]])  # every id, both halves of the vocabulary
    model(ids).pow(2).sum().backward()
    optimizer.step()
    hooks.cleanup()
    return {"params": workers.flat_params(model), "clipped": optimizer.last_clipped_fraction}


class Split:
    """How a scenario splits ``tp_model``: tensor parallelism alone, or with FSDP2 over the dp dim of a
    (dp, tp) mesh (``per_layer``: every Linear its own FSDP2 unit, then the root)."""

    def __init__(self, fsdp: bool = False, per_layer: bool = False, names=("0", "2")) -> None:
        self.fsdp, self.per_layer, self.names = fsdp, per_layer, names

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if not self.fsdp:
            return init_device_mesh("cpu", (dist.get_world_size(),))
        return init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))

    def model(self) -> nn.Module:
        return tp_model()

    def __call__(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.mesh()
        first, second = self.names
        parallelize_module(model, mesh["tp"] if self.fsdp else mesh, {first: ColwiseParallel(), second: RowwiseParallel()})
        if self.fsdp:
            for layer in (model[int(first)], model[int(second)]) if self.per_layer else ():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        self.data_parallel = mesh["dp"].get_group() if self.fsdp else None
        return model

    def distributed(self):
        """The loader's ``distributed=``: the dp group under FSDP2, not sharded under TP alone."""
        return self.data_parallel if self.fsdp else False


def scenarios(rank: int):
    for mode in ("hooks", "bk", "ghost"):
        yield f"tp-{mode}", lambda mode=mode: workers.train(Split()(tp_model()), mode, distributed=False, physical=3)
    torch.manual_seed(100 + rank)  # the ranks' own generators differ: the stream must still be rank 0's
    yield "tp-noise", lambda: noise_only(ShardedNoise(seed=workers.NOISE_SEED + rank, chunk_size=workers.CHUNK),
                                         Split(names=("0", "1")))
    yield "tp-noise-secure", lambda: noise_only(SecureNoiseGenerator(), Split(names=("0", "1")))
    yield "tp-secure", secure_run
    for mode in ("hooks", "bk"):
        yield f"tp-llama-{mode}", lambda mode=mode: llama_step(mode, "torch")
        yield f"tp-hf-llama-{mode}", lambda mode=mode: llama_step(mode, "transformers")
        yield f"tp-embedding-{mode}", lambda mode=mode: embedding_step(mode, True)
    for mode in ("hooks", "bk", "ghost"):
        yield f"sp-llama-{mode}", lambda mode=mode: llama_step(mode, "sequence")
    for mode in ("hooks", "bk"):  # Qwen3's per-head q/k norms: replicated, each rank part of their gradient
        yield f"tp-hf-qwen3-{mode}", lambda mode=mode: llama_step(mode, "transformers", arch="qwen3")
    yield "tp-style-refused", style_refusal
    yield "tp-trainer-refused", trainer_refusal
    yield "tp-different-data", lambda: different_data(rank)
    yield "cp-refused", context_parallel_refusal
    yield "tp-token-split", token_split_refusals
    yield "tp-unseen-refused", unseen_path_refusal
    yield "tp-resume", lambda: workers.sharded_resume(tensor_parallel=Split())
    for mode in ("hooks", "bk", "ghost"):
        yield f"sp-{mode}", lambda mode=mode: workers.train(sequence_split(TokenModel()), mode, distributed=False,
                                                            physical=3)
        yield f"sp-step-{mode}", lambda mode=mode: sequence_step(mode, True)
    yield "sp-empty", lambda: sequence_empty_step(True)
    for kind in ("no-sampler", "conv"):
        yield f"sp-refused-{kind}", lambda kind=kind: sequence_refusal(kind)
    for kind in ("distributed-loader", "sequence-parallel", "sequence-parallel-linear", "embedding", "shuffled",
                 "colwise-only"):
        yield f"tp-refused-{kind}", lambda kind=kind: refusal(kind)


def fsdp_train(mode: str, per_layer: bool) -> dict:
    split = Split(fsdp=True, per_layer=per_layer)
    model = split(tp_model())
    return workers.train(model, mode, distributed=split.distributed(), physical=3)


def separate_meshes_refusal() -> str:
    """Tensor parallelism alone on some layers, FSDP2 on another: refused."""
    from torch.distributed.fsdp import fully_shard

    model = Split()(tp_model())
    fully_shard(model[4])
    try:
        GradSampleHooks(model).cleanup()
    except ValueError as error:
        return str(error)
    return "accepted"


def fsdp_scenarios(rank: int):
    yield "tpfsdp-whole-bk", lambda: fsdp_train("bk", per_layer=False)
    yield "tpfsdp-per-layer-hooks", lambda: fsdp_train("hooks", per_layer=True)
    yield "tpfsdp-per-layer-ghost", lambda: fsdp_train("ghost", per_layer=True)
    for mode in ("hooks", "bk"):
        yield f"tpfsdp-sp-{mode}", lambda mode=mode: workers.train(
            sequence_split(TokenModel(), fsdp=True), mode, distributed=Split(fsdp=True).mesh()["dp"].get_group(), physical=3)
    torch.manual_seed(100 + rank)
    yield "tpfsdp-noise", lambda: noise_only(ShardedNoise(seed=workers.NOISE_SEED + rank, chunk_size=workers.CHUNK),
                                             Split(fsdp=True, per_layer=True, names=("0", "1")))
    yield "tpfsdp-noise-secure", lambda: noise_only(SecureNoiseGenerator(), Split(fsdp=True, names=("0", "1")))
    yield "tpfsdp-secure", lambda: secure_run(Split(fsdp=True))
    yield "tpfsdp-resume", lambda: workers.sharded_resume(tensor_parallel=Split(fsdp=True, per_layer=True))
    yield "tpfsdp-refused-distributed-loader", lambda: refusal("distributed-loader", Split(fsdp=True))
    yield "tp-and-fsdp-apart-refused", separate_meshes_refusal


@pytest.fixture(scope="module")
def tp_fsdp():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return workers.reader(workers.spawn_all(fsdp_scenarios, world=2 * WORLD))


@pytest.fixture(scope="module")
def tp():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return workers.reader(workers.spawn_all(scenarios, world=WORLD))


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_tensor_parallel_run_ends_where_one_process_ends(tp, mode):
    """Same Poisson batches, same noise stream: both ranks end with the one-process parameters."""
    runs = [tp(f"tp-{mode}", rank) for rank in range(WORLD)]
    torch.testing.assert_close(runs[1]["params"], runs[0]["params"], rtol=0, atol=0)
    reference = workers.train(tp_model(), mode, distributed=False, physical=3)
    torch.testing.assert_close(runs[0]["params"], reference["params"], rtol=1e-5, atol=1e-6)
    start = workers.flat_params(tp_model())
    assert (reference["params"] - start).abs().max() > 1e-2  # the runs moved: the comparison means something
    for run in runs:
        assert run["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
        assert run["steps"] == reference["steps"] and run["rows_per_step"] == reference["rows_per_step"]


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("how", ["torch", "hf"])
def test_a_tensor_parallel_llama_step_is_the_one_process_step(tp, mode, how):
    """Attention heads and MLP split over the ranks (torch's plan), or transformers' whole plan (embedding
    split by rows, LM head by columns, its output gathered): the clipped update equals the unsplit model's."""
    reference = llama_step(mode)  # here, without a process group
    assert reference["clipped"] == 1.0  # every sample clipped: the norms matter
    assert (reference["params"] - reference["start"]).abs().max() > 1e-3  # the step moved the weights
    for rank in range(WORLD):
        run = tp(f"tp-{'llama' if how == 'torch' else 'hf-llama'}-{mode}", rank)
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)
        assert run["clipped"] == reference["clipped"]


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_a_row_split_embedding_step_is_the_one_process_step(tp, mode):
    reference = embedding_step(mode, False)
    assert reference["clipped"] == 1.0
    for rank in range(WORLD):
        run = tp(f"tp-embedding-{mode}", rank)
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)


def test_the_private_trainer_refuses_a_tensor_parallel_model(tp):
    for rank in range(WORLD):
        assert "a tensor-parallel model (from_pretrained(tp_plan=...), parallelize_module) is not supported in the " \
               "private Trainer yet" in tp("tp-trainer-refused", rank)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_qwen3_under_transformers_plan_is_the_one_process_step(tp, mode):
    """Its q/k norms (replicated_with_grad_allreduce) see only this rank's heads: the ranks' parts of each
    sample's gradient are summed before any norm (one rank's part alone was a silently wrong gradient)."""
    reference = llama_step(mode, arch="qwen3")
    assert reference["clipped"] == 1.0
    for rank in range(WORLD):
        torch.testing.assert_close(tp(f"tp-hf-qwen3-{mode}", rank)["params"], reference["params"], rtol=1e-5, atol=1e-6)


def test_transformers_styles_without_a_rule_are_refused(tp):
    for rank in range(WORLD):
        message = tp("tp-style-refused", rank)
        assert "3 (LayerNorm) runs under transformers' tensor-parallel style AllReduceParallel" in message


def test_tensor_parallel_noise_is_the_one_process_stream_drawn_once_per_element(tp):
    runs = [tp("tp-noise", rank)["draws"] for rank in range(WORLD)]
    reference = noise_only(ShardedNoise(seed=workers.NOISE_SEED, chunk_size=workers.CHUNK))["draws"]
    for step, expected in enumerate(reference):
        for run in runs:  # split and replicated parameters alike: rank 0's stream, the same as one process
            torch.testing.assert_close(run[step]["full"], expected["full"], rtol=0, atol=0)
        # the split weights' slices differ between the ranks (each its own part of the stream)
        assert not torch.equal(runs[0][step]["local"][0], runs[1][step]["local"][0])


def test_secure_tensor_parallel_noise_one_draw_per_element_with_the_right_std(tp):
    runs = [tp("tp-noise-secure", rank)["draws"] for rank in range(WORLD)]
    std = workers.SIGMA * workers.CLIP / workers.BIG_BATCH
    for step in range(2):
        full = [run[step]["full"] for run in runs]
        torch.testing.assert_close(full[0], full[1], rtol=0, atol=0)  # one gradient on every rank
        values = full[0].double()
        assert values.numel() > 3000
        assert values.std().item() == pytest.approx(std, rel=0.06)  # 6%: over 5 standard errors at 4490 draws
        split = [run[step]["local"][0] for run in runs]  # the column-wise weight: each rank its own draws
        assert not torch.equal(split[0], split[1])
    assert not torch.equal(runs[0][0]["full"], runs[0][1]["full"])  # fresh draws every step


def test_secure_sampling_draws_one_batch_for_the_group(tp):
    runs = [tp("tp-secure", rank) for rank in range(WORLD)]
    assert runs[0]["sizes"] == runs[1]["sizes"] and sum(runs[0]["sizes"]) > 0
    torch.testing.assert_close(runs[0]["params"], runs[1]["params"], rtol=0, atol=0)
    assert runs[0]["epsilon"] == runs[1]["epsilon"]


def test_an_engine_checkpoint_of_a_tensor_parallel_run_resumes_exactly(tp):
    for rank in range(WORLD):
        run = tp("tp-resume", rank)
        torch.testing.assert_close(run["resumed"]["params"], run["first"]["params"], rtol=0, atol=0)
        assert run["resumed"]["epsilon"] == run["first"]["epsilon"] and run["first"]["steps"] > 0
        assert run["resumed"]["steps"] == run["first"]["steps"]
        assert "clipped gradients are held for the next step" in run["mid_step"]


def test_ranks_running_different_data_are_refused_on_every_rank(tp):
    for rank in range(WORLD):
        assert "ran forwards on different inputs" in tp("tp-different-data", rank)


@pytest.mark.parametrize("kind, words", [
    ("distributed-loader", "every rank of a tensor-parallel group trains on the same batch"),
    ("sequence-parallel-linear", "are neither ColwiseParallel's (Shard(0), Shard(0)) nor RowwiseParallel's"),
    ("embedding", "has no rule for its slices"),
    ("shuffled", "tensor parallelism is supported with Poisson sampling"),
])
def test_tensor_parallel_set_ups_it_cannot_keep_exact_are_refused(tp, kind, words):
    for rank in range(WORLD):
        assert words in tp(f"tp-refused-{kind}", rank)


def test_a_gradient_by_a_path_the_controller_does_not_see_is_refused_on_every_rank(tp):
    for rank in range(WORLD):
        message = tp("tp-unseen-refused", rank)
        assert message.startswith("PerSampleGradientError") and "0.weight" in message, message


def test_a_split_layers_input_split_along_the_tokens_is_refused(tp):
    for rank in range(WORLD):
        tokens, ids, features = tp("tp-token-split", rank)
        assert "only a replicated one, or a Linear's split of its last dim" in tokens
        assert "only a replicated one" in ids  # an embedding's ids split along the tokens, its last dim
        assert features == (2, 4, 3)


def test_context_parallelism_is_refused_on_every_rank(tp):
    for rank in range(WORLD):
        message = tp("cp-refused", rank)
        assert message.startswith("PerSampleGradientError: context parallelism"), message


def test_one_split_layer_alone_is_accepted(tp):
    for rank in range(WORLD):
        assert tp("tp-refused-colwise-only", rank) == "accepted"
        assert tp("tp-refused-sequence-parallel", rank) == "accepted"


# ------------------------------------------------------------------ SequenceParallel: the tokens split between the split layers


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_a_sequence_parallel_run_ends_where_one_process_ends(tp, mode):
    """Norms under SequenceParallel (each rank part of every sample's tokens, so part of its norm weights'
    gradient), the residual stream split along the tokens, row-wise outputs scattered over them: a whole
    epoch of Poisson batches (empty ones too) with noise ends on both ranks where one process ends."""
    runs = [tp(f"sp-{mode}", rank) for rank in range(WORLD)]
    torch.testing.assert_close(runs[1]["params"], runs[0]["params"], rtol=0, atol=0)
    reference = workers.train(TokenModel(), mode, distributed=False, physical=3)
    torch.testing.assert_close(runs[0]["params"], reference["params"], rtol=1e-5, atol=1e-6)
    assert (reference["params"] - workers.flat_params(TokenModel())).abs().max() > 1e-2
    for run in runs:
        assert run["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
        assert run["steps"] == reference["steps"] and run["rows_per_step"] == reference["rows_per_step"]


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_a_sequence_parallel_llama_step_is_the_one_process_step(tp, mode):
    """A tiny Llama under torch's plan with SequenceParallel on all its RMSNorms (the residual stream split
    along the tokens, 7 of them: an uneven split): the clipped update equals the unsplit model's."""
    reference = llama_step(mode)
    assert reference["clipped"] == 1.0
    for rank in range(WORLD):
        run = tp(f"sp-llama-{mode}", rank)
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)
        assert run["clipped"] == reference["clipped"]


def alone_norms(model: nn.Module, x: torch.Tensor) -> dict:
    """Each sample's gradient norm per parameter, from autograd on that sample alone."""
    norms = {name: [] for name, _ in model.named_parameters()}
    for row in x:
        model.zero_grad()
        model(row[None]).pow(2).sum().backward()
        for name, p in model.named_parameters():
            norms[name].append(p.grad.norm())
    return {name: torch.stack(values) for name, values in norms.items()}


@pytest.mark.parametrize("mode", ["hooks", "bk", "ghost"])
def test_sequence_parallel_per_sample_norms_are_each_samples_alone(tp, mode):
    """Every parameter's per-sample norm over the group (the norms' partial gradients summed over the ranks
    first) is the norm of that sample's gradient alone; the clipped step is the one-process step."""
    expected = alone_norms(TokenModel(), torch.randn(5, 5, generator=torch.Generator().manual_seed(2)))
    reference = sequence_step(mode, False)
    assert reference["clipped"] == 1.0  # every sample clipped: the norms matter
    for rank in range(WORLD):
        run = tp(f"sp-step-{mode}", rank)
        assert set(run["norms"]) == set(expected)
        for name, norms in expected.items():
            torch.testing.assert_close(run["norms"][name], norms, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)


def test_an_empty_sequence_parallel_batch_takes_the_one_process_noise(tp):
    reference = sequence_empty_step(False)
    assert (reference["params"] - workers.flat_params(TokenModel())).abs().max() > 1e-3  # the noise moved them
    for rank in range(WORLD):
        torch.testing.assert_close(tp("sp-empty", rank)["params"], reference["params"], rtol=1e-6, atol=1e-7)


def test_sequence_parallel_it_cannot_sum_is_refused_on_every_rank(tp):
    for rank in range(WORLD):
        message = tp("sp-refused-no-sampler", rank)
        assert message.startswith("attach: 1 (Gain) has weights replicated over the tensor-parallel group"), message
        message = tp("sp-refused-conv", rank)
        assert message.startswith("PerSampleGradientError: 0 (Conv1d)"), message
        assert "only a replicated one, or one split along the tokens" in message, message


# ------------------------------------------------------------------ TP x FSDP2: a 2 x 2 (dp, tp) mesh


@pytest.mark.parametrize("name", ["tpfsdp-whole-bk", "tpfsdp-per-layer-hooks", "tpfsdp-per-layer-ghost"])
def test_tp_x_fsdp_run_ends_where_one_process_ends(tp_fsdp, name):
    """FSDP2 over dp, TP over tp: each dp rank its share of the Poisson batch, the same share on both
    ranks of its tensor-parallel group; all four end with the one-process parameters."""
    mode = name.rsplit("-", 1)[1]
    runs = [tp_fsdp(name, rank) for rank in range(2 * WORLD)]
    for run in runs[1:]:
        torch.testing.assert_close(run["params"], runs[0]["params"], rtol=0, atol=0)
    reference = workers.train(tp_model(), mode, distributed=False, physical=3)
    torch.testing.assert_close(runs[0]["params"], reference["params"], rtol=1e-5, atol=1e-6)
    assert runs[0]["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
    assert runs[0]["steps"] == reference["steps"]
    # ranks 0 and 1 (one tp group) share rows; 0 and 2 (dp ranks) split the logical batches between them
    assert runs[0]["rows_per_step"] == runs[1]["rows_per_step"]
    assert [a + b for a, b in zip(runs[0]["rows_per_step"], runs[2]["rows_per_step"])] == reference["rows_per_step"]


@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_tp_x_fsdp_with_sequence_parallel_ends_where_one_process_ends(tp_fsdp, mode):
    """The token-split residual model under TP (with SequenceParallel norms) on tp and FSDP2 on dp: the norms'
    partial per-sample gradients are summed over tp only, their clipped sums reduce-scattered over dp."""
    runs = [tp_fsdp(f"tpfsdp-sp-{mode}", rank) for rank in range(2 * WORLD)]
    reference = workers.train(TokenModel(), mode, distributed=False, physical=3)
    for run in runs:
        torch.testing.assert_close(run["params"], reference["params"], rtol=1e-5, atol=1e-6)
        assert run["epsilon"] == pytest.approx(reference["epsilon"], rel=1e-12)
    assert [a + b for a, b in zip(runs[0]["rows_per_step"], runs[2]["rows_per_step"])] == reference["rows_per_step"]


def test_tp_x_fsdp_noise_is_the_one_process_stream(tp_fsdp):
    runs = [tp_fsdp("tpfsdp-noise", rank)["draws"] for rank in range(2 * WORLD)]
    reference = noise_only(ShardedNoise(seed=workers.NOISE_SEED, chunk_size=workers.CHUNK))["draws"]
    for step, expected in enumerate(reference):
        for run in runs:
            torch.testing.assert_close(run[step]["full"], expected["full"], rtol=0, atol=0)
        locals_ = [run[step]["local"][0] for run in runs]  # the column-wise weight: four different pieces
        assert len({tuple(piece.tolist()) for piece in locals_}) == 2 * WORLD


def test_secure_tp_x_fsdp_noise_one_draw_per_element(tp_fsdp):
    runs = [tp_fsdp("tpfsdp-noise-secure", rank)["draws"] for rank in range(2 * WORLD)]
    std = workers.SIGMA * workers.CLIP / workers.BIG_BATCH
    for step in range(2):
        for run in runs[1:]:
            torch.testing.assert_close(run[step]["full"], runs[0][step]["full"], rtol=0, atol=0)
        assert runs[0][step]["full"].double().std().item() == pytest.approx(std, rel=0.06)
        locals_ = [run[step]["local"][0] for run in runs]
        assert len({tuple(piece.tolist()) for piece in locals_}) == 2 * WORLD  # no element drawn twice


def test_secure_sampling_under_tp_x_fsdp(tp_fsdp):
    runs = [tp_fsdp("tpfsdp-secure", rank) for rank in range(2 * WORLD)]
    assert runs[0]["sizes"] == runs[1]["sizes"] and runs[2]["sizes"] == runs[3]["sizes"]  # one draw per tp group
    for run in runs[1:]:
        torch.testing.assert_close(run["params"], runs[0]["params"], rtol=0, atol=0)


def test_a_tp_x_fsdp_checkpoint_resumes_exactly(tp_fsdp):
    for rank in range(2 * WORLD):
        run = tp_fsdp("tpfsdp-resume", rank)
        torch.testing.assert_close(run["resumed"]["params"], run["first"]["params"], rtol=0, atol=0)
        assert run["resumed"]["epsilon"] == run["first"]["epsilon"] and run["first"]["steps"] > 0


def test_tp_x_fsdp_refusals(tp_fsdp):
    for rank in range(2 * WORLD):
        message = tp_fsdp("tpfsdp-refused-distributed-loader", rank)
        assert "rank of a tensor-parallel group trains on the same batch" in message
        assert "of 4 shards" in message and "of 2 here" in message
        assert "in a model FSDP2 shards too" in tp_fsdp("tp-and-fsdp-apart-refused", rank)


def test_a_style_installed_as_a_forward_pre_hook_is_recognised():
    """transformers 5.25 hooks ``ReplicatedWithGradAllReduce`` (Qwen3's q/k norms) with a forward pre-hook made by
    its ``install_forward``, where 5.24 replaced ``forward``: the style is found either way (the Qwen3 plan test
    above ran under both versions); a pre-hook of anyone else's is no style."""
    from dptorch.distributed.tensor_parallel import transformers_style

    def tp_forward_pre_hook(module, args):
        return None

    norm = nn.LayerNorm(4)
    norm._is_hooked = True
    norm.register_forward_pre_hook(lambda module, args: None)
    assert transformers_style(norm) == "an unknown style"
    tp_forward_pre_hook.__module__ = "transformers.distributed.tensor_parallel"
    tp_forward_pre_hook.__qualname__ = "ReplicatedWithGradAllReduce.install_forward.<locals>.tp_forward_pre_hook"
    norm.register_forward_pre_hook(tp_forward_pre_hook)
    assert transformers_style(norm) == "ReplicatedWithGradAllReduce"
    assert transformers_style(nn.LayerNorm(4)) is None
