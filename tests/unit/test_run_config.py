"""Which versions a run writes to disk: every one another process must load, otherwise only what needs a file."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopline.errors import LooplineError
from loopline.flows.config import parse_config

BASE = {"name": "r", "env": "arithmetic@1", "steps": 10, "eval": {"every": 5}}


def _config(**overrides):
    return parse_config({**BASE, **overrides}, "test")


def test_an_in_process_engine_gets_exports_only_at_checkpoints_evaluations_and_the_end():
    config = _config(learner={"checkpoint_every": 4})
    assert config.exports_every == 4
    assert [v for v in range(11) if config.exports(v)] == [0, 4, 5, 8, 10]  # checkpoints 4, 8; evaluations 0, 5, 10


def test_every_version_is_exported_when_another_process_loads_it():
    servers = {"kind": "sglang", "servers": ["http://127.0.0.1:30000"]}
    for config in (_config(engine=servers), _config(mode="async", local_rollout=False)):
        assert config.versions_loaded_elsewhere and config.exports_every == 1
        assert all(config.exports(v) for v in range(11))
    assert _config(mode="async").exports_every == 4  # local rollout: the learner's process serves it


def test_a_sparse_export_for_a_run_that_other_processes_serve_is_refused():
    with pytest.raises(LooplineError, match="learner.export_every: 2: the SGLang servers load every version"):
        _config(engine={"kind": "sglang", "servers": ["http://h:1"]}, learner={"export_every": 2})
    assert _config(learner={"export_every": 3}).exports_every == 3


def test_deployed_rollout_workers_need_an_async_learner_without_local_rollout():
    with pytest.raises(LooplineError, match="rollout_workers: deployed workers feed an async learner"):
        _config(rollout_workers=2)
    with pytest.raises(LooplineError, match="rollout_workers"):
        _config(mode="async", rollout_workers=2)  # local_rollout defaults to true
    assert _config(mode="async", local_rollout=False, rollout_workers=2).exports_every == 1


def test_the_run_configs_demonstration_turns_replace_the_policys_own(tiny_dirs, tmp_path):
    """A policy's few-shot turns teach one env's tool syntax (smollm2-135m's: the calculator); a run on
    another env names its own, or none."""
    import json
    import shutil

    from loopline.envregistry.spec import load_spec
    from loopline.flows.assembly import build_setup

    policy = shutil.copytree(tiny_dirs["v0"], tmp_path / "policy")
    calc = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "<calc>1 + 2</calc>"}]
    (policy / "loopline_prompt.json").write_text(json.dumps({"few_shot": calc}))
    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml")
    code = [{"role": "user", "content": "Write `f`."}, {"role": "assistant", "content": '<write_file>{"path": "s.py"}</write_file>'}]

    def shown(**overrides):
        chat = build_setup(_config(**overrides), spec, 1, policy).chat
        return chat.few_shot, chat.decode(chat.initial_ids("", "What is 2 + 2?"))

    assert shown()[0] == tuple(calc)
    few_shot, prompt = shown(few_shot=code)
    assert few_shot == tuple(code) and "<write_file>" in prompt and "<calc>" not in prompt
    assert shown(few_shot=[])[0] == ()
    with pytest.raises(LooplineError, match="few_shot"):
        _config(few_shot=[{"role": "robot", "content": "x"}])


@pytest.mark.parametrize("name", ["arithmetic_quickstart.yaml", "smollm2_arithmetic.yaml", "coding_quickstart.yaml", "plan_7b_coding.yaml"])
def test_the_example_run_configs_load(name):
    from loopline.flows.config import load_config

    config, _ = load_config(Path(__file__).resolve().parents[2] / "examples" / name)
    assert config.name
