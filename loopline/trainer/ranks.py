"""Data-parallel learner ranks started by DeepSpeed's launcher: rank 0 runs the flow, the others follow it.

Rank 0 is the whole trainer (ledger, engine, commits). Ranks 1..N-1 hold a replica of the learner and
make only the calls that need every rank: build it, train a step, save or load a checkpoint. Rank 0
announces each such call, with its arguments, before it makes it, and every rank makes the same call;
the step's sequences travel with the announcement, so no other rank needs the ledger. The
announcements go over a gloo group of their own: a follower may wait for the next one as long as a
rollout takes, longer than the training collectives' timeout should allow.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch

from loopline import plugins
from loopline.errors import LooplineError
from loopline.trainer.backends import BackendName, init_distributed
from loopline.trainer.batch import TrainSequence
from loopline.trainer.learner import Learner, LearnerConfig, LearnerError, StepResult, computing_threads

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = timedelta(days=7)  # the longest a follower waits for rank 0's next call
_channel = None  # the command group, once this process joined a launched learner


def join() -> int:
    """Join the launcher's process group (RANK, WORLD_SIZE, MASTER_ADDR/PORT from its environment) and the
    command channel; returns this process's rank."""
    global _channel
    init_distributed("nccl" if torch.cuda.is_available() else "gloo")
    _channel = torch.distributed.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return torch.distributed.get_rank()


def ranks_missing(directory: Path) -> list[tuple[int, str]]:
    """Every rank says whether it sees `directory` (the launching host wrote it under LOOPLINE_HOME); returns
    (rank, host) of those that do not: ranks on several hosts share checkpoints and rank 0's result through
    LOOPLINE_HOME, so a host that mounts another one would train and then fail at the first checkpoint."""
    seen: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(seen, (socket.gethostname(), directory.is_dir()), group=_channel)
    return [(rank, host) for rank, (host, sees) in enumerate(seen) if not sees]


def _announce(*command) -> None:
    torch.distributed.broadcast_object_list([command], src=0, group=_channel)


class LeadingLearner(Learner):
    """Rank 0's learner: every call the other ranks must make too is announced to them first."""

    def __init__(self, model_dir: str | Path, config: LearnerConfig, backend: BackendName | None = None):
        _announce("new", str(model_dir), config, backend, plugins.imported())  # (a plugin's components, named in config)
        super().__init__(model_dir, config, backend)

    def rl_step(self, sequences: Sequence[TrainSequence], trained_version: int | None = None) -> StepResult:
        # with rank 0's thread count: a replay sets the one the step was trained with, for every rank
        _announce("rl_step", list(sequences), trained_version, torch.get_num_threads())
        return super().rl_step(sequences, trained_version)

    def _save_state(self, directory: Path, state: dict) -> None:
        _announce("save", str(directory), state)
        super()._save_state(directory, state)

    def load_checkpoint(self, directory: str | Path) -> dict:
        _announce("load", str(directory))
        return super().load_checkpoint(directory)


def build_learner(model_dir: str | Path, config: LearnerConfig, backend: BackendName | None = None) -> Learner:
    """This process's learner; on rank 0 of a launched learner, one the other ranks follow."""
    return (LeadingLearner if _channel is not None else Learner)(model_dir, config, backend)


def follow() -> None:
    """Ranks 1..N-1: make rank 0's announced calls until it says stop. A step rank 0 refuses is refused here
    too (same batch, same reduced gradients); what happens next is rank 0's to decide."""
    learner: Learner | None = None
    while True:
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=_channel)
        kind, *args = box[0]
        if kind == "stop":
            return
        if kind == "new":
            *built_with, modules = args
            learner = None  # the old replica goes before the new one is built, as on rank 0
            try:
                plugins.load(modules)
            except ValueError as exc:
                raise LooplineError(f"learner rank {torch.distributed.get_rank()} on {socket.gethostname()}: imports: {exc}") from None
            learner = Learner(*built_with)
        elif learner is None:
            raise RuntimeError(f"learner command {kind!r} from rank 0 before any learner was built")
        elif kind == "rl_step":
            *step, threads = args
            try:
                with computing_threads(threads):
                    learner.rl_step(*step)
            except LearnerError as refused:
                log.warning("rank %d: the step was refused: %s", torch.distributed.get_rank(), refused)
        elif kind == "save":
            learner.backend.save(Path(args[0]), args[1])
        elif kind == "load":
            learner.load_checkpoint(args[0])
        else:
            raise RuntimeError(f"unknown learner command {kind!r} from rank 0")


def finish() -> None:
    """Rank 0, at the end of its flow: the other ranks exit."""
    if _channel is not None:
        _announce("stop")
