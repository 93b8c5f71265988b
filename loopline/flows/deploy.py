"""`loopline deploy`: serve the train, learner, evaluate and rollout_worker flows as Prefect deployments.

The serving process polls the Prefect server for scheduled or triggered runs and executes each in a
subprocess; keep it running (a terminal, a systemd unit). Trigger from Python with
`prefect.deployments.run_deployment("train/loopline-train", parameters={"config_path": ...})`.
"""

from __future__ import annotations

from prefect import serve
from prefect.settings import PREFECT_API_URL

from loopline.flows.evaluate import evaluate
from loopline.flows.train import learner, train
from loopline.flows.worker import rollout_worker
from loopline.errors import LooplineError

TRAIN, LEARNER, EVALUATE, WORKER = "loopline-train", "loopline-learner", "loopline-evaluate", "loopline-rollout-worker"


def deployments(
    config_path: str | None = None, train_cron: str | None = None, eval_run: str | None = None, eval_interval_s: float | None = None
) -> list:
    if train_cron and not config_path:
        raise LooplineError("--train-cron needs --config: a schedule must know which run config to train")
    if eval_interval_s and not eval_run:
        raise LooplineError("--eval-interval needs --eval-run: a schedule must know which run to evaluate")
    return [
        train.to_deployment(
            name=TRAIN, parameters={"config_path": config_path} if config_path else {}, cron=train_cron,
            description="Train or resume a run (sync or async); re-running resumes exactly once from the ledger.",
        ),
        learner.to_deployment(
            name=LEARNER, description="The learner alone, for async runs whose rollouts come from rollout_worker deployments.",
        ),
        evaluate.to_deployment(
            name=EVALUATE, parameters={"run": eval_run} if eval_run else {}, interval=eval_interval_s,
            description="Held-out success of a run's newest (or a given) policy version.",
        ),
        rollout_worker.to_deployment(
            name=WORKER, description="Generate rollouts for a run until it ends; start several to scale out.",
        ),
    ]


def serve_deployments(**kwargs) -> None:
    if not PREFECT_API_URL.value():
        raise LooplineError("no Prefect server: deployments need one that stays up; run `loopline server start` first")
    serve(*deployments(**kwargs))
