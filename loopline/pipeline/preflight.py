"""What a run config is refused for before the run exists, in a second or two: without Prefect, torch or
DeepSpeed (importing them alone takes ~6 s here; found after them, a refusal took 8-28 s).

`loopline train` calls `refuse_early` before anything starts; the train flow makes the same checks again
(with the policy in hand), so a run started from Python is refused the same way.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from loopline import plan
from loopline.config import RunConfig
from loopline.envregistry import registry
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline.errors import LooplineError
from loopline.policies.sources import policy_shape
from loopline.store import db as store_db
from loopline.store import migrate


def refuse_early(config: RunConfig, base: Path) -> None:
    """Every refusal a run config can get without its policy's weights: the environment (registered, or a
    valid file), what it asks of this machine (tasks, dtype, memory) and the SGLang servers it names."""
    if config.env_is_file:
        spec, tasks = (prepared := registry.prepare(base / config.env)).spec, prepared.tasks
    else:
        with store_db.session(migrate.open_ledger()) as s:
            row = registry.get(s, config.env)
            spec, tasks = registry.spec_of(row), registry.tasks_of(row)
    refuse_what_cannot_run(config, tasks)
    shape = policy_shape(config.policy, Path.cwd(), pulled_only=True)
    if shape is not None:
        require_fits(config, spec, shape)
    refuse_unreachable_servers(config)


def refuse_what_cannot_run(config: RunConfig, tasks: list[Task]) -> None:
    """What the config asks and this machine or environment cannot give (found at step 1 it would leave a run
    behind that can never go on)."""
    train = sum(t.split == "train" for t in tasks)
    if config.rollout.groups_per_step > train:
        raise LooplineError(
            f"run {config.name}: rollout.groups_per_step: {config.rollout.groups_per_step} is more than the {train} train tasks of "
            f"{config.env}; set it to at most {train}"
        )
    dtype = config.learner_config().dtype
    if dtype == "bf16" and not _gpu_has("bf16"):
        raise LooplineError(f"run {config.name}: learner.dtype: bf16 needs a GPU with bf16, and this machine has none; use fp32")
    if dtype == "fp16" and not _gpu_has("fp16"):
        raise LooplineError(f"run {config.name}: learner.dtype: fp16 needs a CUDA GPU, and this machine has none; use fp32")


def _gpu_has(dtype: str) -> bool:
    """Whether a CUDA GPU here computes in `dtype`."""
    if not plan.nvidia_device_present():
        return False
    from loopline.trainer.learner import bf16_supported, fp16_supported

    return bf16_supported() if dtype == "bf16" else fp16_supported()


def require_fits(config: RunConfig, spec: EnvSpec, shape: plan.ModelShape) -> plan.Plan:
    """The run's memory plan on this machine; a run that cannot fit is refused."""
    machine = plan.this_machine()
    memory = plan.estimate(shape, plan.workload(config, spec.budgets, 512, machine), machine)
    plan.require_fits(memory, config.name)
    return memory


def refuse_unreachable_servers(config: RunConfig) -> None:
    """SGLang servers that do not answer (they left a `failed` run behind)."""
    for url in config.engine.running_servers:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=10):
                pass
        except urllib.error.HTTPError:
            pass  # it answered (a server without /health, a router): reachable
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise LooplineError(f"run {config.name}: the SGLang server {url} does not answer ({reason}); start it, or fix engine.servers") from None
