"""The `envreg` command: the registry's CLI (`loopline.envregistry.cli`), with what it needs from the layer above
it wired in: envs with `agent:` are smoke-tested by the rollout layer's player (their program against a
scripted model)."""

from loopline.cli_support import run_cli, stop_on_signals
from loopline.envregistry import smoke
from loopline.envregistry.cli import app
from loopline.rollout.agent_program import play_scripted

smoke.agent_player = play_scripted
app.callback()(stop_on_signals)  # (SIGTERM and a closed terminal stop a command as loopline's do)

__all__ = ["app", "main"]


def main() -> None:
    run_cli(app)


if __name__ == "__main__":  # pragma: no cover
    main()
