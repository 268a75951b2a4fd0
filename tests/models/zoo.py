"""The zoo: tiny HuggingFace models built from configs (no downloads), one per family users bring.

``ZOO[name]`` is a ``Family``: ``build()`` returns the model in train mode with dropout off;
``inputs(n, t, generator)`` a batch of ``n`` samples of length ``t``; ``loss`` each sample's
loss from the model's output. Sizes are the smallest that keep each family's structure: hidden
16, one or two layers, vocabulary 100, and for Swin two blocks (the second one shifted, so its
attention mask meets the relative position bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import pytest
import torch
from torch import nn

from tests.helpers import projection_loss

transformers = pytest.importorskip("transformers")

VOCAB = 100
IMAGE = 8  # Swin and ViT: 8x8 pixels, patches of 2 (Swin) or 4 (ViT)


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    inputs: Callable[[int, int, torch.Generator], Dict[str, torch.Tensor]]
    kind: str  # encoder, decoder, seq2seq or vision
    lora_targets: Sequence[str] = ()
    tied: Optional[Callable[[nn.Module], bool]] = None  # whether the built model ties two uses of one weight

    def loss(self, output: Any) -> torch.Tensor:
        return projection_loss(output.logits)


def _ids(n: int, t: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (n, t), generator=g)}


def _ids_and_mask(n: int, t: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (n, t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : t // 2] = 0  # one sample left-padded
    return {"input_ids": ids, "attention_mask": mask}


def _seq2seq(n: int, t: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(1, VOCAB, (n, t), generator=g),
            "decoder_input_ids": torch.randint(1, VOCAB, (n, t), generator=g)}


def _pixels(n: int, t: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=g)}


def bert() -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).train()


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).train()


def llama(tie: bool = False, attention: str = "sdpa") -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=tie, attn_implementation=attention)).train()


def opt() -> nn.Module:
    """OPT: its feed-forward runs on the batch flattened with the tokens, ``(B * T, d)``."""
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, word_embed_proj_dim=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)).train()


def bloom() -> nn.Module:
    """BLOOM: ALiBi biases and attention on the batch merged with the heads, ``(B * H, T, T)``."""
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).train()


def mixtral() -> nn.Module:
    """Mixture of experts: a top-2 router over three experts."""
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=16,
        router_jitter_noise=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)).train()


def t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).train()


def _bart_config(cls):
    return cls(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
               eos_token_id=2, decoder_start_token_id=2)


def bart() -> nn.Module:
    return transformers.BartForConditionalGeneration(_bart_config(transformers.BartConfig)).train()


def mbart() -> nn.Module:
    return transformers.MBartForConditionalGeneration(_bart_config(transformers.MBartConfig)).train()


def deberta_v2(norm_rel_ebd: str = "layer_norm") -> nn.Module:
    """Relative attention (content-to-position and position-to-content) over relative embeddings
    whose weight the encoder reads itself (``rel_embeddings.weight``, the Embedding never called),
    layer-normed (DeBERTa-v3's setting) or not (the config's default)."""
    return transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        relative_attention=True, position_buckets=4, pos_att_type=["p2c", "c2p"], norm_rel_ebd=norm_rel_ebd,
        num_labels=3, pooler_dropout=0.0)).train()


def deberta() -> nn.Module:
    """DeBERTa (v1): relative attention with the query and value biases as the attention's own parameters
    (replayed by torch.func); it builds its attention mask from the batch's shape when given none."""
    return transformers.DebertaForSequenceClassification(transformers.DebertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=8, num_labels=3)).train()


def vit() -> nn.Module:
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)).train()


def swin() -> nn.Module:
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=8, depths=[2], num_heads=[2], window_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=3)).train()


def _tied(embedding: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module], bool]:
    return lambda model: model.get_output_embeddings().weight is embedding(model).weight


ZOO: Dict[str, Family] = {
    "bert": Family(bert, _ids_and_mask, "encoder", ("query", "value"), _tied(lambda m: m.bert.embeddings.word_embeddings)),
    "deberta": Family(deberta, _ids_and_mask, "encoder", ("in_proj",)),
    "deberta-v2": Family(deberta_v2, _ids, "encoder", ("query_proj", "value_proj")),
    "deberta-v2-unnormed": Family(lambda: deberta_v2("none"), _ids, "encoder"),
    "gpt2": Family(gpt2, _ids, "decoder", ("c_attn",), _tied(lambda m: m.transformer.wte)),
    "llama": Family(llama, _ids_and_mask, "decoder", ("q_proj", "v_proj")),
    "llama-tied": Family(lambda: llama(tie=True), _ids, "decoder", (), _tied(lambda m: m.model.embed_tokens)),
    "llama-eager": Family(lambda: llama(attention="eager"), _ids_and_mask, "decoder"),
    "opt": Family(opt, _ids_and_mask, "decoder", (), _tied(lambda m: m.model.decoder.embed_tokens)),
    "bloom": Family(bloom, _ids_and_mask, "decoder", (), _tied(lambda m: m.transformer.word_embeddings)),
    "mixtral": Family(mixtral, _ids, "decoder"),
    "t5": Family(t5, _seq2seq, "seq2seq", ("q", "v"), _tied(lambda m: m.shared)),
    "bart": Family(bart, _seq2seq, "seq2seq", ("q_proj", "v_proj"), _tied(lambda m: m.model.shared)),
    "mbart": Family(mbart, _seq2seq, "seq2seq", (), _tied(lambda m: m.model.shared)),
    "vit": Family(vit, _pixels, "vision", ("q_proj", "v_proj")),
    "swin": Family(swin, _pixels, "vision", ("q_proj", "v_proj")),
}
