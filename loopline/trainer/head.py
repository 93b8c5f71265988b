"""log π of the sampled tokens, with the vocabulary-wide logits of a few hundred positions alive at a time.

The LM head's output at the action positions is [rows, positions, vocabulary] floats: in the race's learner step
(SmolLM2, 49,152 words, 32 rows of ~60 action positions a micro-batch) 0.38 GB, made again by the temperature's
division and logsumexp's exp, and once more for its gradient: most of a micro-batch's activations at the step's
peak (`benchmarks/learner_memory.py` measures it). Here the model's forward stops at its last hidden states (the
head swapped out for the call), and the head runs on `HEAD_CHUNK` positions at a time under activation
checkpointing: a chunk's logits live only while its logprobs are made, and the backward makes them again (one
more head matmul over the action positions). The result is the same function of the weights (float rounding aside:
the head's matmul runs on fewer rows at a time), so π_old, the loss and its gradient are unchanged.

A model whose forward does more after its head (Gemma's logit soft-capping, a logit scale) would give other
numbers this way: `plain_head` checks each model on a few tokens before the learner uses the chunked path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from loopline.trainer.config import HEAD_CHUNK  # (positions whose logits exist at once; SmolLM2: 0.1 GB)

ENTROPY_CHUNK = 256  # positions whose vocabulary-wide entropy temporaries exist at once


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(π) = -Σ p·log p at each position of [..., V] logits (already divided by the temperature, as verl's
    `entropy_from_logits`), a token a model masks out (-inf) counting 0; no gradient: a metric. A few hundred
    positions at a time: the vocabulary-wide temporaries stay small beside the logits themselves."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], ENTROPY_CHUNK):
            logp = torch.log_softmax(flat[start : start + ENTROPY_CHUNK].float(), dim=-1)
            out[start : start + ENTROPY_CHUNK] = -torch.where(logp > -torch.inf, logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
    return out.reshape(logits.shape[:-1])


def logits_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: list | None = None) -> torch.Tensor:
    """[..., V] logits -> log π(target) at each position; the entropy there appended to `entropy` if given."""
    logits = logits.float() / temperature
    if entropy is not None:
        entropy.append(token_entropy(logits))
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)


def _chunk(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, temperature: float,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(states, weight, bias).float() / temperature
    entropy = token_entropy(logits) if with_entropy else logits.new_zeros(0)
    return logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1), entropy


def states_logprobs(states: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                    entropy: list | None = None) -> torch.Tensor:
    """[..., H] last hidden states -> log π(target) at each position, `HEAD_CHUNK` positions through the head at a time."""
    flat, wanted = states.reshape(-1, states.shape[-1]), targets.reshape(-1)
    if flat.shape[0] == 0:
        if entropy is not None:
            entropy.append(states.new_zeros(targets.shape, dtype=torch.float32))
        return states.new_zeros(targets.shape, dtype=torch.float32)
    remake = torch.is_grad_enabled() and (flat.requires_grad or head.weight.requires_grad)
    picked, entropies = [], []
    for start in range(0, flat.shape[0], HEAD_CHUNK):
        args = (flat[start : start + HEAD_CHUNK], head.weight, head.bias, wanted[start : start + HEAD_CHUNK], temperature, entropy is not None)
        logp, h = checkpoint(_chunk, *args, use_reentrant=False) if remake else _chunk(*args)
        picked.append(logp)
        entropies.append(h)
    if entropy is not None:
        entropy.append(torch.cat(entropies).reshape(targets.shape))
    return torch.cat(picked).reshape(targets.shape)


@contextlib.contextmanager
def states_out(model: torch.nn.Module) -> Iterator[torch.nn.Linear]:
    """Within it the model's forward returns its last hidden states where it returned logits (`.logits`), for
    the head it yields to be run by `states_logprobs`. The head module is put back as it was (tied weights
    stay tied: the module, not its weight, is swapped)."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Identity())
    try:
        yield head
    finally:
        model.set_output_embeddings(head)


def plain_head(model: torch.nn.Module) -> bool:
    """Whether the model's logits are its head applied to what `states_out` returns (checked on 4 tokens): a
    model with a head that is not a `Linear`, or that transforms the head's output, keeps the full path."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return False
    ids = torch.arange(4, device=head.weight.device)[None] % model.config.get_text_config().vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        with states_out(model):
            states = model(input_ids=ids, use_cache=False).logits
        return states.shape[-1] == head.in_features and torch.allclose(head(states), logits, rtol=1e-4, atol=1e-4)
