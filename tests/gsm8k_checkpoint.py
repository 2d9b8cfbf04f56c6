"""A small random Qwen3-MoE checkpoint with a BPE tokenizer of GSM8K text, for tests.

`build_checkpoint(folder)` writes, in a few seconds on 2 cores, what a user's checkpoint folder
holds: transformers' `config.json` + `model.safetensors` (`Qwen3MoeForCausalLM.save_pretrained`,
random weights) and `tokenizer.json` + `tokenizer_config.json` (`AutoTokenizer.from_pretrained`
loads them). The tokenizer is a byte-level BPE trained here with the `tokenizers` library on the
first TRAIN_EXAMPLES GSM8K training examples (nothing from the hub), so any text encodes (the
byte alphabet is in the vocabulary) and GSM8K text takes about 180 tokens an example. The
context, CONTEXT positions, holds a 5-shot GSM8K prompt (at most about 1,700 of these tokens)
plus the harness's 256 generated tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

GSM8K_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "gsm8k"
VOCAB_SIZE = 2048
TRAIN_EXAMPLES = 3000  # of 7,473: enough for merges of GSM8K's common words, trains in < 1 s
CONTEXT = 4096
EOS = "<|endoftext|>"


def training_text(limit: int = TRAIN_EXAMPLES, folder: Path = GSM8K_DIR):
    """GSM8K training examples as the gsm8k workload writes them (question, answer)."""
    with (folder / "train.jsonl").open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= limit:
                return
            row = json.loads(line)
            yield f"Question: {row['question']}\nAnswer: {row['answer']}"


def build_tokenizer(vocab_size: int = VOCAB_SIZE, folder: Path = GSM8K_DIR):
    """A transformers fast tokenizer over a byte-level BPE trained on GSM8K training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(training_text(folder=folder), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)


def build_checkpoint(out: str | Path, seed: int = 0, context: int = CONTEXT) -> Path:
    """Write the checkpoint (model and tokenizer) into folder `out`; returns it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=context,
        eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM._from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
