"""Failpoints: named places where a test may SIGKILL the process, to prove that every crash resumes exactly once.

Off unless `LOOPLINE_FAILPOINT=NAME[:N]` is set: the N-th time (default the first) the process passes
`failpoint(NAME)` it kills itself with SIGKILL - no cleanup, no finally blocks, like a lost machine.
Names: deepspeed_start (the learner is about to join DeepSpeed's process group), rollout_commit (after
a trajectory is committed), learner_step (after the update, before the checkpoint), learner_commit
(checkpoint and weights written, ledger commit not yet), weight_sync (new weights served, not yet
recorded as published), evaluate (a scheduled evaluation is about to run).
"""

from __future__ import annotations

import collections
import os
import signal

ENV = "LOOPLINE_FAILPOINT"
_hits: collections.Counter[str] = collections.Counter()


def failpoint(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _hits[name] += 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
