"""A tiny Llama with its own byte-level BPE tokenizer and ChatML template.

`build_tiny` makes a random-init one in seconds (for tests and benchmarks of
the engine and learner: what it says is noise, but every token it emits is
real). `loopline models build-tiny` (see `starter.py`) trains the tokenizer on
calculator transcripts and warm-starts the model with SFT.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|im_start|>", "<|im_end|>"]


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        lines.append(f"What is {a} + {b}? <calc>{a} + {b}</calc> <result>{a + b}</result> <answer>{a + b}</answer>")
    lines.append("error: only numbers, + - * / // % ** and parentheses are allowed. Solve the problem.")
    return lines


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 400):
    """A byte-level BPE (any text encodes) with the ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits stay single tokens (as in SmolLM2): copying a number is then one regular token-by-token copy
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # (its own bars under the build's one)
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token=None, chat_template=CHATML
    )


def random_model(directory: Path, tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, context: int = 1024) -> Path:
    """Write a random-init Llama sized for `tokenizer`, and the tokenizer, to `directory`."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny(directory: Path, seed: int = 0, layers: int = 2, hidden: int = 64, context: int = 1024) -> Path:
    """A random-init tiny policy (tests, benchmarks)."""
    return random_model(directory, train_tokenizer(_corpus()), seed=seed, layers=layers, hidden=hidden, context=context)
