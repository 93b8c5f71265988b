"""What every episode of a run shares: the env, its registered version, the policy's chat format and the
sampling. Its own module because both ways of playing an episode take it: loopline's harness and a user's
agent program (`agent_program`), which the harness hands envs with `agent:` to."""

from __future__ import annotations

from dataclasses import dataclass

from loopline.envregistry.spec import EnvSpec
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams


@dataclass(frozen=True)
class EpisodeSetup:
    spec: EnvSpec
    env_version: int  # the registered version number (name@version)
    chat: ChatFormat
    sampling: SamplingParams
