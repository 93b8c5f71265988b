"""Which versions a run writes to disk: every one another process must load, otherwise only what needs a file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loopline.errors import LooplineError
from loopline.config import parse_config

BASE = {"name": "r", "env": "arithmetic@1", "steps": 10, "eval": {"every": 5}}


def _config(**overrides):
    return parse_config({**BASE, **overrides}, "test")


def test_an_in_process_engine_gets_exports_only_at_checkpoints_evaluations_and_the_end():
    config = _config(learner={"checkpoint_every": 4})
    assert config.exports_every == 4
    assert [v for v in range(11) if config.exports(v)] == [0, 4, 5, 8, 10]  # checkpoints 4, 8; evaluations 0, 5, 10


def test_every_version_is_exported_when_another_process_loads_it():
    servers = {"kind": "sglang", "servers": ["http://127.0.0.1:30000"]}
    for config in (_config(engine=servers), _config(rollout={"mode": "async", "local_rollout": False})):
        assert config.versions_loaded_elsewhere and config.exports_every == 1
        assert all(config.exports(v) for v in range(11))
    assert _config(rollout={"mode": "async"}).exports_every == 4  # local rollout: the learner's process serves it


def test_a_sparse_export_for_a_run_that_other_processes_serve_is_refused():
    with pytest.raises(LooplineError, match="learner.export_every: 2: the sglang servers load every version"):
        _config(engine={"kind": "sglang", "servers": ["http://h:1"]}, learner={"export_every": 2})
    assert _config(learner={"export_every": 3}).exports_every == 3


def test_deployed_rollout_workers_need_an_async_learner_without_local_rollout():
    with pytest.raises(LooplineError, match="rollout: workers: deployed workers feed an async learner"):
        _config(rollout={"workers": 2})
    with pytest.raises(LooplineError, match="workers: deployed workers"):
        _config(rollout={"mode": "async", "workers": 2})  # local_rollout defaults to true
    assert _config(rollout={"mode": "async", "local_rollout": False, "workers": 2}).exports_every == 1


def test_the_layout_before_sections_is_read_as_the_sections_and_a_file_in_it_says_where_each_setting_goes(tmp_path, caplog):
    """Configs stored and written before the run config had sections still mean what they meant: the recorded
    one (as loopline stored it at bd0252b) is the same config as its sectioned form, and a file in the old layout
    loads with one warning naming where each of its settings goes now."""
    import json
    import logging

    from loopline.config import FLAT_ROLLOUT, load_config

    recorded = json.loads((Path(__file__).resolve().parents[1] / "data" / "run_config_stored_at_bd0252b.json").read_text())
    sectioned = {k: v for k, v in recorded.items() if k not in FLAT_ROLLOUT}
    sectioned["rollout"] = {FLAT_ROLLOUT[k]: v for k, v in recorded.items() if k in FLAT_ROLLOUT}
    old = parse_config(recorded, "stored")
    assert old == parse_config(sectioned, "new") and old.rollout.lease_seconds == 30.0 and old.rollout.group_size == 4
    assert parse_config({**BASE, "mode": "async", "local_rollout": False, "rollout_workers": 2}, "old").rollout.workers == 2

    (tmp_path / "e.yaml").write_text("name: e\n")
    (tmp_path / "run.yaml").write_text("name: x\nenv: e.yaml\ngroups_per_step: 4\nsampling: {temperature: 0.5}\n")
    with caplog.at_level(logging.WARNING, logger="loopline.config"):
        config, _ = load_config(tmp_path / "run.yaml")
    assert (config.rollout.groups_per_step, config.rollout.sampling.temperature) == (4, 0.5)
    assert [r.getMessage().replace(str(tmp_path) + "/", "") for r in caplog.records] == [
        "run.yaml: groups_per_step, sampling: the layout before sections, read as rollout.groups_per_step, "
        "rollout.sampling; move them under rollout:"
    ]


def test_mixed_precision_is_deepspeeds_and_fp16_runs_under_zero():
    """The torch backend trains in fp32 in one process: precision and ranks are DeepSpeed's settings, refused
    elsewhere by name (a dtype there was dropped silently once); fp16's loss scaler needs ZeRO's unscaled gradient
    norm, so stage 0 is refused with it."""
    with pytest.raises(LooplineError, match=r"learner.dtype: not a setting here; it is one of learner \(backend: deepspeed\)"):
        _config(learner={"dtype": "bf16", "backend": "torch"})
    with pytest.raises(LooplineError, match=r"learner.launch: not a setting here; it is one of learner \(backend: deepspeed\)"):
        _config(learner={"launch": {"ranks_per_node": 2}, "backend": "torch"})
    stored = _config(learner={"backend": "torch"}).model_dump(mode="json")
    stored["learner"] |= {"dtype": "fp32", "zero_stage": None, "launch": None}  # (as stored before: a torch run resumes)
    assert parse_config(stored, "stored") == _config(learner={"backend": "torch"})
    with pytest.raises(LooplineError, match="dtype: fp16 runs under ZeRO"):
        _config(learner={"dtype": "fp16", "zero_stage": 0})
    config = _config(learner={"dtype": "fp16"}).learner_config()
    assert (config.dtype, config.zero_stage) == ("fp16", None)  # (the backend picks stage 1 for fp16)


def test_the_run_configs_demonstration_turns_replace_the_policys_own(tiny_dirs, tmp_path):
    """A policy's few-shot turns teach one env's tool syntax (smollm2-135m's: the calculator); a run on
    another env names its own, or none."""
    import json
    import shutil

    from loopline.envregistry.spec import load_spec
    from loopline.pipeline.assembly import build_setup

    policy = shutil.copytree(tiny_dirs["v0"], tmp_path / "policy")
    calc = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "<calc>1 + 2</calc>"}]
    (policy / "loopline_prompt.json").write_text(json.dumps({"few_shot": calc}))
    spec = load_spec(Path(__file__).resolve().parents[2] / "examples" / "arithmetic_env.yaml")
    code = [{"role": "user", "content": "Write `f`."}, {"role": "assistant", "content": '<write_file>{"path": "s.py"}</write_file>'}]

    def shown(**overrides):
        chat = build_setup(_config(**overrides), spec, 1, policy).chat
        return chat.few_shot, chat.decode(chat.initial_ids("", "What is 2 + 2?"))

    assert shown()[0] == tuple(calc)
    few_shot, prompt = shown(rollout={"few_shot": code})
    assert few_shot == tuple(code) and "<write_file>" in prompt and "<calc>" not in prompt
    assert shown(rollout={"few_shot": []})[0] == ()
    with pytest.raises(LooplineError, match="rollout.few_shot.0.role"):
        _config(rollout={"few_shot": [{"role": "robot", "content": "x"}]})


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RUN_CONFIGS = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml") if not p.name.endswith("_env.yaml"))


@pytest.mark.parametrize("name", RUN_CONFIGS)
def test_the_example_run_configs_load(name, monkeypatch):
    from loopline.config import load_config

    monkeypatch.syspath_prepend(str(EXAMPLES / "plugins"))  # (the plugin example's module, on PYTHONPATH as its header says)
    config, _ = load_config(EXAMPLES / name)
    assert config.name and (EXAMPLES / name).parent.joinpath(config.env).is_file()  # (its env is beside it)


def test_how_a_run_ended_is_told_in_its_status_and_one_line():
    from prefect.exceptions import TerminationSignal

    from loopline.pipeline.lifecycle import how_it_ended

    assert how_it_ended(None, False) == ("completed", None)
    assert how_it_ended(KeyboardInterrupt(), False)[0] == "interrupted"
    assert how_it_ended(KeyboardInterrupt(), True) == ("cancelled", "cancelled (loopline cancel)")
    assert how_it_ended(TerminationSignal(signal=15), False)[1].startswith("terminated (SIGTERM)")
    assert how_it_ended(MemoryError(), False) == ("failed", "MemoryError: ")
    status, reason = how_it_ended(RuntimeError("the ledger is out of reach\n  at line 2"), False)
    assert (status, reason) == ("failed", "RuntimeError: the ledger is out of reach")


def test_a_running_run_whose_process_is_gone_or_silent_shows_as_stale():
    from loopline.store.queries import HEARTBEAT_S, shown_status

    assert shown_status("running", "nosuchhost:1:1", 5.0, 60.0) == ("running", None)
    assert shown_status("running", "nosuchhost:1:1", 61.0, 60.0)[0] == "stale"  # silent past the lease
    assert shown_status("running", "nosuchhost:1:1", 2.5 * HEARTBEAT_S, 3.0) == ("running", None)  # never before 3 missed beats
    assert shown_status("running", "nosuchhost:1:1", 3.5 * HEARTBEAT_S, 3.0)[0] == "stale"
    import socket

    assert shown_status("running", f"{socket.gethostname()}:999999999:1", 1.0, 60.0)[0] == "stale"  # its pid is gone here
    assert shown_status("completed", None, None, 60.0) == ("completed", None)


def test_a_user_error_inside_a_flow_reaches_the_terminal_once_as_one_line(capsys):
    """Prefect logs a flow's exception with a traceback and again in its final state; `friendly_errors` prints
    a LooplineError once, as one line, and Prefect's copies of it are dropped (other errors keep theirs)."""
    import logging

    from loopline.cli_support import friendly_errors

    logger = logging.getLogger("prefect.flow_runs")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO

    @friendly_errors
    def command(exc: Exception) -> None:
        try:
            raise exc
        except Exception:
            logger.error("Encountered exception during execution", exc_info=True)
            logger.info(f"Finished in state Failed('Flow run encountered an exception: {type(exc).__name__}: {exc}')")
            raise

    try:
        with pytest.raises(SystemExit):
            command(LooplineError("v3 was never exported; set learner.export_every: 1"))
        assert seen == [] and capsys.readouterr().err.strip().splitlines() == ["error: v3 was never exported; set learner.export_every: 1"]
        with pytest.raises(RuntimeError):
            command(RuntimeError("a bug"))
        assert len(seen) == 2
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_bad_run_config_is_refused_before_torch_or_prefect_load(tmp_path):
    """Refused in a second or two, not after ~10 s of imports (what the user waits for on a typo): neither torch
    nor Prefect is imported, one line says why, and no run exists. Measured before: an unknown policy, bf16 on
    a CPU and a run that cannot fit were refused after 8-28 s, a registered env that is not there after ~15 s."""
    import subprocess
    import sys

    from loopline import plan

    ROOT = Path(__file__).resolve().parents[2]
    probe = (
        "import sys\nfrom loopline.cli import app\ntry:\n    app(['train', sys.argv[1]])\nexcept SystemExit as exit:\n"
        "    print('exit', exit.code, 'torch' in sys.modules, 'prefect' in sys.modules)"
    )
    home = tmp_path / "home"
    env = {**os.environ, "LOOPLINE_HOME": str(home), "HF_HUB_OFFLINE": "1"}  # (the embedded ledger, as a user's default)
    env.pop("LOOPLINE_DATABASE_URL", None)
    arithmetic = f"env: {ROOT / 'examples' / 'arithmetic_env.yaml'}\n"
    cases = [
        ("env: e.yaml\nrollout: {group_size: 1}\n", "rollout.group_size"),
        ("env: nosuch@3\n", "no environment named 'nosuch'"),
        (arithmetic + "policy: nobody/no-such-model\n", "policy 'nobody/no-such-model': not in the Hugging Face cache"),
        (arithmetic + f"policy: {tmp_path / 'nowhere'}\n", "not 'tiny', 'smollm2-135m', a model directory with config.json"),
        (arithmetic + "rollout: {groups_per_step: 5000}\n", "rollout.groups_per_step: 5000 is more than the 2000 train tasks"),
        (arithmetic + "rollout: {group_size: 100000}\n", "would run out of memory"),
        (arithmetic + "engine: {kind: sglang, servers: ['http://127.0.0.1:9']}\n", "the SGLang server http://127.0.0.1:9 does not answer"),
    ]
    if not plan.nvidia_device_present():
        cases.append((arithmetic + "learner: {dtype: bf16}\n", "bf16 needs a GPU with bf16, and this machine has none"))
    started = []  # (all at once: each is its own process and refuses its own file)
    for k, (text, says) in enumerate(cases):
        bad = tmp_path / f"run{k}.yaml"
        bad.write_text("name: x\n" + text)
        started.append((subprocess.Popen([sys.executable, "-c", probe, str(bad)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), says))
    for process, says in started:
        stdout, stderr = process.communicate(timeout=120)
        assert says in stderr and stdout.split() == ["exit", "1", "False", "False"], stdout + stderr
        assert stderr.startswith("error: ") and "Traceback" not in stderr, stderr
    assert not (home / "runs").exists()


def test_a_ledger_outage_reaches_the_terminal_as_one_line_and_prefects_retries_without_tracebacks(capsys):
    import logging

    import psycopg
    import sqlalchemy.exc

    from loopline.cli_support import _UserErrorsOnce, friendly_errors

    lost = sqlalchemy.exc.OperationalError("SELECT 1", {}, psycopg.OperationalError("server closed the connection unexpectedly"))

    @friendly_errors
    def command() -> None:
        raise lost

    with pytest.raises(SystemExit) as exit:
        command()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 1 and len(lines) == 1 and lines[0].startswith("error: the ledger could not be reached (")
    assert "loopline train --resume RUN" in lines[0]
    lost = sqlalchemy.exc.OperationalError("UPDATE", {}, psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"))
    with pytest.raises(SystemExit) as exit:
        command()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 1 and len(lines) == 1 and "kept a row of the ledger locked past the lock timeout" in lines[0], lines

    retry = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed; retry 1/8 in 2 s", None, (type(lost), lost, None))
    assert _UserErrorsOnce().filter(retry) and retry.exc_info is None  # the line stays, its traceback goes


def test_a_sandbox_that_kept_failing_reaches_the_terminal_as_one_line_that_says_what_to_do(capsys):
    """Seen with an agent program that could not import its framework: its evaluation's episodes failed every
    retry, and the user got two rich tracebacks (Prefect's and the CLI's) around the one line that mattered."""
    import logging

    from loopline.cli_support import _UserErrorsOnce, friendly_errors
    from loopline.envregistry.sandbox.base import InfraFailure

    failed = InfraFailure("the agent program `python3 agent.py` never called the model (exit 1: No module named smolagents)")

    @friendly_errors
    def command() -> None:
        raise failed

    with pytest.raises(SystemExit) as exit:
        command()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 1 and lines == [
        "error: a sandbox kept failing: the agent program `python3 agent.py` never called the model (exit 1: No module named "
        "smolagents); check the environment on its own (`envreg test ENV`), then run the command again (nothing committed is "
        "lost; a run resumes where it stopped)"
    ]
    retry = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed; retry 7/7", None, (InfraFailure, failed, None))
    assert _UserErrorsOnce().filter(retry) and retry.exc_info is None



def test_train_takes_a_config_as_a_dict_or_a_runconfig_from_python(tmp_path, monkeypatch):
    """`train(config)` from Python: a dict or RunConfig becomes a file the flow can pass on (relative env and
    policy paths made absolute: the file lives elsewhere), and Prefect accepts it as the flow's parameter."""
    import yaml

    from loopline.config import RunConfig, config_file, load_config
    from loopline.flows.train import train

    ROOT = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(ROOT)
    data = {"name": "from-python", "env": "examples/arithmetic_env.yaml", "steps": 2}
    path = config_file(data, tmp_path / "configs")
    loaded, _ = load_config(path)
    assert loaded.env == str(ROOT / "examples" / "arithmetic_env.yaml") and loaded.steps == 2
    assert config_file(RunConfig.model_validate(data), tmp_path / "other") and config_file("x.yaml", tmp_path) == "x.yaml"
    assert yaml.safe_load(open(path))["name"] == "from-python"
    train.validate_parameters({"config_path": data})  # the flow's parameter takes it
    train.validate_parameters({"config_path": RunConfig.model_validate(data)})
    with pytest.raises(Exception, match="env: nowhere.yaml not found"):
        config_file({**data, "env": "nowhere.yaml"}, tmp_path)


# the config's YAML text -> what the one-line refusal must contain (its file:line, the field, what is wrong)
BAD_CONFIGS = {
    "lr_infinite": ("learner: {lr: .inf}\n", "run.yaml:3: learner.lr: Input should be a finite number"),
    "temperature_infinite": ("rollout:\n  sampling: {temperature: .inf}\n", "run.yaml:4: rollout.sampling.temperature: Input should be a finite number"),
    "old_layout_line": ("steps: 3\nsampling: {temperature: .inf}\n", "run.yaml:4: rollout.sampling.temperature: Input should be a finite number"),
    "old_layout_twice": ("group_size: 4\nrollout: {group_size: 8}\n", "group_size is set twice: at the top level (the layout before sections) and as rollout.group_size"),
    "misspelt_rollout_setting": ("rollout: {grup_size: 4}\n", "rollout.grup_size: unknown setting; did you mean group_size?"),
    "clip_low_nan": ("learner: {loss: {clip_low: .nan}}\n", "learner.loss.clip_low: Input should be a finite number"),
    "negative_kl_coef": ("learner: {loss: {kl_coef: -0.1}}\n", "kl_coef must be >= 0"),
    "negative_clip_high": ("learner: {loss: {clip_high: -5}}\n", "clip_high must be >= 0"),
    "steps_true": ("steps: true\n", "steps: expected a number, got true"),
    "duplicate_steps": ("steps: 3\nsteps: 4\n", "run.yaml:4: duplicate key 'steps' (first on line 3)"),
    "misspelt_setting": ("stpes: 3\n", "run.yaml:3: stpes: unknown setting; did you mean steps?"),
    "misspelt_nested_setting": ("learner: {loss: {kl_coeff: 0.1}}\n", "did you mean kl_coef?"),
    "a_list": ("- 1\n", "expected a mapping of run settings"),
    "setting_of_another_section": ("rollout: {lr: 0.1}\n", "run.yaml:3: rollout.lr: not a setting here; it is one of learner"),
    "setting_of_another_engine": ("engine: {kind: local, servers: ['http://h:1']}\n",
                                  "run.yaml:3: engine.servers: not a setting here; it is one of engine (kind: sglang)"),
    "sglang_with_neither_source": ("engine: {kind: sglang}\n", "engine: kind: sglang needs exactly one of servers"),
    "fifty_megabytes": ("description: '" + "x" * (50 << 20) + "'\n", "a run config may be at most 1,048,576 bytes"),
    # (issue 65: each of these trained)
    "negative_eps": ("learner: {advantage: {eps: -1.0}}\n", "run.yaml:3: learner.advantage.eps: Input should be greater than 0"),
    "warmup_past_the_run": ("steps: 2\nlearner: {warmup_steps: 1000000000000}\n", "run.yaml:4: learner.warmup_steps: 1000000000000 is more than the run's 2 optimizer steps"),
    "steps_past_the_ledger": ("steps: 99999999999999999999999\n", "run.yaml:3: steps: Input should be less than or equal to 1000000"),
    "a_section_true": ("learner: true\n", "run.yaml:3: learner: expected its settings (a mapping), got true"),
    "dual_clip_of_gspo": ("learner: {loss: {policy_loss: gspo, clip_ratio_c: 2}}\n", "learner.loss.clip_ratio_c: not a setting here; it is one of learner.loss (policy_loss: vanilla)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_run_config_is_one_line_naming_the_file_line_and_field(case, tmp_path):
    from loopline.config import load_config

    text, says = BAD_CONFIGS[case]
    (tmp_path / "e.yaml").write_text("name: e\n")
    path = tmp_path / "run.yaml"
    path.write_text(text if text.startswith("-") else "name: x\nenv: e.yaml\n" + text)
    with pytest.raises(LooplineError) as refused:
        load_config(path)
    assert says in str(refused.value).replace(str(tmp_path) + "/", ""), str(refused.value)


def test_a_hang_up_is_told_in_the_runs_status():
    import signal

    from loopline.pipeline.lifecycle import how_it_ended

    assert how_it_ended(SystemExit(128 + signal.SIGHUP), False) == (
        "interrupted", "hung up (SIGHUP: its terminal closed); resume with loopline train --resume RUN"
    )


def test_loopline_schema_prints_the_run_configs_json_schema_that_validates_the_examples():
    import json
    import subprocess
    import sys

    import jsonschema
    import yaml

    done = subprocess.run([sys.executable, "-m", "loopline.cli", "schema"], capture_output=True, text=True, timeout=120)
    schema = json.loads(done.stdout)
    assert {"steps", "rollout", "learner", "eval"} <= set(schema["properties"])
    for example in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*quickstart*.yaml")):
        jsonschema.validate(yaml.safe_load(example.read_text()), schema)  # an editor would accept each example
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "x", "env": "e.yaml", "stpes": 3}, schema)


def test_every_run_config_and_env_spec_setting_says_what_it_is_for():
    """`loopline schema`, `envreg schema` (an editor's completion) and the docs' reference show each setting's
    description: one without reaches users unexplained. The reference generator refuses it; here it walks every
    section, each component's own settings (`learner.loss`'s vanilla and mis / rejection, `learner.advantage`'s grpo)
    and the trainer's dataclass (`learner.lora`) included."""
    import sys

    from loopline.config import RunConfig
    from loopline.envregistry.spec import EnvSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        from docs_reference import settings_reference
    finally:
        sys.path.pop(0)
    page = settings_reference(RunConfig, "Run config", "")
    assert {"## `learner.loss` (every policy_loss, correction, aggregation, kl_estimator)", "## `learner.loss` (policy_loss: vanilla: these as well)",
            "## `learner.loss` (correction: mis / rejection: these as well)", "## `learner.advantage` (estimator: grpo: these as well)",
            "## `learner.lora`", "## `engine.launch`"} <= {line.split(" {#")[0] for line in page.splitlines()}
    assert "| `clip_high` | float | `0.28` |" in page and "| `correction_bounds` | `upper` / `two_sided` | `\"upper\"` |" in page
    settings_reference(EnvSpec, "Environment spec", "")


def test_an_engine_brings_its_own_settings_and_a_config_stored_before_that_still_reads(monkeypatch):
    """A registered engine's settings model validates its `engine:` section (errors keep their paths); the run's
    code gets that model, and the reference and schema list its fields. A config stored before engines had
    settings of their own (SGLang's fields at their defaults under every engine) reads as the same config."""
    from pydantic import Field

    from loopline.config import RunConfig, parse_config
    from loopline.rollout.engines import registry as engines
    from loopline.rollout.engines.registry import ENGINES, EngineKind, EngineSettings

    class Batched(EngineSettings):
        max_batch: int = Field(4, ge=1, description="requests per forward")

    monkeypatch.setattr(ENGINES, "names", [*ENGINES.names])
    monkeypatch.setattr(ENGINES, "_implementations", dict(ENGINES._implementations))
    monkeypatch.setattr(ENGINES, "_settings", dict(ENGINES._settings))
    ENGINES.register("batched", settings=Batched)(EngineKind(engines._local, in_process=True))
    base = {"name": "a", "env": "e.yaml"}
    config = parse_config({**base, "engine": {"kind": "batched", "max_batch": 2}}, "run.yaml")
    assert isinstance(config.engine, Batched) and config.engine.max_batch == 2 and config.engine.in_process
    assert parse_config(config.model_dump(mode="json"), "stored") == config
    with pytest.raises(LooplineError, match=r"run.yaml: engine.max_batch: Input should be greater than or equal to 1"):
        parse_config({**base, "engine": {"kind": "batched", "max_batch": 0}}, "run.yaml")
    with pytest.raises(LooplineError, match=r"engine.max_batch: not a setting here; it is one of .*engine \(kind: (.* / )?batched\)"):
        parse_config({**base, "engine": {"kind": "local", "max_batch": 2}}, "run.yaml")
    schema = RunConfig.model_json_schema()["properties"]["engine"]["anyOf"]
    assert any("max_batch" in e["allOf"][0]["properties"] for e in schema)

    stored = {**base, "engine": {"kind": "local", "servers": [], "launch": None, "timeout_s": 600.0, "lora_sync": "adapter"}}
    assert parse_config(stored, "stored") == parse_config(base, "run.yaml")
    with pytest.raises(LooplineError, match="engine.servers: not a setting here"):  # (not at its default: another engine's)
        parse_config({**stored, "engine": {**stored["engine"], "servers": ["http://h:1"]}}, "stored")


def test_a_loss_an_estimator_a_correction_and_an_aggregation_bring_their_own_settings():
    """`learner.loss` is validated by the models of the loss, correction and aggregation it names, combined;
    `learner.advantage` by its estimator's. A setting of a component the section does not choose is refused naming
    the one it belongs to (GSPO has no dual clip; RLOO divides by no std): it was accepted and ignored. A config
    stored before (every component's fields, at their defaults) reads as the same config."""
    config = _config(learner={"loss": {"correction": "mis", "correction_bounds": "two_sided", "aggregation": "seq_mean_token_sum_norm"}})
    loss = config.learner_config().loss
    assert (loss.clip_ratio_c, loss.correction_bounds, loss.norm_length) == (3.0, "two_sided", 48)  # (L: sampling.max_new_tokens)
    assert config.learner.loss.norm_length is None and config == _config(learner={"loss": dict(config.learner.loss)})
    for learner, message in (
        ({"loss": {"policy_loss": "gspo", "clip_ratio_c": None}}, r"loss.clip_ratio_c: not a setting here; it is one of learner.loss \(policy_loss: vanilla\)"),
        ({"loss": {"correction_bounds": "two_sided"}}, r"loss.correction_bounds: not a setting here; it is one of learner.loss \(correction: mis / rejection\)"),
        ({"loss": {"norm_length": 64}}, r"loss.norm_length: not a setting here; it is one of learner.loss \(aggregation: seq_mean_token_sum_norm\)"),
        ({"advantage": {"estimator": "rloo", "eps": 1e-4}}, r"advantage.eps: not a setting here; it is one of learner.advantage \(estimator: grpo\)"),
        ({"advantage": {"eps": -1}}, r"learner.advantage.eps: Input should be greater than 0"),
        ({"loss": {"correction": "rejection", "correction_bounds": "two_sided", "correction_cap": 0.5}}, "a two-sided rejection needs correction_cap > 1"),
    ):
        with pytest.raises(LooplineError, match=message):
            _config(learner=learner)
    stored = _config(learner={"loss": {"policy_loss": "gspo"}, "advantage": {"estimator": "rloo"}}).model_dump(mode="json")
    stored["learner"]["loss"] |= {"clip_ratio_c": 3.0, "correction_bounds": "upper", "norm_length": None}  # (as stored before)
    stored["learner"]["advantage"] |= {"std": "sample", "eps": 1e-6}
    assert parse_config(stored, "stored") == _config(learner={"loss": {"policy_loss": "gspo"}, "advantage": {"estimator": "rloo"}})


@pytest.mark.parametrize("fork", ["../../x", "a/b", "x" * 300])
def test_a_fork_name_that_is_no_run_name_is_one_line_before_anything_starts(fork, tmp_path):
    """`--fork ../../x` trained a run whose log, checkpoints and weights went outside LOOPLINE_HOME (and
    `loopline delete` then deleted that outside directory); `a/b` nested directories; 300 characters ended in a
    102-line traceback. A fork's name is checked as a config's `name:` is, before the server or the ledger."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "LOOPLINE_HOME": str(tmp_path / "home"), "LOOPLINE_DATABASE_URL": "postgresql://nobody@127.0.0.1:9/none"}
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", "examples/arithmetic_quickstart.yaml", "--fork", fork],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1 and len(said) == 1 and said[0].startswith("error: --fork: ") and "is not a run name" in said[0], said
    assert {p.name for p in tmp_path.iterdir()} <= {"home"} and not (tmp_path / "home" / "runs").exists()
    with pytest.raises(LooplineError, match=r"run.yaml: name: '\.\./\.\./x' is not a run name: 1-100 letters"):  # (as a config's name:)
        parse_config({"name": "../../x", "env": "e.yaml"}, "run.yaml")
