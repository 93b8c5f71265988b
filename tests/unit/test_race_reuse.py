"""The race reuses TRL's side of an earlier raw file only where the comparison holds (benchmarks/race_vs_trl.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.race_vs_trl import RACE_SETTINGS, trl_side_from

SETTINGS = {"seed": 0, "minutes": 35.0, "mark_minutes": 5.0, "max_operand": 9999, "eval_tasks": 300, "temperature": 0.7,
            "lr": 1e-6, "max_tokens": 128, "micro_batch": 16}


def _raw(tmp_path, **extra):
    side = {"side": "TRL", "marks": [{"mark": 1, "path": "/w/trl/step-1", "trained_s": 640.0}]}
    raw = tmp_path / "seed-0.json"
    raw.write_text(json.dumps({"args": {k: str(v) for k, v in SETTINGS.items()}, "sides": [side], "scores": {"/w/trl/step-1": 0.61}, **extra}))
    return raw


def test_a_trl_side_is_reused_only_from_a_machine_of_the_same_speed(tmp_path):
    """The same code once ran 1.75x slower here from one day to the next: minutes from two such machines do not
    compare, and a raw file that did not measure its machine cannot say."""
    args = argparse.Namespace(**SETTINGS)
    assert set(RACE_SETTINGS) == set(SETTINGS)
    with pytest.raises(SystemExit, match="not measured.*race TRL again here"):
        trl_side_from(_raw(tmp_path), args, tmp_path / "scores.json", probe=100.0)
    with pytest.raises(SystemExit, match="ran 130.0 matmuls/s, this one 100.0"):
        trl_side_from(_raw(tmp_path, probe=130.0), args, tmp_path / "scores.json", probe=100.0)
    side = trl_side_from(_raw(tmp_path, probe=105.0), args, tmp_path / "scores.json", probe=100.0)
    assert side["side"] == "TRL" and json.loads((tmp_path / "scores.json").read_text())["scores"] == {"/w/trl/step-1": 0.61}
