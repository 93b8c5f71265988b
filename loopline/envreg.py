"""The `envreg` command: the registry's CLI (`loopline.envregistry.cli`), with what it needs from the layer above
it wired in: envs with `agent:` are smoke-tested by the rollout layer's player (their program against a
scripted model)."""

from loopline.envregistry import smoke
from loopline.envregistry.cli import app
from loopline.rollout.agent_program import play_scripted

smoke.agent_player = play_scripted

__all__ = ["app"]
