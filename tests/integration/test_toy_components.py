"""A component registered from outside loopline (this module, as a user's plugin would) is a valid name in a run
config or env spec, shows in its JSON Schema, and is what runs: a toy advantage estimator, policy loss, loss
aggregation, KL estimator and off-policy correction (a learner step here), and a toy engine, sandbox backend, learner backend and
tracker (with the others, a whole training step of the train flow: test_train_flow.py), each touching nothing but its
own registration."""

from __future__ import annotations

import torch

from loopline.config import TRACKERS
from loopline.envregistry.sandbox.local import LocalSandbox
from loopline.envregistry.spec import SANDBOX_BACKENDS, LocalSettings
from loopline.rollout.engines.thread import EngineThread
from loopline.rollout.engines.registry import ENGINES, EngineKind, EngineRequest
from loopline.rollout.engines.local import LocalEngine
from loopline.trainer.backends import BACKENDS, TorchBackend
from loopline.trainer.config import AGGREGATIONS, CORRECTIONS, ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageSettings, LossSettings, Surrogate
from loopline.trainer.learner import Learner, LearnerConfig
from loopline.trainer.losses import CorrectionRule
from tests.integration.test_learner import rollout_sequences

CALLED: set[str] = set()


@ESTIMATORS.register("toy_sign")
def _sign(group: torch.Tensor, config: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    CALLED.add("estimator")
    return torch.sign(group - group.mean()), group.new_zeros(())


@POLICY_LOSSES.register("toy_reinforce")
def _reinforce(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, config: LossSettings) -> Surrogate:
    CALLED.add("policy loss")
    ratio = torch.exp(logp - old_logp)  # (unclipped: REINFORCE with importance weights)
    nothing = torch.zeros_like(mask, dtype=torch.bool)
    return Surrogate(-ratio * advantages, ratio, nothing, nothing)


@AGGREGATIONS.register("toy_sum")
def _sum(per_token, mask, total_tokens, total_sequences, sequence_tokens, config):
    CALLED.add("aggregation")
    return per_token.sum() / 1000.0


@KL_ESTIMATORS.register("toy_half_square")
def _half_square(log_ratio: torch.Tensor) -> torch.Tensor:
    CALLED.add("kl")
    return 0.5 * log_ratio**2


def _unit(rho: torch.Tensor, config: LossSettings) -> torch.Tensor:
    CALLED.add("correction")
    return torch.ones_like(rho)


CORRECTIONS.register("toy_unit")(CorrectionRule(_unit))


def _toy_engine(request: EngineRequest) -> EngineThread:
    CALLED.add("engine")
    return EngineThread(LocalEngine(request.weights, version=request.version, max_batch=request.concurrency))


ENGINES.register("toy_local")(EngineKind(_toy_engine, in_process=True))


@SANDBOX_BACKENDS.register("toy_dir", settings=LocalSettings)  # (a plugin's backend brings its settings: here the local one's)
async def _toy_sandbox(spec, labels, model) -> LocalSandbox:
    CALLED.add("sandbox")
    return LocalSandbox(spec)


@BACKENDS.register("toy_torch")
def _toy_backend(model, optimizer, scheduler, config, device) -> TorchBackend:
    CALLED.add("learner backend")
    return TorchBackend(model, optimizer, scheduler, config.grad_clip, device)


@TRACKERS.register("toy_list")
class _ToyTracker:
    def __init__(self, name, run_id, workdir, config, settings):
        pass

    def log(self, step, metrics):
        CALLED.add("tracker")

    def artifact(self, directory):
        pass

    def close(self):
        pass


# The run config and env spec a training step of them all takes (test_train_flow.py runs it).
TOY_LEARNER = {"backend": "toy_torch", "lr": 1e-3, "advantage": {"estimator": "toy_sign"},
               "loss": {"policy_loss": "toy_reinforce", "aggregation": "toy_sum", "kl_coef": 0.1, "kl_estimator": "toy_half_square", "correction": "toy_unit"}}
TOY_ENGINE = {"kind": "toy_local"}
TOY_SANDBOX = "toy_dir"
TOY_TRACKING = ["toy_list"]


def test_registered_toy_components_are_valid_config_names_and_run_a_learner_step(tiny_dirs):
    from loopline.config import RunConfig, parse_config

    config = parse_config({"name": "toys", "env": "env.yaml", "learner": TOY_LEARNER, "engine": TOY_ENGINE, "tracking": TOY_TRACKING}, "run.yaml")
    assert (config.learner.advantage.estimator, config.learner.loss.correction) == ("toy_sign", "toy_unit")
    learner = RunConfig.model_json_schema()["properties"]["learner"]["anyOf"][0]["allOf"][0]["properties"]  # (an editor's view)
    assert "toy_sign" in learner["advantage"]["anyOf"][0]["allOf"][0]["properties"]["estimator"]["enum"]
    assert "toy_half_square" in learner["loss"]["properties"]["kl_estimator"]["enum"]
    assert "toy_reinforce" in learner["loss"]["properties"]["policy_loss"]["enum"]
    engines = RunConfig.model_json_schema()["properties"]["engine"]["anyOf"]
    assert {"const": "toy_local"} in [e["allOf"][1]["properties"]["kind"] for e in engines] and config.engine.in_process
    learners = RunConfig.model_json_schema()["properties"]["learner"]["anyOf"]
    assert {"const": "toy_torch"} in [e["allOf"][1]["properties"]["backend"] for e in learners]
    assert "toy_list" in RunConfig.model_json_schema()["properties"]["tracking"]["items"]["anyOf"][0]["enum"]

    learner_config = LearnerConfig(lr=1e-3, micro_batch_tokens=64, advantage=config.learner.advantage, loss=config.learner.loss)
    learner = Learner(tiny_dirs["v0"], learner_config, backend="torch")
    before = learner.parameters_vector()
    result = learner.rl_step(rollout_sequences(tiny_dirs["v0"]))
    assert result.skipped is None and not torch.equal(before, learner.parameters_vector())
    assert {"estimator", "policy loss", "aggregation", "kl", "correction"} <= CALLED
    assert result.metrics["kl_ref"] == 0.0  # (the policy is its own reference at the first step)
