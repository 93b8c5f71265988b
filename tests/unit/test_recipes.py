"""The recipe configs (examples/recipes/): each is the quickstart with one algorithm's learner settings, as its
paper and peers define them (docs/reference/algorithms.md names the same settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopline.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# recipe -> (advantage settings, loss settings), as the papers give them (the docstring of each file says whose)
RECIPES = {
    "grpo": ({"estimator": "grpo", "std": "sample"},
             {"policy_loss": "vanilla", "clip_low": 0.2, "clip_high": 0.2, "clip_ratio_c": None, "aggregation": "seq_mean_token_mean",
              "kl_coef": 0.04, "kl_estimator": "k3"}),
    "dr_grpo": ({"estimator": "dr_grpo"}, {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "seq_mean_token_sum_norm", "kl_coef": 0.0}),
    "rloo": ({"estimator": "rloo"}, {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "token_mean", "kl_coef": 0.0}),
    "dapo": ({"estimator": "grpo", "degenerate": "drop"}, {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean", "kl_coef": 0.0}),
    "gspo": ({"estimator": "grpo"}, {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "aggregation": "seq_mean_token_mean", "kl_coef": 0.0}),
}


def test_every_recipe_is_tested():
    assert sorted(p.stem for p in (EXAMPLES / "recipes").glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_sets_its_algorithm_and_is_the_quickstart_otherwise(recipe):
    config, _ = load_config(EXAMPLES / "recipes" / f"{recipe}.yaml")
    advantage, loss = RECIPES[recipe]
    assert {k: getattr(config.learner.advantage, k) for k in advantage} == advantage
    assert {k: getattr(config.learner.loss, k) for k in loss} == loss
    quickstart, _ = load_config(EXAMPLES / "arithmetic_quickstart.yaml")
    same = {"name", "learner", "env"}  # (env: the same file, from the recipes' folder)
    assert config.model_dump(exclude=same) == quickstart.model_dump(exclude=same)
    assert Path(config.env).name == Path(quickstart.env).name
    assert config.learner.lr == quickstart.learner.lr


def test_the_algorithms_page_names_every_recipe():
    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "algorithms.md").read_text()
    assert all(f"examples/recipes/{recipe}.yaml" in page for recipe in RECIPES)
