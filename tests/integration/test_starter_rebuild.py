"""The shipped starter is reproducible: the recipe in the code still trains as the shipped build was trained.

The quickstart uses the starter shipped in the package (loopline/starters). A whole rebuild takes 5-13 min
on 2 cores, so this test runs the recipe's first LOSS_WINDOW * 2 SFT steps (~1 min) and compares what a
change to the tokenizer, the transcripts, the initialisation, the learner or its schedule would move: the
tokenizer and architecture (equal) and the SFT loss curve (within 3% of the shipped build's, which was
measured on another machine: floats differ a little between CPUs). A changed recipe fails here too: rebuild
and ship it with `loopline models build-tiny --ship`, whose report this compares with.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from loopline.envregistry.registry import content_hash
from loopline.envregistry.spec import load_spec
from loopline.envregistry.tasks import load_tasks
from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_name
from loopline.policies.starter import LOSS_WINDOW, TinyRecipe, success_rate, warm_start

ROOT = Path(__file__).resolve().parents[2]
ENV = ROOT / "examples" / "arithmetic_env.yaml"


@pytest.mark.slow
def test_the_recipe_trains_as_the_shipped_starter_was_trained(tmp_path):
    shipped = SHIPPED_STARTERS / tiny_policy_name(content_hash(ENV), 0)
    assert (shipped / "model.safetensors").is_file(), f"no shipped starter for the quickstart's environment at {shipped}"
    report = json.loads((shipped / "loopline_starter.json").read_text())
    assert report["recipe"] == asdict(TinyRecipe()), "the recipe changed: ship a rebuild (loopline models build-tiny --ship)"

    spec = load_spec(ENV)
    tasks = load_tasks(spec, ENV.parent)
    out = tmp_path / "rebuilt"
    curve = warm_start(out, spec, tasks, TinyRecipe(), steps=2 * LOSS_WINDOW)
    assert (out / "tokenizer.json").read_text() == (shipped / "tokenizer.json").read_text()
    written_by = lambda config: {k: v for k, v in json.loads(config.read_text()).items() if k != "transformers_version"}  # noqa: E731
    assert written_by(out / "config.json") == written_by(shipped / "config.json")  # (the version that wrote it is not the model)
    expected = {int(step): loss for step, loss in report["loss_curve"].items() if int(step) in curve}
    assert sorted(expected) == [LOSS_WINDOW, 2 * LOSS_WINDOW]
    assert all(abs(curve[step] - loss) <= 0.03 * loss for step, loss in expected.items()), (curve, expected)

    # what the quickstart relies on: at T=1 it calls its calculator sometimes, greedy it almost never does (RL's room)
    assert 0.08 <= report["eval_success"] <= 0.30, report
    evals = [t for t in tasks if t.split == "eval"][:100]
    assert asyncio.run(success_rate(shipped, spec, evals, temperature=0.0)) <= 0.05
