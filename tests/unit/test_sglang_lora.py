"""LoRA runs on SGLang ship each version as its adapter: the learner writes it in peft's format, the client
loads it under a name no other version or run uses, requests name it, and every token is recorded with the
adapter's version. Against the protocol-faithful stand-in (its LoRA behaviour is the real server's as observed,
see its docstring), serving the real tiny starter so that the adapter's effect on the logprobs is checked."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from loopline.policies.sources import SHIPPED_STARTERS
from loopline.rollout.engines.base import EngineError, SamplingParams, VersionSpan
from loopline.rollout.engines.sglang import SGLangEngine
from loopline.rollout.weights.check import BadWeights, read_layout
from loopline.trainer.config import LoraConfig
from loopline.trainer.learner import Learner, LearnerConfig


def starter_dir() -> Path:
    """The shipped tiny starter: a real (2-layer Llama) model, loaded in a second."""
    return next(p for p in sorted(SHIPPED_STARTERS.iterdir()) if (p / "config.json").is_file())


@pytest.fixture
def server():
    from tests.fakes.sglang_protocol_server import serving

    with serving(token_delay_s=0.0, model_path=str(starter_dir()), enable_lora=True) as s:
        yield s


def _adapters(tmp_path, count: int) -> tuple[Learner, list[str]]:
    """A LoRA learner and `count` adapters, each a different (random) update of the same base."""
    torch.manual_seed(0)
    learner = Learner(starter_dir(), LearnerConfig(lora=LoraConfig(rank=4)), backend="torch")
    written = []
    for version in range(1, count + 1):
        with torch.no_grad():
            for name, p in learner.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        written.append(str(learner.export_adapter(tmp_path / f"v{version}")))
    return learner, written


def _logprobs(learner: Learner, prompt: list[int], ids: tuple[int, ...]) -> list[float]:
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([prompt + list(ids)])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def test_each_version_is_its_adapter_named_by_every_request_and_recorded_with_its_version(server, tmp_path):
    learner, (v1, v2, v3) = _adapters(tmp_path, 3)
    layout = read_layout(starter_dir())
    prompt, greedy = [1, 5, 9, 30, 40], SamplingParams(temperature=0.0, max_new_tokens=8)

    async def body():
        engine = SGLangEngine([server.url], tag="run1", adapters=True, initial_path=str(starter_dir()), served_layout=layout)
        try:
            assert await engine.refresh_versions() == [0]
            base = await engine.generate(prompt, greedy, "base")
            assert "lora_path" not in server.requests[-1]  # version 0 is the base model itself
            timings = await engine.update_weights(1, v1)
            assert set(timings) >= {"check_s", "load_s", "confirm_s"}
            first = await engine.generate(prompt, greedy, "first")
            assert server.requests[-1]["lora_path"] == "1@run1"
            await engine.update_weights(2, v2)
            await engine.update_weights(3, v3)
            third = await engine.generate(prompt, greedy, "third")
            return base, first, third
        finally:
            await engine.close()

    base, first, third = asyncio.run(body())
    assert base.version_spans == (VersionSpan(0, 0, len(base.token_ids)),)
    assert first.version_spans == (VersionSpan(1, 0, len(first.token_ids)),)  # the adapter's version, not the base's
    assert third.version_spans == (VersionSpan(3, 0, len(third.token_ids)),)
    # the tokens were generated under the adapter: the learner (holding v3's adapter) gives their logprobs
    assert max(abs(a - b) for a, b in zip(third.logprobs, _logprobs(learner, [1, 5, 9, 30, 40], third.token_ids))) < 1e-4
    assert server.adapters == {"2@run1": v2, "3@run1": v3}  # v1 unloaded; the previous version stays loaded


def test_a_new_client_reads_the_served_adapter_and_a_sync_that_got_half_way_is_finished(server, tmp_path):
    _, (v1, v2) = _adapters(tmp_path, 2)
    layout = read_layout(starter_dir())

    async def body():
        first = SGLangEngine([server.url], tag="run1", adapters=True, initial_path=str(starter_dir()), served_layout=layout)
        await first.update_weights(1, v1)
        await first.load_adapter(first.replicas[0], "2@run1", v2)  # v2 reached the server; the process died before it knew
        await first.close()
        resumed = SGLangEngine([server.url], tag="run1", adapters=True, initial_path=str(starter_dir()), served_layout=layout)
        try:
            seen = await resumed.refresh_versions()
            resumed.replicas[0].version = 1  # as if it had seen only v1: loading v2 again is not an error
            await resumed.update_weights(2, v2)
            other = SGLangEngine([server.url], tag="run2", adapters=True, initial_path=str(starter_dir()), served_layout=layout)
            other_seen = await other.refresh_versions()  # another run's adapters are not its versions
            await other.close()
            with pytest.raises(EngineError, match="refused /load_lora_adapter 2@run1"):
                await resumed.load_adapter(resumed.replicas[0], "2@run1", v1)  # the same name for other files: refused
            return seen, other_seen
        finally:
            await resumed.close()

    seen, other_seen = asyncio.run(body())
    assert seen == [2] and other_seen == [0]


def test_a_bad_adapter_is_refused_before_the_server_sees_it_and_a_missing_one_says_where(server, tmp_path):
    _, (v1,) = _adapters(tmp_path, 1)
    layout = read_layout(starter_dir())
    truncated = tmp_path / "truncated"
    shutil.copytree(v1, truncated)
    with open(truncated / "adapter_model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    other = tmp_path / "other-model"
    shutil.copytree(v1, other)
    wrong = {name: ("F32", (shape[0], shape[1] * 2) if len(shape) == 2 else shape) for name, (_, shape) in layout.items()}

    async def body():
        engine = SGLangEngine([server.url], tag="run1", adapters=True, initial_path=str(starter_dir()), served_layout=layout)
        try:
            with pytest.raises(BadWeights, match="a partial or corrupt write"):
                await engine.update_weights(1, str(truncated))
            with pytest.raises(BadWeights, match="no adapter_config.json"):
                await engine.update_weights(1, str(tmp_path))
            engine.served_layout = wrong  # an adapter for a model of other sizes
            with pytest.raises(BadWeights, match="needs"):
                await engine.update_weights(1, v1)
            engine.served_layout = None  # unchecked: the server's own answer for a path it cannot find
            with pytest.raises(EngineError, match="does not exist on the server's machine"):
                await engine.update_weights(1, str(tmp_path / "nowhere"))
            assert server.adapters == {} and engine.version() == 0
        finally:
            await engine.close()

    asyncio.run(body())


def test_a_server_on_other_base_weights_is_refused_in_one_line(server, tmp_path):
    async def body():
        engine = SGLangEngine([server.url], tag="run1", adapters=True, initial_path=str(tmp_path), served_layout=None)
        server.weight_version = "5@run0"  # another run's merged weights
        try:
            with pytest.raises(EngineError, match="a LoRA run's servers serve its base model"):
                await engine.refresh_versions()
        finally:
            await engine.close()

    asyncio.run(body())
