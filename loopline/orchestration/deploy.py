"""`loopline deploy`: the train, learner, evaluate and rollout_worker flows as Prefect deployments.

Two ways to run them. Without `--pool`, this process serves them (one machine): it polls the Prefect
server for scheduled or triggered runs and executes each in a subprocess; keep it running. With
`--pool NAME`, the deployments are registered on a Prefect work pool (created if missing) and any
machine that runs `prefect worker start --pool NAME` - and reaches the ledger and the Prefect API -
executes them; the flows are imported from the installed `loopline` package (module-path
entrypoints: no image and no code storage for a process pool). Trigger from Python with
`prefect.deployments.run_deployment("train/loopline-train", parameters={"config_path": ...})`.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.deployments.runner import EntrypointType
from prefect.exceptions import ObjectNotFound
from prefect.runner import Runner
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

from loopline.orchestration import server
from loopline.flows.evaluate import evaluate
from loopline.flows.train import learner, train
from loopline.flows.worker import DEPLOYMENT as WORKER_DEPLOYMENT
from loopline.flows.worker import rollout_worker
from loopline.errors import LooplineError
from loopline.stop_signals import STOP_SIGNALS, exit_at_once

TRAIN, LEARNER, EVALUATE, WORKER = "loopline-train", "loopline-learner", "loopline-evaluate", WORKER_DEPLOYMENT.split("/")[1]


POOL_TYPES = ("process", "docker", "kubernetes")


def deployments(
    config_path: str | None = None, train_cron: str | None = None, eval_run: str | None = None, eval_interval_s: float | None = None,
    entrypoint_type: EntrypointType = EntrypointType.FILE_PATH,
) -> list:
    if train_cron and not config_path:
        raise LooplineError("--train-cron needs --config: a schedule must know which run config to train")
    if eval_interval_s and not eval_run:
        raise LooplineError("--eval-interval needs --eval-run: a schedule must know which run to evaluate")
    return [
        train.to_deployment(
            entrypoint_type=entrypoint_type,
            name=TRAIN, parameters={"config_path": config_path} if config_path else {}, cron=train_cron,
            description="Train or resume a run (sync or async); re-running resumes exactly once from the ledger.",
        ),
        learner.to_deployment(
            entrypoint_type=entrypoint_type,
            name=LEARNER, description="The learner alone, for async runs whose rollouts come from rollout_worker deployments.",
        ),
        evaluate.to_deployment(
            entrypoint_type=entrypoint_type,
            name=EVALUATE, parameters={"run": eval_run} if eval_run else {}, interval=eval_interval_s,
            description="Held-out success of a run's newest (or a given) policy version.",
        ),
        rollout_worker.to_deployment(
            entrypoint_type=entrypoint_type,
            name=WORKER, description="Generate rollouts for a run until it ends; start several to scale out.",
        ),
    ]


def _require_server() -> None:
    api = PREFECT_API_URL.value()
    if not api:
        raise LooplineError("no Prefect server: deployments need one that stays up; run `loopline server start` first")
    if not server.healthy(api):  # (was a 200-line ConnectError traceback)
        raise LooplineError(
            f"the Prefect server at {api} does not answer; start it (`loopline server start`), or point PREFECT_API_URL at one that runs"
        )


def serve_deployments(**kwargs) -> int:
    """Serve the deployments here until a stop signal; returns that signal (Ctrl-C, SIGTERM, SIGHUP) once the
    schedules are paused and the runs in flight cancelled (Prefect's `Runner.astop`).

    Not Prefect's `serve()`: it takes Ctrl-C as a KeyboardInterrupt raised wherever the main thread is, and measured
    in CI (1 stop in ~50) one raised inside the runner's event loop was lost: the command served on after the
    Ctrl-C, printing nothing. Here each stop signal reaches the loop as a callback (`loop.add_signal_handler`),
    which stops the runner the way Prefect's own SIGTERM handler does; a second one leaves at once."""
    _require_server()
    served = deployments(**kwargs)
    return asyncio.run(_serve_until_stopped(served))


async def _serve_until_stopped(served: list) -> int:
    loop = asyncio.get_running_loop()
    runner = Runner(pause_on_shutdown=True)
    asked: list[int] = []
    serving: list[asyncio.Task] = []

    async def stop_once_started() -> None:  # (astop refuses a runner that has not started; one starting is waited for)
        while serving and not runner.started and not serving[0].done():
            await asyncio.sleep(0.05)
        if runner.started:
            await runner.astop()

    def stop(signum: int) -> None:
        if asked:  # a second stop while the first pauses the schedules (a user pressing Ctrl-C again): out now
            exit_at_once(signum)
        asked.append(signum)
        loop.create_task(stop_once_started())

    def listen() -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    listen()
    try:
        for deployment in served:
            await runner.aadd_deployment(deployment)
        if not asked:
            _say_served(served)
            serving.append(asyncio.ensure_future(runner.start()))
            await asyncio.sleep(0)  # its first step puts Prefect's own SIGTERM handler in place (`Runner.start`): ours again
            listen()
            await serving[0]
    finally:
        for sig, handler in previous.items():  # (the loop's removal would leave SIG_DFL: the CLI's handlers again)
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
    if not asked:
        raise LooplineError("Prefect's runner stopped serving on its own (its log above says why); run `loopline deploy` again")
    return asked[0]


def _say_served(served: list) -> None:
    from rich.console import Console

    ui = PREFECT_UI_URL.value()
    Console().print(
        "[green]Your deployments are being served and polling for scheduled runs![/]\n"
        + "".join(f"  {d.flow_name}/{d.name}\n" for d in served)
        + "Trigger one with `prefect deployment run NAME`"
        + (f" or in the Prefect UI: {ui}/deployments" if ui else "")
        + "; Ctrl-C pauses their schedules and stops serving.",
        soft_wrap=True, highlight=False,
    )


def ensure_work_pool(name: str, pool_type: str = "process", base_job_template: Path | None = None) -> bool:
    """Create the work pool unless it exists (then it is left as it is); True when it was created."""
    if pool_type not in POOL_TYPES:
        raise LooplineError(f"--pool-type {pool_type}: expected one of {', '.join(POOL_TYPES)}")
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_work_pool(name)
        except ObjectNotFound:
            existing = None
        if existing is not None:
            if existing.type != pool_type:
                raise LooplineError(f"work pool {name!r} exists with type {existing.type}, not {pool_type}; pick another name")
            return False
        if base_job_template is not None:
            try:
                template = json.loads(Path(base_job_template).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise LooplineError(f"--base-job-template {base_job_template}: {exc}") from None
        else:
            from prefect.utilities.asyncutils import run_coro_as_sync

            template = run_coro_as_sync(get_default_base_job_template_for_infrastructure_type(pool_type))
            if template is None:
                raise LooplineError(f"Prefect has no default job template for {pool_type} pools here; pass --base-job-template")
        client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))
        return True


HEARTBEAT_S = 30  # Prefect's shortest flow-run heartbeat interval (its default is 180 s)
SILENT_AFTER_S = 90  # three missed heartbeats: the flow run's machine is taken to be gone


def deploy_to_pool(
    pool: str, pool_type: str = "process", base_job_template: Path | None = None, silent_after_s: float = SILENT_AFTER_S, **kwargs
) -> list[str]:
    """Register the four deployments on work pool `pool` (created if missing); returns their names.
    Re-running updates them in place (Prefect matches a deployment by flow and name).

    A machine that vanishes (power, network, eviction) leaves its flow run "Running": no process is left to
    report the crash. The deployments' flow runs send a heartbeat every HEARTBEAT_S, and an automation marks
    one Crashed after `silent_after_s` without one (Prefect's documented zombie detection), so that the
    train flow resubmits a lost rollout worker as it does a crashed one."""
    if silent_after_s < 1.2 * HEARTBEAT_S:
        raise LooplineError(f"--silent-after {silent_after_s:g}: at least {1.2 * HEARTBEAT_S:g} s (heartbeats come every {HEARTBEAT_S} s)")
    _require_server()
    ensure_work_pool(pool, pool_type, base_job_template)
    names, ids = [], []
    for deployment in deployments(entrypoint_type=EntrypointType.MODULE_PATH, **kwargs):
        deployment.job_variables = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S)}}
        ids.append(deployment.apply(work_pool_name=pool))
        names.append(f"{deployment.flow_name}/{deployment.name}")
    ensure_silent_runs_crash(pool, ids, silent_after_s)
    return names


def ensure_silent_runs_crash(pool: str, deployment_ids: list, silent_after_s: float) -> None:
    """The automation (one per pool, replaced on every deploy) that marks a silent flow run of these deployments Crashed."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    name = f"loopline {pool}: crash silent flow runs"
    automation = Automation(
        name=name,
        description=f"A flow run of loopline's deployments on {pool} that sent no heartbeat for {silent_after_s:g} s lost its machine.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed"))},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "deployment", "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids]}
            ),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=silent_after_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED, message=f"no heartbeat for {silent_after_s:g} s: its machine is gone (loopline deploy --pool {pool})",
        )],
    )
    try:
        Automation.read(name=name).delete()
    except ValueError:  # none yet
        pass
    automation.create()
