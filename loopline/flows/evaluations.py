"""A training run's held-out evaluations: every version the config schedules, once, including those a crash
between a learner commit and its evaluation left owed."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.utilities.annotations import quote

from loopline.failpoints import failpoint
from loopline.pipeline import assembly
from loopline.pipeline.tracking import Trackers
from loopline.store import ledger
from loopline.tasks import loop as tasks
from loopline.pipeline import stages


class Evaluations:
    def __init__(self, parts: assembly.RunParts, ctx: stages.LoopContext, trackers: Trackers):
        self.parts, self.ctx, self.trackers = parts, ctx, trackers
        self.tasks = parts.eval_tasks()

    def evaluate(self, engine) -> None:
        """The version `engine` serves, recorded in the ledger and the trackers."""
        ctx, config = self.ctx, self.parts.config
        failpoint("evaluate")
        # async: the local rollout worker starts no episode until the evaluation is done (they share the engine,
        # or on a resume's owed evaluation of an older version, the machine)
        ctx.evaluating.set()
        try:
            success = tasks.evaluate(
                ctx.run_id, quote(engine), quote(ctx.binding.setup), quote(ctx.session_factory), quote(self.tasks),
                self.parts.env_version, config.eval.temperature, config.eval.seed, config.rollout.concurrency, config.rollout.max_attempts,
            )
        finally:
            ctx.evaluating.clear()
        get_run_logger().info("policy v%d: held-out success %.1f%% on %d tasks", engine.version(), 100 * success, len(self.tasks))
        self.trackers.wake()

    def owed(self) -> None:
        """Every scheduled evaluation the ledger lacks, up to the served version (older versions get an engine
        of their own)."""
        ctx, config, log = self.ctx, self.parts.config, get_run_logger()
        owed = tasks.waiting_out_outages(lambda: stages.read(ctx, ledger.owed_evaluations, config.evaluates, ctx.engine.version()))
        for weights in owed:
            if weights.version == ctx.engine.version():
                self.evaluate(ctx.engine)
                continue
            if config.engine.servers:
                log.warning(
                    "v%d's evaluation is owed (an earlier process stopped before it), but the run's SGLang servers "
                    "serve v%d: evaluate it with an engine that can load it (loopline eval %s --version %d)",
                    weights.version, ctx.engine.version(), config.name, weights.version,
                )
                continue
            log.info("evaluating v%d, owed since an earlier process stopped before it", weights.version)
            engine = assembly.build_run_engine(self.parts, weights.uri, weights.version)
            try:
                self.evaluate(engine)
            finally:
                engine.shutdown()
