"""The oracle on whole tiny HuggingFace models built from configs, wrapped and non-wrapped."""

import pytest
import torch

from tests.helpers import check_per_sample_grads, projection_loss

transformers = pytest.importorskip("transformers")


def tiny_gpt2(tie=True):
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=16, tie_word_embeddings=tie,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def tiny_llama():
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=61, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def tiny_bert():
    cfg = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=61,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, max_position_embeddings=32,
    )
    return transformers.BertForSequenceClassification(cfg).train()


def logits_loss(output):
    return projection_loss(output.logits)


MODELS = {"gpt2-tied": tiny_gpt2, "gpt2-untied": lambda: tiny_gpt2(tie=False), "llama": tiny_llama, "bert": tiny_bert}


@pytest.mark.parametrize("wrap", [False, True], ids=["hooks", "wrapped"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("loss_reduction", ["mean", "sum"])
def test_hf_model_matches_batch_of_one(name, wrap, loss_reduction):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, 61, (3, 9))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got = check_per_sample_grads(model, inputs, loss_fn=logits_loss, loss_reduction=loss_reduction, wrap=wrap)
    assert len(got) == len([p for p in model.parameters() if p.requires_grad])


def test_gpt2_tied_embedding_sums_both_uses():
    torch.manual_seed(0)
    model = tiny_gpt2(tie=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    got = check_per_sample_grads(model, {"input_ids": torch.randint(0, 61, (2, 5))}, loss_fn=logits_loss)
    assert got[model.lm_head.weight].shape == (2, 61, 32)


def test_padded_batch_with_attention_mask():
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, 61, (3, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    check_per_sample_grads(model, {"input_ids": ids, "attention_mask": mask}, loss_fn=logits_loss)


def test_vit_raw_parameters_use_functorch_fallback():
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
    )
    model = transformers.ViTForImageClassification(cfg).train()
    got = check_per_sample_grads(model, {"pixel_values": torch.randn(3, 3, 8, 8)}, loss_fn=logits_loss)
    embeddings = model.vit.embeddings
    assert got[embeddings.cls_token].shape == (3, *embeddings.cls_token.shape)
    assert got[embeddings.position_embeddings].shape == (3, *embeddings.position_embeddings.shape)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_is_exact(use_reentrant):
    torch.manual_seed(0)
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ids = torch.randint(0, 61, (3, 6))
    got = check_per_sample_grads(model, {"input_ids": ids}, loss_fn=logits_loss)
    assert len(got) == len(list(model.parameters()))
