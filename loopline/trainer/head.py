"""log π of the sampled tokens, with the vocabulary-wide logits of a few hundred positions alive at a time.

The LM head's output at the action positions is [rows, positions, vocabulary] floats: in the race's learner step
(SmolLM2, 49,152 words, 32 rows of ~60 action positions a micro-batch) 0.38 GB, made again by the temperature's
division and logsumexp's exp, and once more for its gradient: most of a micro-batch's activations at the step's
peak (`benchmarks/learner_memory.py` measures it). Here the model's forward stops at its last hidden states (the
head swapped out for the call), and the head runs on `HEAD_CHUNK` positions at a time (`_HeadLogprob`): a chunk's
logits live only while its logprobs are made, and the backward makes them again (one more head matmul over the
action positions) and turns them into their gradient in place. The result is the same function of the weights (float rounding aside:
the head's matmul runs on fewer rows at a time), so π_old, the loss and its gradient are unchanged.

A model whose forward does more after its head (Gemma's logit soft-capping, a logit scale) would give other
numbers this way: `plain_head` checks each model on a few tokens before the learner uses the chunked path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

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


class _HeadLogprob(torch.autograd.Function):
    """log π(target) = z[target] - logsumexp(z), z = (states Wᵀ + b) / T, for a chunk of positions, and the entropy
    there (no gradient). The logits are made again in backward, not kept, and turned into their own gradient in place
    (g·(onehot - softmax)): one vocabulary-wide buffer a chunk each way, where autograd's graph of the same functions
    made about a dozen (the division, logsumexp's and gather's backward, the entropy made again): 11% of the race's
    learner step."""

    @staticmethod
    def forward(ctx, states, weight, bias, targets, temperature: float, with_entropy: bool):
        z = _logits(states, weight, bias, temperature)
        top = z.max(-1, keepdim=True).values
        z.sub_(top)  # (z - max: exp cannot overflow)
        shifted = z.gather(-1, targets[:, None])[:, 0]
        e = torch.exp(z)
        total = e.sum(-1)
        log_total = total.log()
        # -Σ p log p with p = e / Σe and log p = (z - max) - log Σe
        entropy = log_total - torch.linalg.vecdot(e, z) / total if with_entropy else z.new_zeros(0)
        ctx.save_for_backward(states, weight, bias, targets, top[:, 0] + log_total)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return shifted - log_total, entropy

    @staticmethod
    def backward(ctx, grad, _entropy_grad):
        states, weight, bias, targets, lse = ctx.saved_tensors
        g = _logits(states, weight, bias, ctx.temperature).sub_(lse[:, None]).exp_()  # softmax
        g.mul_(-grad[:, None]).scatter_add_(-1, targets[:, None], grad[:, None]).div_(ctx.temperature)
        g = g.to(weight.dtype)  # (the gradient with respect to the head's output, before the division by T)
        wants = ctx.needs_input_grad
        return (g @ weight if wants[0] else None, g.t() @ states if wants[1] else None,
                g.sum(0) if bias is not None and wants[2] else None, None, None, None)


def _logits(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    return torch.nn.functional.linear(states, weight, bias).float().div_(temperature)


def states_logprobs(states: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                    entropy: list | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
    """[..., H] last hidden states -> log π(target) at each position, `HEAD_CHUNK` positions through the head at a
    time; `at` (a mask of the targets' shape): only those positions (0 elsewhere). A micro-batch's rows share their
    kept positions, and a row's padding and tool output there were a fifth of those run in the race's step."""
    flat, wanted = states.reshape(-1, states.shape[-1]), targets.reshape(-1)
    where = None
    if at is not None:
        where = at.reshape(-1).nonzero().squeeze(-1).to(states.device)
        flat, wanted = flat.index_select(0, where), wanted.index_select(0, where)
    picked, entropies = [], []
    for start in range(0, flat.shape[0], HEAD_CHUNK):
        logp, h = _HeadLogprob.apply(flat[start : start + HEAD_CHUNK], head.weight, head.bias, wanted[start : start + HEAD_CHUNK],
                                     temperature, entropy is not None)
        picked.append(logp)
        entropies.append(h)

    def placed(values: list[torch.Tensor]) -> torch.Tensor:
        flat_values = torch.cat(values) if values else states.new_zeros(0, dtype=torch.float32)
        if where is not None:  # (index_copy: its backward picks, deterministic)
            flat_values = flat_values.new_zeros(targets.numel()).index_copy(0, where, flat_values)
        return flat_values.reshape(targets.shape)

    if entropy is not None:
        entropy.append(placed(entropies))
    return placed(picked)


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
