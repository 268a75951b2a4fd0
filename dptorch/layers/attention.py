"""DPMultiheadAttention: a drop-in ``nn.MultiheadAttention`` with exact per-sample gradients.

The four projections are ``nn.Linear`` modules (the Linear sampler handles them) applied to
batch-first tensors, whatever the layer's own ``batch_first``: time-major inputs are transposed
first, so the projections see the batch along dim 0. The controller follows the batch through
that transposition (its batch tracking gives each call its own batch dim), so the layer is exact
inside a time-major model (controller ``batch_first=False``) as inside a batch-first one.
``bias_k``/``bias_v`` live in two ``AppendedVector`` modules with their own sampler. An ``nn.MultiheadAttention`` state_dict
(``in_proj_weight``/``in_proj_bias`` or ``q_proj_weight``..., ``bias_k``, ``bias_v``,
``out_proj.*``) loads directly, and the layer's own state_dict is in torch's layout too (so an
``nn.MultiheadAttention`` loads it, as Opacus' layer allows); its own module names still load.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptorch.grad_sample.layers.registry import register_grad_sampler


class AppendedVector(nn.Module):
    """Appends a learned vector as one more position of every sequence: ``(N, S, E) -> (N, S + 1, E)``."""

    def __init__(self, dim: int, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, 1, dim, device=device, dtype=dtype))
        nn.init.xavier_normal_(self.weight)

    def forward(self, sequence: Tensor) -> Tensor:
        return torch.cat([sequence, self.weight.expand(sequence.shape[0], 1, -1)], dim=1)


@register_grad_sampler(AppendedVector)
def appended_vector_grad_sampler(
    module: AppendedVector, activations: Tuple[Tensor, ...], backprops: Tensor
) -> Dict[nn.Parameter, Tensor]:
    """Each sample's gradient is its backprop at the appended (last) position."""
    if not module.weight.requires_grad:
        return {}
    return {module.weight: backprops[:, None, -1:, :].to(module.weight.dtype)}


def additive_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True = do not attend) as ``0``/``-inf``; a float mask unchanged."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def merged_attention_mask(
    attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], batch: int, heads: int, dtype: torch.dtype
) -> Optional[Tensor]:
    """``attn_mask`` (``(L, S)`` or ``(N * heads, L, S)``) plus ``key_padding_mask`` (``(N, S)``), as
    one additive mask broadcastable to ``(N, heads, L, S)``."""
    attn_mask = additive_mask(attn_mask, dtype)
    key_padding_mask = additive_mask(key_padding_mask, dtype)
    if attn_mask is not None:
        attn_mask = attn_mask.view(batch, heads, *attn_mask.shape[-2:]) if attn_mask.dim() == 3 else attn_mask
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.view(batch, 1, 1, -1)
        return key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    return attn_mask


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, need_weights: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention over ``(N, heads, L or S, head_dim)`` tensors; the weights (after dropout, as torch
    returns them) only if ``need_weights``, else torch's fused kernel."""
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p), None
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    return weights @ v, weights


class DPMultiheadAttention(nn.Module):
    """Drop-in ``nn.MultiheadAttention`` built from ``nn.Linear`` projections.

    Same constructor and ``forward`` as torch's, returning ``(attn_output, attn_weights or None)``.
    ``is_causal=True`` without ``attn_mask`` applies a causal mask (torch raises instead).
    ``in_proj_weight``/``in_proj_bias`` exist for torch's inference fast path (TransformerEncoder in
    eval mode): they are concatenations computed on access, so write to ``q_proj``/``k_proj``/``v_proj``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise ValueError("embed_dim must be divisible by num_heads")
        factory = dict(device=device, dtype=dtype)
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self._qkv_same_embed_dim = self.kdim == self.vdim == embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **factory)
        self.key_bias = AppendedVector(embed_dim, **factory) if add_bias_kv else None
        self.value_bias = AppendedVector(embed_dim, **factory) if add_bias_kv else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_load_torch_layout)
        self.register_state_dict_post_hook(_save_torch_layout)

    def reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform input projections (over the fused ``(3E, E)``
        matrix when ``kdim == vdim == embed_dim``), zero biases, Xavier-normal ``bias_k``/``bias_v``."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self._qkv_same_embed_dim:
            fused = torch.empty(3 * self.embed_dim, self.embed_dim)
            nn.init.xavier_uniform_(fused)
            with torch.no_grad():
                for proj, part in zip(projections, fused.chunk(3)):
                    proj.weight.copy_(part)
        else:
            for proj in projections:
                nn.init.xavier_uniform_(proj.weight)
        for proj in (*projections, self.out_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        for appended in (self.key_bias, self.value_bias):
            if appended is not None:
                nn.init.xavier_normal_(appended.weight)

    @property
    def in_proj_weight(self) -> Optional[Tensor]:
        """torch's fused ``(3E, E)`` input projection (None when ``kdim``/``vdim`` differ, as in torch)."""
        if not self._qkv_same_embed_dim:
            return None
        return torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])

    @property
    def in_proj_bias(self) -> Optional[Tensor]:
        if self.q_proj.bias is None:
            return None
        return torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])

    @property
    def bias_k(self) -> Optional[nn.Parameter]:
        return None if self.key_bias is None else self.key_bias.weight

    @property
    def bias_v(self) -> Optional[nn.Parameter]:
        return None if self.value_bias is None else self.value_bias.weight

    @property
    def q_proj_weight(self) -> nn.Parameter:
        return self.q_proj.weight

    @property
    def k_proj_weight(self) -> nn.Parameter:
        return self.k_proj.weight

    @property
    def v_proj_weight(self) -> nn.Parameter:
        return self.v_proj.weight

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        batch, tgt_len, src_len = query.shape[0], query.shape[1], key.shape[1]
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(tgt_len, src_len, dtype=torch.bool, device=query.device).triu(1)

        q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        mask = merged_attention_mask(attn_mask, key_padding_mask, batch, self.num_heads, q.dtype)
        if self.key_bias is not None and self.value_bias is not None:
            k, v = self.key_bias(k), self.value_bias(v)
            mask = None if mask is None else F.pad(mask, (0, 1))
        q, k, v = (self._split_heads(t) for t in (q, k, v))
        if self.add_zero_attn:
            zeros = k.new_zeros(*k.shape[:2], 1, self.head_dim)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            mask = None if mask is None else F.pad(mask, (0, 1))

        dropout_p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, need_weights)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim))
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None:
            weights = weights.mean(dim=1) if average_attn_weights else weights
            weights = weights if batched else weights.squeeze(0)
        return out, weights

    # torch's own mask merging, for its TransformerEncoderLayer fast path (uses only num_heads).
    merge_masks = nn.MultiheadAttention.merge_masks

    def _split_heads(self, t: Tensor) -> Tensor:
        """``(N, S, E) -> (N, heads, S, head_dim)``."""
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, batch_first={self.batch_first}"


_TORCH_RENAMES = {
    "q_proj_weight": "q_proj.weight",
    "k_proj_weight": "k_proj.weight",
    "v_proj_weight": "v_proj.weight",
    "bias_k": "key_bias.weight",
    "bias_v": "value_bias.weight",
}


def _load_torch_layout(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: split torch's fused ``in_proj_*`` and rename its other keys."""
    for fused, part in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        if prefix + fused in state_dict:
            chunks = state_dict.pop(prefix + fused).chunk(3)
            for name, chunk in zip(("q_proj", "k_proj", "v_proj"), chunks):
                state_dict[f"{prefix}{name}.{part}"] = chunk
    for torch_name, own_name in _TORCH_RENAMES.items():
        if prefix + torch_name in state_dict:
            state_dict[prefix + own_name] = state_dict.pop(prefix + torch_name)


def _save_torch_layout(module: "DPMultiheadAttention", state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """state_dict post-hook: the keys, shapes and order of ``nn.MultiheadAttention``'s state_dict."""
    own = {key[len(prefix):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
    names = ("q_proj", "k_proj", "v_proj")
    if module._qkv_same_embed_dim:
        state_dict[prefix + "in_proj_weight"] = torch.cat([own.pop(f"{name}.weight") for name in names])
    else:
        for name in names:
            state_dict[f"{prefix}{name}_weight"] = own.pop(f"{name}.weight")
    if f"{names[0]}.bias" in own:
        state_dict[prefix + "in_proj_bias"] = torch.cat([own.pop(f"{name}.bias") for name in names])
    for torch_name in ("bias_k", "bias_v"):
        if _TORCH_RENAMES[torch_name] in own:
            state_dict[prefix + torch_name] = own.pop(_TORCH_RENAMES[torch_name])
    state_dict.update((prefix + key, value) for key, value in own.items())  # out_proj.*, anything else as it was
