"""The inspector's data: the ledger's views (`store/views.py`) as frames, on a read-only connection.

Connections are opened with `default_transaction_read_only`, so the inspector cannot write to the
ledger even by mistake: PostgreSQL refuses any write in them.
"""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import pandas as pd
import sqlalchemy as sa

from loopline.store import db as store_db
from loopline.store import views


class LedgerView:
    """What the inspector pages read; every call is one read-only transaction."""

    def __init__(self, url: str | None = None):
        self.engine = store_db.read_only_engine(url)

    @contextmanager
    def connect(self) -> Iterator[sa.Connection]:
        with self.engine.connect() as conn:
            yield conn
            conn.rollback()

    def _read(self, view: Callable, *args):
        with self.connect() as conn:
            return view(conn, *args)

    def _frame(self, view: Callable, *args) -> pd.DataFrame:
        table = self._read(view, *args)
        return pd.DataFrame(table.rows, columns=table.columns)

    def runs(self) -> pd.DataFrame:
        return self._frame(views.runs)

    def run_id(self, name: str) -> uuid.UUID | None:
        return self._read(views.run_id, name)

    def metrics(self, run_id: uuid.UUID) -> pd.DataFrame:
        """One row per learner step, one column per metric."""
        long = self._frame(views.metrics, run_id)
        if long.empty:
            return long
        return long.pivot_table(index="step", columns="name", values="value").reset_index()

    def evals(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.evals, run_id)

    def engine_servers(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.engine_servers, run_id)

    def throughput(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.throughput, run_id)

    def step_timings(self, run_id: uuid.UUID) -> pd.DataFrame:
        """Long form (step, part, seconds): where each learner step's time went, for a stacked bar."""
        wide = self._frame(views.step_timings, run_id)
        if wide.empty:
            return wide
        parts = {"rollout_s": "rollout", "learner_s": "learner", "checkpoint_s": "checkpoint", "export_s": "export", "sync_s": "weight sync"}
        long = wide.melt(id_vars="step", value_vars=list(parts), var_name="part", value_name="seconds").fillna(0.0)
        return long.assign(part=long["part"].map(parts))

    def version_lags(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.version_lags, run_id)

    def failure_classes(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.failure_classes, run_id)

    def trajectories(self, run_id: uuid.UUID, limit: int = 1000) -> pd.DataFrame:
        return self._frame(views.trajectories, run_id, limit)

    def trajectory(self, trajectory_id: uuid.UUID) -> dict | None:
        return self._read(views.trajectory, trajectory_id)

    def segments(self, trajectory_id: uuid.UUID) -> list[dict]:
        return self._read(views.segments, trajectory_id)

    def run_plan(self, run_id: uuid.UUID) -> dict | None:
        return self._read(views.run_plan, run_id)

    def learner_logprobs(self, trajectory_id: uuid.UUID) -> list[float] | None:
        return self._read(views.learner_logprobs, trajectory_id)

    def logprob_gaps(self, run_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.logprob_gaps, run_id)

    def attempts(self, slot_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.attempts, slot_id)

    def group(self, group_id: uuid.UUID) -> pd.DataFrame:
        return self._frame(views.group, group_id)

    def initial_weights(self, run_id: uuid.UUID) -> str | None:
        return self._read(views.initial_weights, run_id)

    def run_config(self, run_id: uuid.UUID) -> dict:
        return self._read(views.run_config, run_id)

    def environments(self) -> pd.DataFrame:
        return self._frame(views.environments)

    def environment_spec(self, name: str, version: int) -> dict:
        return self._read(views.environment_spec, name, version)


def overlaid(curves: dict[str, pd.DataFrame], x: str, y: str, smoothing: float = 0.0) -> pd.DataFrame:
    """Several runs' `y` against `x` as one long frame (a `run` column to colour by), each run's curve smoothed
    by an exponential moving average of weight `smoothing` (0: as recorded; TensorBoard's slider, without its
    debiasing), rows without a value left out."""
    parts = []
    for run, frame in curves.items():
        if frame.empty or x not in frame or y not in frame:
            continue
        curve = frame[[x, y]].dropna().sort_values(x)
        if smoothing > 0:
            curve = curve.assign(**{y: curve[y].ewm(alpha=1 - smoothing, adjust=False).mean()})
        parts.append(curve.assign(run=run))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=[x, y, "run"])


def displayable(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with its ids as text: Streamlit's table turned uuid.UUID values into their bytes
    (`{"0": 24, "1": 16, ...}`)."""
    ids = [c for c in frame.columns if frame[c].map(lambda v: isinstance(v, uuid.UUID)).any()]
    return frame.assign(**{c: frame[c].map(lambda v: str(v) if isinstance(v, uuid.UUID) else v) for c in ids}) if ids else frame


@dataclass(frozen=True)
class Token:
    """One token as the inspector shows it."""

    id: int
    text: str
    action: bool  # loss mask 1: generated by the policy and trained on
    logprob: float | None  # the rollout logprob μ (action tokens only)
    version: int | None  # the policy version that generated it
    learner_logprob: float | None = None  # π_old as the learner recomputed it (action tokens of trained trajectories)

    @property
    def gap(self) -> float | None:
        """|μ - π_old|: zero when inference and training agree on this token."""
        if self.logprob is None or self.learner_logprob is None:
            return None
        return abs(self.logprob - self.learner_logprob)


def segment_tokens(segment: dict, decode) -> tuple[list[Token], list[Token]]:
    """(prompt tokens, generated tokens) of a segment; `decode` turns one id into its text."""
    prompt = [Token(i, decode(i), False, None, None) for i in segment["prompt_ids"]]
    versions: list[int | None] = []
    for span in segment.get("version_spans") or []:
        versions += [span["version"]] * (span["end"] - span["start"])
    generated = []
    for k, (i, mask, lp) in enumerate(zip(segment["generated_ids"], segment["action_loss_mask"], segment["rollout_logprobs"])):
        version = versions[k] if k < len(versions) else segment["policy_version"]
        generated.append(Token(i, decode(i), bool(mask), lp if mask else None, version))
    return prompt, generated


def with_learner_logprobs(generated: list[list[Token]], learner: list[float] | None) -> list[list[Token]]:
    """Each segment's generated tokens with π_old placed on its action tokens, in order (the learner stores
    one value per action token of the whole trajectory). A count that does not match is not guessed at."""
    actions = sum(t.action for tokens in generated for t in tokens)
    if learner is None or len(learner) != actions:
        return generated
    values = iter(learner)
    return [[dataclasses.replace(t, learner_logprob=next(values)) if t.action else t for t in tokens] for tokens in generated]


def first_divergence(generated: list[list[Token]], tolerance: float) -> tuple[int, int] | None:
    """(segment, token index) of the first action token where |μ - π_old| exceeds `tolerance`."""
    for s, tokens in enumerate(generated):
        for k, t in enumerate(tokens):
            if t.gap is not None and t.gap > tolerance:
                return s, k
    return None


def chain_of(segments: list[dict], last: dict) -> list[dict]:
    """The calls of the chain that `last` ends, in order (a chain starts where a call does not continue the one
    before it: `continues` 0)."""
    end = next(i for i, s in enumerate(segments) if s is last)
    start = max((i for i in range(end + 1) if not segments[i]["continues"]), default=0)
    return segments[start : end + 1]


def first_retokenisation_difference(ids: list[int], tokenizer) -> int | None:
    """Decode the ids the engine saw to text and tokenise that text again: the first position where the
    result differs (None: the same ids). A pipeline that keeps text and re-tokenises it would train on
    the re-tokenised ids; loopline keeps the engine's ids, and this shows what re-tokenising would change."""
    again = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False)
    for i, (a, b) in enumerate(zip(ids, again)):
        if a != b:
            return i
    return None if len(again) == len(ids) else min(len(ids), len(again))
