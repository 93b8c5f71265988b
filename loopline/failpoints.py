"""Failpoints: named places where a test may SIGKILL the process, to prove that every crash resumes exactly once.

Off unless `LOOPLINE_FAILPOINT=NAME[:N]` is set: the N-th time (default the first) the process passes
`failpoint(NAME)` it kills itself with SIGKILL - no cleanup, no finally blocks, like a lost machine.
`NAME:N:hang` instead says so on stderr and hangs there, as a stuck disk or server would: where a stop
signal must still end the process within seconds.
Names: server_started (`loopline server start`: the Prefect server launched, not yet answering), run_open (the run about
to be created or taken: nothing of it exists or is held yet), deepspeed_start (the learner is about to join DeepSpeed's process group), episode_start (a slot
is leased and its episode about to start), rollout_commit (after a trajectory is committed: finished
episodes are committed together, so this leaves no lease behind), learner_step (after the update, before the checkpoint), learner_commit
(checkpoint and weights written, ledger commit not yet), weight_load (the local engine loading a new
version, in its loading thread), weight_sync (new weights served, not yet recorded as published),
evaluate (a scheduled evaluation is about to run).
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time

ENV = "LOOPLINE_FAILPOINT"
_hits: collections.Counter[str] = collections.Counter()


def failpoint(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, rest = spec.partition(":")
    if target != name:
        return
    nth, _, action = rest.partition(":")
    _hits[name] += 1
    if _hits[name] < int(nth or 1):
        return
    if action == "hang":
        sys.stderr.write(f"failpoint {name}: hanging\n")
        sys.stderr.flush()
        while True:
            time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
