"""The engine protocol: token ids in, token ids and their logprobs out, with the policy version that made them.

Both engines (`LocalEngine` in-process, `SGLangEngine` over HTTP) return the
same `Generation`, so the harness and the learner never care which produced
a trajectory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence, Union

if TYPE_CHECKING:
    import torch

# What `Generation.logprobs` holds. SGLang's default, and ours: the sampled
# token's log-probability under softmax(logits / T) over the full vocabulary;
# top-k / top-p truncation is NOT in it (the learner's log-probs are of the untruncated distribution).
FULL_VOCAB_TEMPERED = "log_softmax(logits/T)"
# With truncated sampling, the behaviour policy's real probability: renormalised over the kept tokens.
TRUNCATED_RENORMALISED = "log_softmax(logits/T) truncated by top_k/top_p and renormalised"

FinishReason = Literal["stop", "length", "abort"]
InFlightPolicy = Literal["finish", "abort", "continue"]
# SGLang's: the longest one request may take, and how long a launched server may take to start (one default each
# for the run config's `engine:` section and the engines).
SGLANG_REQUEST_TIMEOUT_S = 600.0
SGLANG_STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # below 1e-6 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    # Text that ends a generation once the sampled tokens spell it (an OpenAI client's `stop`). An engine
    # that cannot check it generates on; the caller cuts the sample after it either way.
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class VersionSpan:
    """Tokens [start, end) of a generation were produced by policy `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class Generation:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # FULL_VOCAB_TEMPERED, aligned with token_ids
    finish_reason: FinishReason
    version_spans: tuple[VersionSpan, ...]
    logprob_semantics: str = FULL_VOCAB_TEMPERED
    # With top-k/top-p: the renormalised behaviour logprobs (TRUNCATED_RENORMALISED); else None.
    sampling_logprobs: tuple[float, ...] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def policy_version(self) -> int:
        """The version that started the request (the spans say if it changed)."""
        return self.version_spans[0].version if self.version_spans else -1

    @property
    def mixed_versions(self) -> bool:
        return len({s.version for s in self.version_spans}) > 1

    def recorded_spans(self, kept: int | None = None) -> list[dict[str, int]] | None:
        """A segment's `version_spans` for the first `kept` tokens (all by default): None when one version
        generated them all (the segment's `policy_version` says which)."""
        n = len(self.token_ids) if kept is None else kept
        spans = [{"version": s.version, "start": s.start, "end": min(s.end, n)} for s in self.version_spans if s.start < n]
        return spans if len({s["version"] for s in spans}) > 1 else None


def spans_from_versions(token_versions: Sequence[int]) -> tuple[VersionSpan, ...]:
    spans: list[VersionSpan] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1].version == v:
            spans[-1] = VersionSpan(v, spans[-1].start, i + 1)
        else:
            spans.append(VersionSpan(v, i, i + 1))
    return tuple(spans)


class EngineError(Exception):
    """The engine failed (down, 4xx/5xx, crashed): an infra failure, never a reward."""


class EngineClosed(EngineError):
    """This process closed its engine (it is stopping): an episode cut by it was not played, and nobody is to
    blame: its slot goes back, it is not an infra failure (Ctrl-C used to fail every slot three times and drop
    its group: the rollout loop went on claiming slots on the closed engine)."""


class ContextOverflow(ValueError):
    """The prompt plus the requested tokens exceed the model's context: the episode's budget is spent."""


# What a weight sync hands an engine: an exported model directory, or - to an engine in the learner's own
# process - the learner's tensors by name (no disk; see `pipeline/stages.sync_weights`).
WeightsSource = Union[str, Path, Mapping[str, "torch.Tensor"]]


class LentWeights(dict):
    """The learner's own tensors, lent rather than handed over: the learner changes them only while this process
    generates nothing (a sync step: its rollouts, then its learner), so an engine in the learner's process may serve
    them as they are, one copy of the weights in the process instead of two. An engine that copies any mapping
    of tensors is correct with them too."""


class Sampler(Protocol):
    """What an episode needs of an engine (`envreg test` plays one against scripted replies)."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> Generation: ...

    def version(self) -> int: ...


class Engine(Sampler, Protocol):
    async def update_weights(self, version: int, weights: WeightsSource, in_flight: InFlightPolicy = "finish") -> dict[str, float] | None:
        """Serve `version` from now on; in-flight requests finish on the old weights, are aborted, or continue.
        Returns how long its parts took, in seconds (recorded with the published version)."""

    def server_urls(self) -> list[str]:
        """The URLs of the inference servers it generates on ([] in-process): registered in the ledger."""

    async def close(self) -> None: ...
