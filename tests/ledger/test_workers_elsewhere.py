"""Rollout workers on other hosts, on the real ledger. A worker's follower (flows/worker.Follower) ends its worker
when the run ends or is asked to cancel, or when a version cannot be had (saying why), never over a version the
run no longer needs, and rides out a ledger outage shorter than the tasks' retry budget; a learner that waits for
groups no engine can fill says which engine serves what. The engine is a stand-in that only records what it is
told to load (nothing here generates)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import sqlalchemy as sa

from loopline import holder
from loopline.flows.worker import Follower
from loopline.pipeline.stages import RolloutContext
from loopline.rollout.weights.store import WeightStore
from loopline.store import ledger
from loopline.store.db import session as new_session
from loopline.store.errors import DatabaseUnavailable


class _Engine:
    def __init__(self):
        self.loaded: list[tuple[int, str]] = []
        self._version = 0

    def version(self) -> int:
        return self._version

    def server_urls(self) -> list[str]:
        return []

    async def update_weights(self, version, weights, in_flight):
        self.loaded.append((version, str(weights)))
        self._version = version
        return {}


def _ctx(engine, run, tmp_path, session_factory=None, lookup=None) -> RolloutContext:
    weights = WeightStore(run.name, tmp_path / "cache", lookup or (lambda name: None), fetch_deadline_s=1)
    return RolloutContext(
        run_id=run.id, session_factory=session_factory or (lambda: new_session(engine)), engine=_Engine(),
        binding=SimpleNamespace(), weights=weights,
    )


def _publish(db, run, version: int, uri: str) -> None:
    db.execute(sa.text("INSERT INTO policy_version (run_id, version, learner_step, weights_uri) VALUES (:r, :v, :v, :u)"), dict(r=run.id, v=version, u=uri))
    db.commit()


def _follow(ctx, seconds: float = 10) -> Follower:
    follower = Follower(ctx, threading.Event(), None, poll_s=0.05)
    follower.start()
    follower.join(timeout=seconds)
    return follower


def test_a_version_on_this_host_is_loaded_and_a_cancel_request_ends_the_worker(engine, db, run, tmp_path):
    version = tmp_path / "v1"
    version.mkdir()
    ctx = _ctx(engine, run, tmp_path)
    ledger.start_run(db, run.id, holder.this_process())  # (a trainer drives it)
    _publish(db, run, 1, WeightStore("x", tmp_path / "c").publish(version))
    follower = Follower(ctx, threading.Event(), None, poll_s=0.05)
    follower.start()
    time.sleep(1)
    assert follower.is_alive() and ctx.engine.loaded == [(1, str(version.resolve()))]
    ledger.request_cancel(db, run.id, "a user ran loopline cancel")  # (the run stays running until its trainer stops)
    follower.join(timeout=5)
    assert not follower.is_alive() and follower.stop.is_set() and follower.failure is None


def test_a_version_that_cannot_be_had_ends_the_worker_saying_why(engine, db, run, tmp_path):
    uri = f"trainer://{run.name}/nowhere/v000001.1#sha256=" + "ab" * 32
    _publish(db, run, 1, uri)
    follower = _follow(_ctx(engine, run, tmp_path))
    assert follower.stop.is_set() and uri in str(follower.failure) and "has no weight server in the ledger" in str(follower.failure)


def test_a_failure_after_the_run_ended_is_no_failure(engine, db, run, tmp_path):
    _publish(db, run, 1, f"trainer://{run.name}/nowhere/v000001.1#sha256=" + "ab" * 32)
    ctx = _ctx(engine, run, tmp_path)
    ended = ctx.weights.local

    def fetch_then_the_run_ends(uri):  # (the trainer finished while this host fetched the last version)
        ledger.request_cancel(db, run.id, "done")
        return ended(uri)

    ctx.weights.local = fetch_then_the_run_ends
    follower = _follow(ctx)
    assert follower.stop.is_set() and follower.failure is None


def test_a_ledger_outage_shorter_than_the_retry_budget_is_ridden_out(engine, db, run, tmp_path):
    down_until = time.monotonic() + 2

    def flaky():
        if time.monotonic() < down_until:
            raise DatabaseUnavailable("connection refused")
        return new_session(engine)

    version = tmp_path / "v1"
    version.mkdir()
    _publish(db, run, 1, str(version))
    ctx = _ctx(engine, run, tmp_path, session_factory=flaky)
    follower = Follower(ctx, threading.Event(), None, poll_s=0.05)
    follower.start()
    time.sleep(4)
    assert follower.is_alive() and follower.failure is None and ctx.engine.loaded == [(1, str(version))]
    follower.stop.set()
    follower.join(timeout=5)


def test_a_learner_waiting_for_groups_no_engine_can_fill_says_which_engine_serves_what(engine, db, run, caplog):
    """Step 3 with max_staleness 1 needs v1 or newer; worker-b's engine still serves v0 (its follower died, say):
    the learner names it instead of waiting silently."""
    from loopline.config import RolloutSettings
    from loopline.errors import LooplineError
    from loopline.pipeline import stages

    ledger.plan_step(db, run.id, 3, ["t0", "t1"], group_size=2)
    ledger.record_served(db, run.id, "worker-b:12:34", [stages.IN_PROCESS], 0)
    ledger.record_served(db, run.id, "worker-c:56:78", [stages.IN_PROCESS], 2)
    ctx = SimpleNamespace(run_id=run.id, session_factory=lambda: new_session(engine), rollout=RolloutSettings(max_staleness=1))
    until = time.monotonic() + 1.5
    with caplog.at_level("WARNING"):
        try:
            stages.wait_for_groups(ctx, 3, producing=lambda: time.monotonic() < until, poll_s=0.05, stall_report_s=0.5)
        except LooplineError:
            pass  # (the stand-in for a worker giving up, so that the wait ends)
    said = [r.getMessage() for r in caplog.records if "waits for" in r.getMessage()]
    assert said, caplog.text
    assert "learner step 3 waits for 2 groups" in said[0] and "start only on v1 or newer" in said[0]
    assert "worker-b:12:34 serves v0" in said[0] and "worker-c:56:78 serves v2" in said[0]
    assert "behind: worker-b:12:34 serves v0" in said[0] and "worker-c" not in said[0].split("behind:")[1]
