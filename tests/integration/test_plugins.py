"""A user's components in a module of their own (examples/plugins/my_components.py, the extend page's), named by the run config's `imports:`, work in every process of
a run: the CLI, two DeepSpeed learner ranks (fresh interpreters; rank 1 hears the modules from rank 0) and a
rollout worker started on its own (`loopline worker`), while the test process itself never imports the package."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.test_chaos import ROOT, _checked_run, _rows, _small_run

EXAMPLE = ROOT / "examples" / "plugins" / "my_components.py"  # (the module docs/how-to/extend.md shows)
# What the test adds to it: each process that uses a component notes itself (a rollout worker uses the plugin's
# engine, the learner ranks its loss, each with its setting from the config; the tracker is the trainer's).
OBSERVED = """

import os as _os
import sys as _sys


def _mark(component):
    with open(_os.environ["TOY_PLUGIN_MARKS"], "a") as marks:
        marks.write(f"{component} {_os.getpid()} {_os.environ.get('RANK', '-')} {' '.join(_sys.argv[1:3])}\\n")


_cispo = POLICY_LOSSES["cispo"]


@POLICY_LOSSES.register("cispo", settings=CispoSettings)
def _observed_cispo(*args):
    _mark(f"loss-lower_bound={args[-1].lower_bound}")
    return _cispo(*args)


def _observed_engine(request):
    _mark(f"engine-max_batch={request.settings.max_batch}")
    return capped_local(request)


ENGINES.register("capped_local", settings=CappedLocal)(EngineKind(_observed_engine, in_process=True))
"""


def _plugin_run(tmp_path: Path, tiny, database_url: str) -> tuple[Path, dict, str]:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "my_components.py").write_text(EXAMPLE.read_text() + OBSERVED)
    name = f"plugin-{tmp_path.name[-10:]}".replace("_", "-")
    config, env = _small_run(tmp_path, name, tiny, database_url, mode="async", lease_seconds=600, backend="deepspeed", every=100)
    settings = yaml.safe_load(config.read_text())
    settings |= {"imports": ["my_components"], "steps": 2, "engine": {"kind": "capped_local", "max_batch": 3}, "tracking": ["jsonl"]}
    settings["rollout"] |= {"local_rollout": False}
    settings["learner"] |= {"zero_stage": 1, "launch": {"ranks_per_node": 2}, "loss": {"policy_loss": "cispo", "lower_bound": False}}
    config.write_text(yaml.safe_dump(settings))
    env |= {"TOY_PLUGIN_MARKS": str(tmp_path / "marks.txt")}
    return config, env, name


def test_a_plugin_the_process_cannot_import_is_refused_in_one_line_naming_it(tiny_dirs, database_url, tmp_path):
    config, env, _ = _plugin_run(tmp_path, tiny_dirs["v0"], database_url)
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "imports: cannot import 'my_components'" in said and "PYTHONPATH" in said, said[-3000:]
    assert "Traceback" not in said
    env["LOOPLINE_IMPORTS"] = "no_such_plugin_module"
    done = subprocess.run([sys.executable, "-m", "loopline.cli", "schema"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "LOOPLINE_IMPORTS: cannot import 'no_such_plugin_module'" in done.stdout + done.stderr


@pytest.mark.slow
def test_a_plugin_named_in_imports_trains_on_two_learner_ranks_and_a_rollout_worker(tiny_dirs, database_url, db, tmp_path):
    config, env, name = _plugin_run(tmp_path, tiny_dirs["v0"], database_url)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), *filter(None, [env.get("PYTHONPATH")])])
    trainer = subprocess.Popen([sys.executable, "-m", "loopline.cli", "train", str(config)], env=env, cwd=ROOT,
                               stdout=(tmp_path / "train.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    worker = None
    try:
        deadline = time.monotonic() + 300
        while not _rows(db, "SELECT 1 FROM run WHERE name = :n AND status = 'running'", n=name):
            assert time.monotonic() < deadline and trainer.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
            time.sleep(0.5)
        worker = subprocess.Popen([sys.executable, "-m", "loopline.cli", "worker", name], env=env, cwd=ROOT,
                                  stdout=(tmp_path / "worker.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        assert trainer.wait(timeout=600) == 0, (tmp_path / "train.log").read_text()[-4000:] + (tmp_path / "worker.log").read_text()[-3000:]
        assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()[-3000:]  # (it leaves when the run ends)
    finally:
        for process in (trainer, worker):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)
    marks = [line.split(" ", 3) for line in (tmp_path / "marks.txt").read_text().splitlines()]
    loss_ranks = {(pid, rank) for component, pid, rank, _ in marks if component == "loss-lower_bound=False"}  # (its setting from the config)
    assert {rank for _, rank in loss_ranks} == {"0", "1"} and len({pid for pid, _ in loss_ranks}) == 2, marks
    assert any(component == "engine-max_batch=3" and argv.startswith("worker") and int(pid) == worker.pid for component, pid, _, argv in marks), marks
    run_id = _checked_run(db, name)
    lines = (Path(env["LOOPLINE_HOME"]) / "runs" / name / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == {0, 1, 2}  # (the plugin's tracker, in the trainer: v0's evaluation too)
    assert _rows(db, "SELECT value FROM metric WHERE run_id = :r AND name = 'learner_ranks' ORDER BY step", r=run_id) == [(2.0,), (2.0,)]
    played = _rows(db, "SELECT count(*) FROM attempt WHERE run_id = :r AND worker LIKE :w AND status IN ('ok', 'task_failed')",
                   r=run_id, w=f"%:{worker.pid}:%")
    assert played[0][0] > 0  # (the worker played the run's episodes, on the plugin's engine)
