"""Episodes of an env with `agent:`: the user's own program plays the task in the sandbox, calling the policy
through the OpenAI-compatible endpoint, and its calls are the trajectory's segments (`openai_api`).

The program gets the task as JSON on stdin and in `task.json` (its id, system prompt and prompt: never the
task's other fields, which may hold the answer), the endpoint as OPENAI_BASE_URL / OPENAI_API_KEY, and
leaves its answer in `answer.txt`; the env's verifier then decides the reward as for any episode. What it
prints is never read. Failure classes as for the built-in harness: a spent budget ends the episode as
truncated; a program that fails after calling the model failed its task (a real reward); an engine fault,
or a program that never called the model (nothing to train, e.g. a missing library), is an infrastructure
failure, retried.

Local and Docker sandboxes reach this process's endpoint through its unix socket. An E2B sandbox runs in the
cloud and reaches it over the internet: LOOPLINE_AGENT_ENDPOINT_LISTEN (HOST:PORT) is where the endpoint
listens and LOOPLINE_AGENT_ENDPOINT_URL the URL at which the cloud reaches that (through your TLS proxy or
tunnel); the sandbox's network allows that URL's host and nothing else.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from loopline.envregistry.episode import Episode
from loopline.envregistry.sandbox.base import InfraFailure, ModelEndpoint
from loopline.envregistry.smoke import SmokeResult, SmokeStepResult, fill
from loopline.envregistry.spec import ANSWER_FILE, EnvSpec
from loopline.envregistry.tasks import Task
from loopline.errors import LooplineError
from loopline.rollout.harness.chat import ChatFormat
from loopline.rollout.engines.base import ContextOverflow, EngineClosed, EngineError, Generation, Sampler, SamplingParams, VersionSpan
from loopline.rollout.harness.episode_setup import EpisodeSetup
from loopline.rollout.endpoint.api import AgentEpisode, Budget
from loopline.rollout.endpoint.server import OpenAIServer
from loopline.types import SegmentRecord, TrajectoryRecord

TASK_FILE = "task.json"
LISTEN_VAR, URL_VAR = "LOOPLINE_AGENT_ENDPOINT_LISTEN", "LOOPLINE_AGENT_ENDPOINT_URL"
_endpoint: OpenAIServer | None = None
_endpoint_lock = threading.Lock()


def _listen_address() -> tuple[str, int]:
    """Where the endpoint listens on TCP: LISTEN_VAR's HOST:PORT, else a free port on the loopback."""
    listen = os.environ.get(LISTEN_VAR, "")
    if not listen:
        return "127.0.0.1", 0
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise LooplineError(f"{LISTEN_VAR}={listen!r}: give HOST:PORT where the agent endpoint listens, e.g. 0.0.0.0:8765")
    return host.strip("[]"), int(port)


def check_reachable(spec: EnvSpec) -> None:
    """Before any episode: an agent program in a cloud sandbox needs this process's endpoint on the internet."""
    if spec.agent is None or not spec.sandbox.off_site:
        return
    if not os.environ.get(URL_VAR) or not os.environ.get(LISTEN_VAR):
        raise LooplineError(
            f"env {spec.name} runs its agent program in E2B's cloud, which reaches the model endpoint over the internet: "
            f"set {LISTEN_VAR}=HOST:PORT (where this process listens) and {URL_VAR}=URL (where E2B reaches it, "
            "e.g. https://trainer.example.com:8443 through your TLS proxy)"
        )
    url = urlsplit(os.environ[URL_VAR])
    if url.scheme not in ("http", "https") or not url.hostname:
        raise LooplineError(f"{URL_VAR}={os.environ[URL_VAR]!r}: give the URL at which E2B reaches this process, e.g. https://trainer.example.com:8443")
    host, port = _listen_address()
    server = endpoint()  # (listening now: an address in use is this one line, not a failure of every episode)
    if server.host != host or port not in (0, server.port):
        raise LooplineError(
            f"this process's agent endpoint already listens on {server.host}:{server.port}, started before {LISTEN_VAR} "
            "was set: run in a new process"
        )


def endpoint() -> OpenAIServer:
    """This process's endpoint (one for all its episodes: a key per episode), started on first use."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            # a unix socket's path may hold 107 bytes on Linux: a long TMPDIR (a CI's, a test's) falls back to /tmp
            short = tempfile.gettempdir() if len(tempfile.gettempdir()) < 70 else "/tmp"
            directory = Path(tempfile.mkdtemp(prefix="loopline-model-", dir=short))
            directory.chmod(0o755)
            host, port = _listen_address()
            try:
                server = OpenAIServer(host, port, unix_path=str(directory / "model.sock"))
            except OSError as exc:
                raise LooplineError(f"the agent endpoint cannot listen on {host}:{port} ({exc}): set {LISTEN_VAR} to a free HOST:PORT") from None
            _endpoint = server.start()
            atexit.register(_stop, _endpoint, directory)
        return _endpoint


def _stop(server: OpenAIServer, directory: Path) -> None:
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)  # (its socket's directory: one was left per process)


def model_endpoint() -> ModelEndpoint:
    server = endpoint()
    assert server.unix_path is not None
    return ModelEndpoint(server.unix_path, os.environ.get(URL_VAR) or None)


async def run_agent_program(engine: Sampler, setup: EpisodeSetup, task: Task, request_id: str, labels: dict[str, str] | None = None) -> TrajectoryRecord:
    spec, budgets = setup.spec, setup.spec.budgets
    server, model = endpoint(), model_endpoint()
    started = time.monotonic()
    env_episode = await Episode.start(spec, task, labels, model=model)
    start_seconds = time.monotonic() - started
    calls = AgentEpisode(engine, setup.chat, setup.sampling, Budget(budgets.max_turns, budgets.max_generated_tokens), request_id)
    key = server.open(calls)
    end, result = "exit", None
    try:
        reset = await env_episode.reset()
        for path, text in spec.agent.sources.items():
            await env_episode.sandbox.write_file(path, text)
        shown = json.dumps({"id": task.id, "system_prompt": reset.system_prompt, "prompt": reset.prompt})
        await env_episode.sandbox.write_file(TASK_FILE, shown)
        env = {
            **spec.agent.env, "OPENAI_BASE_URL": f"{env_episode.sandbox.model_url(model)}/episodes/{key}/v1", "OPENAI_API_KEY": key,
            "LOOPLINE_TASK_FILE": TASK_FILE,
        }
        program_started = time.monotonic()
        run = asyncio.ensure_future(env_episode.sandbox.run_program(spec.agent.command, shown, env, model))
        while not run.done():  # the program's own time: what it spent waiting for the model is the engine's
            await asyncio.wait({run}, timeout=0.2)
            now = time.monotonic()
            if not run.done() and now - program_started - calls.waited(now) > budgets.wall_time_s:
                run.cancel()
                end = "wall_time"
                await asyncio.gather(run, return_exceptions=True)
        result = None if run.cancelled() else run.result()
        if calls.engine_error:
            raise (EngineClosed if calls.engine_closed else EngineError)(f"episode {request_id}: {calls.engine_error}")
        if not calls.segments and not calls.refusals:
            detail = f"exit {result.exit_code}: {(result.stderr or result.stdout).strip()[-400:]}" if result else "stopped by the wall-time budget"
            raise InfraFailure(f"the agent program `{spec.agent.command}` never called the model ({detail})")
        if not calls.segments:  # every call it made was refused: its failure, not the sandbox's
            return _refused(setup, reset, calls, result, started, start_seconds)
        try:
            final = await env_episode.sandbox.read_file(ANSWER_FILE)
        except (OSError, InfraFailure):
            final = ""  # no answer: the verifier decides what that is worth
        verify_started = time.monotonic()
        verdict = await env_episode.verify(final)
        verify_seconds = time.monotonic() - verify_started
    finally:
        server.close(key)
        await env_episode.close()
    if end == "exit" and calls.exhausted:
        end = calls.exhausted
    failure: Literal["task_failed", "truncated"] | None = "truncated" if end != "exit" else (None if verdict.passed else "task_failed")
    return TrajectoryRecord(
        env_name=spec.name,
        env_version=setup.env_version,
        verifier_version=spec.versions.verifier,
        harness_version=spec.versions.harness,
        reward=verdict.reward,
        terminated=end == "exit",
        truncated=end != "exit",
        failure_type=failure,
        segments=calls.segments,
        timings={
            "episode_s": time.monotonic() - started, "sandbox_start_s": start_seconds, "model_s": calls.model_seconds,
            "verify_s": verify_seconds,
        },
        info={
            "verdict": verdict.details, "end": end, "generated_tokens": calls.generated, "exit_code": result.exit_code if result else None,
            "chains": calls.chains, "stderr": (result.stderr[-2000:] if result else ""),
            **({"refused": calls.refused, "refusals": calls.refusals} if calls.refusals else {}),  # (calls the endpoint refused, beside served ones)
        },
    )


def _refused(setup, reset, calls: AgentEpisode, result, started: float, start_seconds: float) -> TrajectoryRecord:
    """An episode whose program had every model call refused (a parameter the endpoint does not serve, a prompt
    past the context): a failed task, never an infrastructure failure, which would be played again and again
    for the same refusal and then stop the run. Scored 0 (the policy said nothing); its one segment is the
    task's prompt as the harness renders it, with nothing generated (no token of it is trained), and the
    refusals are in its info."""
    spec = setup.spec
    segment = SegmentRecord(
        request_id=f"{calls.request_id}/refused/", policy_version=calls.engine.version(), tokenizer_version=setup.chat.version,
        prompt_ids=setup.chat.initial_ids(reset.system_prompt, reset.prompt), generated_ids=[], action_loss_mask=[],
        rollout_logprobs=[], logprob_semantics="none: nothing was generated", sampling_config=setup.sampling.to_dict(),
        tool_events=[{"refused": calls.refused, "refusals": calls.refusals}], version_spans=[],
    )
    return TrajectoryRecord(
        env_name=spec.name, env_version=setup.env_version, verifier_version=spec.versions.verifier,
        harness_version=spec.versions.harness, reward=0.0, terminated=True, truncated=False, failure_type="task_failed",
        segments=[segment],
        timings={"episode_s": time.monotonic() - started, "sandbox_start_s": start_seconds, "model_s": calls.model_seconds, "verify_s": 0.0},
        info={
            "verdict": {"refused": True}, "end": "refused", "refused": calls.refused, "refusals": calls.refusals, "generated_tokens": 0,
            "exit_code": result.exit_code if result else None, "chains": 0, "stderr": (result.stderr[-2000:] if result else ""),
        },
    )


class ScriptedModel:
    """A model that answers each call with the next of `replies` (its chat's tokens, then the end of turn) and
    refuses a prompt past `max_context` as the engines do: `envreg test`'s model, and the tiny starter's
    teacher (`policies.starter`). `said`: what it answered, call by call."""

    def __init__(self, chat: ChatFormat, replies: list[str], max_context: int):
        self.chat, self.replies, self.max_context = chat, list(replies), max_context
        self.said: list[str] = []

    def version(self) -> int:
        return 0

    async def generate(self, prompt_ids, sampling, request_id):
        if len(prompt_ids) + sampling.max_new_tokens > self.max_context:  # (a 400 to the program, as from an engine)
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens + {sampling.max_new_tokens} new tokens exceeds the policy's "
                f"context of {self.max_context}"
            )
        said = self.replies.pop(0) if self.replies else ""
        self.said.append(said)
        said = said.removeprefix(self._forced(prompt_ids))
        ids = self.chat.tokenizer.encode(said, add_special_tokens=False) + [self.chat.eos_id]
        return Generation(tuple(ids), tuple([0.0] * len(ids)), "stop", (VersionSpan(0, 0, len(ids)),))


    def _forced(self, prompt_ids) -> str:
        """The start of a tool call the endpoint put after the prompt (`tool_choice`: required or a named function;
        smolagents' ToolCallingAgent sends it on every call): a scripted reply is the whole call, so its start is
        not said twice (a second `<tool_call>` made the call malformed and the program never finished)."""
        opening = self.chat.tool_format().required
        tail = self.chat.tokenizer.decode(list(prompt_ids[-256:]))
        at = tail.rfind(opening)
        return tail[at:] if at >= 0 and opening else ""


def context_of(model_dir: Path) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 2048))


async def play_scripted(spec, task: Task, policy: Path, max_context: int | None = None, max_new_tokens: int | None = None) -> SmokeResult:
    """`envreg test` of an env with `agent:`: its program against a model that answers its calls with
    `smoke_test.replies`, in `policy`'s tokens and chat template (a model directory), within its context unless
    `max_context` says another. Each call may generate at most `max_new_tokens` (a run's
    `rollout.sampling.max_new_tokens`: what training checks a prompt against), within the episode's budget."""
    check_reachable(spec)
    chat = ChatFormat.for_policy(policy)
    model = ScriptedModel(chat, [fill(reply, task) for reply in spec.smoke_test.replies], max_context or context_of(policy))
    result = SmokeResult(task.id)
    started = time.monotonic()
    per_call = min(max_new_tokens or spec.budgets.max_generated_tokens, spec.budgets.max_generated_tokens)
    setup = EpisodeSetup(spec, 0, chat, SamplingParams(temperature=1.0, max_new_tokens=per_call))
    try:
        trajectory = await run_agent_program(model, setup, task, f"smoke-{task.id}", labels={"loopline.purpose": "smoke"})
    except (InfraFailure, EngineError) as exc:
        result.infra_error = str(exc)
    else:
        result.reward, result.verdict = trajectory.reward, trajectory.info["verdict"]
        result.answer = f"(the program's answer.txt; it exited {trajectory.info['exit_code']}, {trajectory.info['end']})"
        if trajectory.info["end"] == "refused":
            result.answer = f"(every model call of the program was refused, a failed task: {'; '.join(trajectory.info['refused'])})"
        t = trajectory.timings
        result.timings = {"start": t["sandbox_start_s"], "steps": t["episode_s"] - t["sandbox_start_s"] - t["verify_s"], "verify": t["verify_s"]}
    finally:
        result.steps[:0] = [SmokeStepResult(f"model call {i}", said, 0.0) for i, said in enumerate(model.said, 1)]
    result.timings.setdefault("steps", time.monotonic() - started)
    return result
