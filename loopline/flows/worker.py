"""The `rollout_worker` flow: generate for a run from any machine that reaches its ledger.

Start as many as you like (`loopline worker RUN`, or a deployment run by a Prefect work pool); they
claim slots of the same run from the ledger, never the same one. Each serves the run's newest
policy version, switching whenever the learner commits a new one, and respects the run's staleness
bound. A worker stops when the run is completed, failed or cancelled (or after `max_seconds`); an
interrupted run may be resumed, so its workers go on with the slots it planned.
"""

from __future__ import annotations

import logging
import threading
import time

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.utilities.annotations import quote

from loopline import aio, holder, stop_signals
from loopline.errors import LooplineError
from loopline.pipeline import assembly
from loopline.store import ledger
from loopline.store.errors import is_outage
from loopline.tasks import loop as tasks
from loopline.pipeline import stages

log = logging.getLogger(__name__)
DEPLOYMENT = "rollout_worker/loopline-rollout-worker"  # `loopline deploy` registers it under this name


class Follower(threading.Thread):
    """Serves each new version the learner commits, and sets `stop` when the worker must end: the run ended or was
    asked to cancel, `deadline` passed, or a version cannot be had (`failure` says why; the worker never goes on
    generating with a version the run can no longer use). A ledger outage is ridden out as long as the worker's
    tasks ride one out (LOOPLINE_RETRY_S); past that it is a failure too."""

    def __init__(self, ctx: stages.RolloutContext, stop: threading.Event, deadline: float | None, poll_s: float = 1.0):
        super().__init__(name="loopline-follow", daemon=True)
        self.ctx, self.stop, self.deadline, self.poll_s = ctx, stop, deadline, poll_s
        self.failure: BaseException | None = None

    def run(self) -> None:
        outage_since: float | None = None
        while not self.stop.wait(self.poll_s):
            try:
                if self._run_is_over():
                    break
                aio.run(stages.sync_weights(self.ctx))
                outage_since = None
            except Exception as exc:
                if self._ended_meanwhile():  # (a version the run no longer serves: the run is over, nothing failed)
                    break
                if is_outage(exc) and time.monotonic() - (outage_since or time.monotonic()) < sum(tasks.RETRY_DELAYS):
                    if outage_since is None:
                        log.warning("the ledger is unreachable (%s); the worker keeps its version until it is back", type(exc).__name__)
                    outage_since = outage_since or time.monotonic()
                    continue
                self.failure = exc
                break
        self.stop.set()

    def _ended_meanwhile(self) -> bool:
        try:
            return self._run_is_over()
        except Exception:
            return False

    def _run_is_over(self) -> bool:
        with self.ctx.session_factory() as s:
            run = ledger.get_run(s, self.ctx.run_id)
        over = run.status in ("completed", "failed", "cancelled") or run.cancel_requested_at is not None
        return over or (self.deadline is not None and time.monotonic() > self.deadline)


@flow(name="rollout_worker", **tasks.RESULT)
def rollout_worker(run: str, concurrency: int | None = None, max_seconds: float | None = None) -> dict:
    """Claim and play `run`'s slots until the run ends; returns what this worker committed."""
    with stop_signals.noted():  # (from the start: a stop during setup leaves as that stop; no retry once told to stop)
        return _rollout_worker(run, concurrency, max_seconds)


def _rollout_worker(run: str, concurrency: int | None, max_seconds: float | None) -> dict:
    logger = get_run_logger()
    parts = assembly.open_named_run(run)
    config, run_id = parts.config, parts.run_id
    if config.exports_every != 1:
        raise LooplineError(
            f"run {config.name} writes its weights to disk every {config.exports_every} versions (its learner's engine takes "
            "the others from memory), so a worker in another process could not follow it; start the run with "
            "`rollout: {mode: async, local_rollout: false}`, or set learner.export_every: 1"
        )
    rollout = config.rollout.model_copy(update={"concurrency": concurrency}) if concurrency else config.rollout
    ctx = stages.RolloutContext(
        run_id=run_id,
        session_factory=parts.session_factory(),
        engine=assembly.build_run_engine(parts, parts.state.weights_uri, parts.state.policy_version, rollout.concurrency, adapters=True),
        binding=assembly.build_binding(parts),
        rollout=rollout,
        adapters=config.syncs_adapters,
        weights=parts.weights,
    )
    stop = threading.Event()
    follower = Follower(ctx, stop, time.monotonic() + max_seconds if max_seconds else None)
    follower.start()
    name = holder.this_process()
    logger.info("worker %s generating for run %s (v%d)", name, config.name, ctx.engine.version())
    try:
        stats = tasks.rollout_worker(quote(ctx), stop, worker=name)
    finally:
        stop.set()
        follower.join(timeout=10)
        ctx.engine.shutdown()
        stages.release_servers(ctx)
    if follower.failure is not None:
        failure = follower.failure
        reason = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
        raise LooplineError(f"worker {name} stopped following run {config.name}: {reason}") from failure
    logger.info("worker %s: %d trajectories committed, %d infra failures", name, stats["committed"], stats["infra_failed"])
    return stats


class DeployedWorkers:
    """`count` rollout_worker flow runs for a run, submitted through the deployment (a work pool places them on
    whichever machines run `prefect worker start --pool ...`) and kept at `count`: a flow run that ended while
    the run still trains (crashed - its process died under a live Prefect worker -, failed, cancelled) is
    submitted again, at most `max_resubmits` times in all. A slot its worker held comes back through the
    ledger's lease. A machine lost with its Prefect worker leaves its flow run "Running" until the automation
    `loopline deploy --pool` installs marks it Crashed (no heartbeat for --silent-after s); then it is
    replaced like any other. The flow runs carry the tag
    `loopline-run:RUN`; a resumed train flow adopts those still scheduled or running (they outlive a
    killed trainer: a worker stops only when the run ends) instead of submitting `count` more."""

    def __init__(self, run: str, count: int, max_resubmits: int = 10, check_every_s: float = 5.0):
        self.run, self.count, self.max_resubmits, self.check_every_s = run, count, max_resubmits, check_every_s
        self.flow_runs: list = []
        self.resubmits = 0
        self._checked = 0.0

    @property
    def tag(self) -> str:
        return f"loopline-run:{self.run}"

    def _submit(self):
        try:
            return run_deployment(DEPLOYMENT, parameters={"run": self.run}, timeout=0, as_subflow=False, tags=[self.tag]).id
        except ObjectNotFound:
            raise LooplineError(
                f"run {self.run} asks for rollout.workers, but this Prefect server has no {DEPLOYMENT} deployment: run "
                "`loopline server start`, `loopline deploy --pool NAME`, and `prefect worker start --pool NAME` on the machines"
            ) from None

    def start(self) -> None:
        adopted = self._unfinished()[: self.count]
        if adopted:
            get_run_logger().info("run %s: %d rollout worker flow runs are still scheduled or running; adopting them", self.run, len(adopted))
        self.flow_runs = adopted + [self._submit() for _ in range(self.count - len(adopted))]

    def _unfinished(self) -> list:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, FlowRunFilterTags
        from prefect.client.schemas.objects import StateType

        live = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[self.tag]), state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live))
            ))
        return [r.id for r in runs]

    def alive(self) -> bool:
        """The learner's `producing` check: resubmits ended flow runs; raises when it gave up."""
        if time.monotonic() - self._checked < self.check_every_s:
            return True
        self._checked = time.monotonic()
        with get_client(sync_client=True) as client:
            states = [client.read_flow_run(flow_run).state for flow_run in self.flow_runs]
        for i, state in enumerate(states):
            if state is None or not state.is_final():
                continue
            why = f"{state.name}: {state.message.splitlines()[0]}" if state.message else state.name
            if self.resubmits >= self.max_resubmits:
                raise LooplineError(f"run {self.run}: rollout worker flow runs ended {self.resubmits + 1} times (the last {why}); giving up")
            get_run_logger().warning("rollout worker flow run %s ended (%s) while run %s trains; submitting another", self.flow_runs[i], why, self.run)
            self.flow_runs[i] = self._submit()
            self.resubmits += 1
        return True
