"""A tiny Llama with its own byte-level BPE tokenizer and ChatML template, built in seconds.

Random-init here (for tests and benchmarks of the engine and harness: what it
says is noise, but every token it emits is real and every invariant can be
checked); `loopline models build-tiny` will warm-start it with SFT.
"""

from __future__ import annotations

import random
from pathlib import Path

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


def build_tiny(directory: Path, seed: int = 0, layers: int = 2, hidden: int = 64, context: int = 1024) -> Path:
    """Write a random-init model and its tokenizer to `directory` (a Hugging Face model directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", bos_token=None, chat_template=CHATML
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
        eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory
