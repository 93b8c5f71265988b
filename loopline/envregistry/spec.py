"""The environment declaration: what a YAML file may say, validated by pydantic.

`envreg schema` exports this as JSON Schema for editors. Errors name the
file, the line and the field path (see `load_spec`).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
import re
import string
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from loopline import plugins
from loopline.errors import LooplineError
from loopline.registry import Registry, RegistryName, RegistrySection
from loopline.yamlfile import line_index, read_text, read_yaml

NAME_PATTERN = r"^[a-z][a-z0-9_\-]{0,62}$"


class _Strict(BaseModel):
    # NaN and infinities are refused at validation: a spec is stored as JSON, where they do not exist.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# `sandbox.backend` by name: the built-ins declared here (a spec is checked without importing a backend's SDK),
# implemented and registered in sandbox/backends.py; a backend registered anywhere else is a valid name too.
SANDBOX_BACKENDS: Registry = Registry("sandbox backend", "sandbox.backend", ("docker", "e2b", "local"))
MAX_TIMEOUT_S = 86_400.0  # a day: longer waits are configuration mistakes, not workloads
RESERVED_TOOL_NAMES = ("answer",)  # `<answer>...</answer>` ends an episode; a tool cannot take the name


MAX_OUTPUT_FILES = 10_000  # what a verifier may receive of the agent's files
MAX_OUTPUT_BYTES = 64 << 20


def relative_path(path: str, what: str) -> str:
    """Files an env writes live under a directory loopline chooses (the workdir, the verifier's directory):
    the same relative path means the same place on every backend, and nothing can be written elsewhere."""
    parts = path.replace("\\", "/").split("/")
    if not path or path.startswith("/") or ".." in parts:
        raise ValueError(f"{what} {path!r} must be a relative path without '..'")
    return path


def template_fields(template: str, where: str, shell: bool = False) -> list[str]:
    """The {placeholders} of a command template; a brace that is not one must be doubled ({{ and }}).
    A placeholder is a bare name: a conversion ({x!r}) or format spec ({x:>400000000}) is refused (the
    first skips loopline's quoting, the second lets a template allocate without bound). In a shell
    command (`shell`) loopline quotes each value itself, so a placeholder that is not a word of a command
    (inside quotes, $((...)) or a here-document) is refused: there $(touch MARKER) in a value would run."""
    try:
        parsed = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{where} {template!r}: {exc}; write a literal brace as {{{{ or }}}}") from None
    for name, spec, conv in parsed:
        if not re.fullmatch(r"\w+", name):
            raise ValueError(f"{where} {template!r}: {{{name}}} is not a placeholder; write a literal brace as {{{{ or }}}}")
        if spec or conv:
            raise ValueError(f"{where} {template!r}: write the placeholder as {{{name}}}, without a conversion or format spec")
    if shell:
        unsafe = _unsafe_placeholders(template)
        if unsafe:
            name, where_in = unsafe[0]
            raise ValueError(
                f"{where} {template!r}: {{{name}}} is {where_in}, where a quoted value is not one plain word; write it as a "
                "bare word of a command (loopline quotes each value for the shell), e.g. pass it as an argument or on stdin"
            )
    return [name for name, _, _ in parsed]


def _unsafe_placeholders(template: str) -> list[tuple[str, str]]:
    """The placeholders of a shell command template that do not stand as a word of a command, with where they
    stand: inside single or double quotes, shell arithmetic or a here-document. There a value's shell quoting
    does not hold: `$(...)` in it ran inside double quotes, `$((...))` and unquoted here-documents."""
    found: list[tuple[str, str]] = []
    stack: list[str | None] = [None]  # None: unquoted; "'" or '"': quoted; "(" or "`": a substitution; "((": arithmetic
    heredocs: list[str] = []  # delimiters of the here-documents whose bodies start at the next newline
    context = {"'": "inside quotes", '"': "inside quotes", "((": "inside shell arithmetic $((...))"}
    i = 0
    while i < len(template):
        c, top = template[i], stack[-1]
        if c == "\n" and heredocs and top is None:
            i = _skip_heredocs(template, i + 1, heredocs, found)
            heredocs = []
        elif template.startswith("{{", i) or template.startswith("}}", i):
            i += 2
        elif c == "{":
            end = template.index("}", i)
            if top in context:
                found.append((template[i + 1 : end], context[top]))
            i = end + 1
        elif top == "'":
            stack.pop() if c == "'" else None
            i += 1
        elif c == "\\":
            i += 2
        elif template.startswith("$((", i):
            stack.append("((")
            i += 3
        elif top == "((" and template.startswith("))", i):
            stack.pop()
            i += 2
        elif template.startswith("$(", i):
            stack.append("(")
            i += 2
        elif c == "`":
            stack.pop() if top == "`" else stack.append("`")
            i += 1
        elif top == '"':
            stack.pop() if c == '"' else None
            i += 1
        elif top is None and template.startswith("<<", i) and not template.startswith("<<<", i):
            word = re.match(r"<<-?\s*(['\"]?)(\w+)\1", template[i:])
            heredocs.append(word.group(2) if word else "")
            i += word.end() if word else 2
        else:  # unquoted
            if c in "'\"":
                stack.append(c)
            elif c == "(":
                stack.append("(")
            elif c == ")" and top == "(":
                stack.pop()
            i += 1
    return found


def _skip_heredocs(template: str, i: int, delimiters: list[str], found: list[tuple[str, str]]) -> int:
    """Past the bodies of here-documents starting at `i` (one after another, each to its delimiter line);
    their placeholders are noted in `found`."""
    for delimiter in delimiters:
        while i < len(template):
            end = template.find("\n", i)
            line = template[i : end if end >= 0 else len(template)]
            i = end + 1 if end >= 0 else len(template)
            if line.strip() == delimiter:
                break
            found += [(m.group(1), "inside a here-document") for m in re.finditer(r"(?<!\{)\{(\w+)\}", line)]
    return i


class Versions(_Strict):
    """Bumped by hand when behaviour changes; recorded on every trajectory."""

    env: str = Field("1", min_length=1, description="the environment's behaviour (tasks, tools, reset); recorded on every trajectory")
    verifier: str = Field("1", min_length=1, description="the verifier's behaviour: bump it when the same answer could score differently")
    harness: str = Field("1", min_length=1, description="how episodes are played (turn format, observations)")


class Resources(_Strict):
    cpus: float = Field(1.0, ge=0.01, le=64, description="at least 0.01 (Docker's smallest CPU share)")
    memory_mb: int = Field(512, ge=16, le=1_048_576, description="memory of the sandbox (local: per process, and what its /tmp and /dev/shm may hold)")
    pids: int = Field(128, ge=8, le=1_000_000, description="processes the agent may run at once")
    disk_mb: int = Field(256, ge=1, le=1_048_576, description="disk the agent's working directory may fill (docker, local; e2b: the template's)")


class Sandbox(_Strict):
    """Where the agent's commands run. Each backend's own settings subclass this (`DockerSettings`, ...; a backend
    of your own declares its model with `SANDBOX_BACKENDS.register(name, settings=...)`)."""

    backend: Annotated[str, RegistryName(SANDBOX_BACKENDS)] = Field(
        description="docker: a container per episode; e2b: E2B's cloud sandbox; local: a bubblewrap-isolated directory on this host "
        "(or a backend registered in sandbox/backends.SANDBOX_BACKENDS); each has settings of its own below"
    )
    resources: Resources = Field(Resources(), description="limits on what the agent can hold: cpus, memory_mb, pids, disk_mb")
    network: bool = Field(False, description="network access inside the sandbox; off by default")
    workdir: str = Field("/workspace", description="docker/e2b: the agent's working directory (local: a private temp dir)")
    setup: tuple[str, ...] = Field((), description="commands run once after the sandbox starts")

    @property
    def needs_bubblewrap(self) -> bool:
        """Its commands are isolated by bubblewrap on this host (which must have it)."""
        return False

    @property
    def off_site(self) -> bool:
        """It runs on someone else's network: an agent program in it reaches the model endpoint over the internet."""
        return False

    @property
    def uses_workdir(self) -> bool:
        """The agent works in `workdir` (a backend that makes a private directory of its own ignores it)."""
        return True

    @field_validator("workdir")
    @classmethod
    def _usable_workdir(cls, workdir: str) -> str:
        normal = posixpath.normpath(workdir)
        if not workdir.startswith("/"):
            raise ValueError(f"workdir {workdir!r} must be an absolute path, e.g. /workspace")
        reserved = next((d for d in ("/verify", "/proc", "/sys", "/dev", "/run/loopline") if normal == d or normal.startswith(d + "/")), None)
        if normal == "/" or reserved:
            raise ValueError(f"workdir {workdir!r} is {'the root' if normal == '/' else reserved + ', which the sandbox reserves'}; use e.g. /workspace")
        return normal


class DockerSettings(Sandbox):
    """A container per episode."""

    image: str = Field(min_length=1, description="the image (build one with `envreg image build`)")


class E2BSettings(Sandbox):
    """An E2B cloud sandbox per episode."""

    template: str = Field(min_length=1, description="the template's id (build one with `envreg e2b-template build`)")

    @property
    def off_site(self) -> bool:
        return True


class LocalSettings(Sandbox):
    """A bubblewrap-isolated directory on this host per episode."""

    unsafe_host: bool = Field(
        False,
        description="allow commands to run on the host without bubblewrap isolation (needed for `network: true`); the "
        "agent can then reach the host and its own verifier",
    )

    @property
    def needs_bubblewrap(self) -> bool:
        return not self.unsafe_host

    @property
    def uses_workdir(self) -> bool:
        return False  # (a private temporary directory per episode)

    @model_validator(mode="after")
    def _what_it_can_enforce(self) -> "LocalSettings":
        # (compared with the defaults, not "was it written": a registered spec is stored with every field)
        unenforced = [f for f in ("cpus",) if getattr(self.resources, f) != Resources.model_fields[f].default]
        if unenforced:
            raise ValueError(
                f"the local backend cannot enforce resources.{' or resources.'.join(unenforced)} (it enforces pids and "
                "memory_mb per command, disk_mb for its workdir): remove it, or use docker or e2b"
            )
        if self.network and not self.unsafe_host:
            raise ValueError(
                "the local backend isolates commands (bubblewrap) only without network; "
                "`network: true` runs them on the host: use docker or e2b, or set `unsafe_host: true`"
            )
        return self


SANDBOX_BACKENDS.declare_settings("docker", DockerSettings)
SANDBOX_BACKENDS.declare_settings("e2b", E2BSettings)
SANDBOX_BACKENDS.declare_settings("local", LocalSettings)
# Before each backend had settings of its own, every spec held these (at their defaults for the other backends):
# a stored spec is read without them, and a spec's hash is computed with them, so that it keeps its hash.
_SHARED_SANDBOX_DEFAULTS = {"image": None, "template": None, "unsafe_host": False}


class ArithmeticParams(_Strict):
    """The arithmetic generator's knobs (see `tasks.arithmetic_tasks`)."""

    max_operand: int = Field(99, ge=1, le=1_000_000, description="the largest operand of a problem")
    split: Literal["templates", "operands", "problems"] = Field(
        "templates",
        description="templates: eval holds out the form a o (b o c); operands: eval problems have an operand "
        ">= eval_min_operand, train never does; problems: one distribution, no eval problem in train",
    )
    eval_min_operand: int = Field(80, ge=2, le=1_000_000, description="split: operands: the smallest operand only eval problems have")

    @model_validator(mode="after")
    def _threshold(self) -> "ArithmeticParams":
        if self.split == "operands" and self.eval_min_operand > self.max_operand:
            raise ValueError(f"eval_min_operand ({self.eval_min_operand}) must be <= max_operand ({self.max_operand})")
        return self


MAX_GENERATED_TASKS = 100_000


class GeneratorTasks(_Strict):
    """Tasks made by a built-in generator; train and eval never share a problem."""

    kind: Literal["generator"] = Field(description="generator: tasks made by a built-in generator")
    generator: Literal["arithmetic"] = Field(description="which generator: arithmetic (expressions with + - * and parentheses)")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="the same seed makes the same tasks")
    train_size: int = Field(1000, ge=1, le=MAX_GENERATED_TASKS, description="tasks in the train split")
    eval_size: int = Field(100, ge=1, le=MAX_GENERATED_TASKS, description="tasks in the held-out eval split")
    params: ArithmeticParams = Field(ArithmeticParams(), description="the generator's knobs")


class JsonlTasks(_Strict):
    """Tasks in a JSONL file beside the YAML: one object per line with `id`, `split`, `prompt`."""

    kind: Literal["jsonl"] = Field(description="jsonl: tasks from a file")
    path: str = Field(description="the JSONL file, relative to this YAML; its text is registered with the version")


TaskSource = Annotated[Union[GeneratorTasks, JsonlTasks], Field(discriminator="kind")]


class ToolArg(_Strict):
    type: Literal["string", "integer", "number", "boolean"] = Field("string", description="the argument's JSON type, as the model is told")
    description: str = Field("", description="what the argument is, as the model is told (hermes: in the tool's signature)")
    required: bool = Field(True, description="false: the model may leave it out (the template then gets the empty string)")


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="what the model calls (tags: <NAME>...</NAME>)")
    description: str = Field(description="what the tool does, as the model is told")
    args: dict[str, ToolArg] = Field(default_factory=dict, description="the tool's named arguments (placeholders of command and stdin)")
    builtin: Literal["calculator"] | None = Field(None, description="a handler loopline runs itself")
    command: str | None = Field(
        None, description="a command template run in the sandbox, e.g. 'python3 {path}'; values are shell-quoted"
    )
    stdin: str | None = Field(None, description="template whose value is fed to the command's stdin")
    timeout_s: float = Field(10.0, gt=0, le=MAX_TIMEOUT_S, description="the longest one call may run (within budgets.wall_time_s)")

    @model_validator(mode="after")
    def _one_way_to_run(self) -> "Tool":
        if self.name in RESERVED_TOOL_NAMES:
            raise ValueError(f"name {self.name!r} is reserved: <{self.name}>...</{self.name}> ends the episode")
        if (self.builtin is None) == (self.command is None):
            raise ValueError("a tool needs exactly one of `builtin` or `command`")
        for arg in self.args:  # ({0} in a template is a position, not a name)
            if not arg.isidentifier() or not arg.isascii():
                raise ValueError(f"argument {arg[:40]!r} is not a name: letters, digits and _, not starting with a digit")
        for key in ("command", "stdin"):
            template = getattr(self, key)
            for placeholder in template_fields(template or "", key, shell=key == "command"):
                if placeholder not in self.args:
                    raise ValueError(f"template placeholder {{{placeholder}}} is not one of the tool's args")
        return self


class Reset(_Strict):
    """How a task is put into a fresh sandbox and shown to the agent."""

    system_prompt: str = Field("", description="the system message (empty: none)")
    prompt: str = Field("{prompt}", description="the first user message; {prompt} is the task's prompt")
    files: dict[str, str] = Field(
        default_factory=dict, description="path (relative to the workdir) -> task field whose text is written there"
    )
    observation: str = Field("{output}", description="how a tool's output is shown to the model, e.g. <result>{output}</result>")

    @field_validator("files")
    @classmethod
    def _relative(cls, files: dict[str, str]) -> dict[str, str]:
        return {relative_path(path, "reset.files path"): field for path, field in files.items()}

    @field_validator("prompt", "observation")
    @classmethod
    def _its_one_placeholder(cls, text: str, info: ValidationInfo) -> str:
        """`{promt}` was shown to the model as it is (the one placeholder is filled by name; other braces, JSON
        in a prompt, are text)."""
        placeholder = {"prompt": "prompt", "observation": "output"}[info.field_name]
        for name in re.findall(r"\{(\w+)\}", text):
            if name != placeholder:
                close = difflib.get_close_matches(name, [placeholder], n=1, cutoff=0.6)
                raise ValueError(f"{{{name}}} is no placeholder here; {'did you mean' if close else 'the one there is'} {{{placeholder}}}?"[:-1 if not close else None])
        return text


BUILTIN_VERIFIER_FIELDS = {"arithmetic_answer": ("expression", "answer")}  # the task fields each built-in reads
VERDICT_FILE = "verdict.json"  # written by a command verifier into its private directory
ANSWER_FILE = "answer.txt"  # the agent's final message, put there by loopline before the command runs


class Verifier(_Strict):
    """Decides the reward after the episode, on a channel the agent cannot write.

    A command verifier runs after every process the agent started has been killed, as a
    different user than the agent, in a private directory (`$LOOPLINE_VERIFY_DIR`, the
    command's working directory) that the agent can neither read nor write. There loopline
    has written `support_files`, `hidden_files` and `answer.txt` (the agent's final
    message). The agent's files are under `$LOOPLINE_WORKDIR`. Code the agent wrote must
    only run through `$LOOPLINE_AGENT_EXEC` (a JSON argv prefix that runs a command as the
    agent, unable to see the private directory), and only plain data may come back from it.
    The verdict is the JSON file `verdict.json` in the private directory, either
    {"passed": P, "total": T} (reward P/T) or {"reward": R}; stdout is never read as a
    verdict. A verdict outside `reward_range` (or P > T, T < 1) is a verifier fault: an
    infrastructure failure, retried, never a reward.

    The verifier never runs where the agent acted: it gets a fresh sandbox of the same backend (a new container,
    a new E2B sandbox, a new bubblewrap directory) into which only the agent's `outputs` are copied, as regular
    files. What else the agent left (processes, files outside its outputs, a changed system) stays behind.
    """

    builtin: Literal["arithmetic_answer"] | None = Field(None, description="a verifier loopline runs itself: arithmetic_answer (the <answer> equals the task's answer)")
    command: str | None = Field(
        None, description="run in the verifier's private directory after the agent's processes are gone; writes verdict.json"
    )
    hidden_files: dict[str, str] = Field(
        default_factory=dict, description="path (relative to the verifier's directory) -> task field, written only to verify"
    )
    support_files: dict[str, str] = Field(
        default_factory=dict, description="path (relative to the verifier's directory) -> literal text, written only to verify"
    )
    files: dict[str, str] = Field(
        default_factory=dict,
        description="path (relative to the verifier's directory) -> a file beside this YAML, written only to verify; its text "
        "is read when the spec is loaded and registered as support_files (a test runner kept as a real .py file)",
    )
    outputs: tuple[str, ...] | None = Field(
        None,
        description="the agent's files the verifier sees, as patterns relative to the workdir (`solution.py`, `src/*.py`; "
        "`*` also matches `/`): only these regular files are copied into the verifier's fresh sandbox, at most "
        f"{MAX_OUTPUT_FILES:,} files and {MAX_OUTPUT_BYTES >> 20} MiB in all. Default: every regular file of the workdir",
    )
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S, description="the longest the verifier may run; past it: a verifier fault (infra failure)")
    reward_range: tuple[float, float] = Field((0.0, 1.0), description="[low, high]: a verdict outside it is a verifier fault")

    @field_validator("hidden_files", "support_files", "files")
    @classmethod
    def _relative(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            relative_path(path, "verifier file")
            if posixpath.normpath(path) in (VERDICT_FILE, ANSWER_FILE):  # (also ./verdict.json: a pre-written verdict)
                raise ValueError(f"{path!r} is written by the verifier run itself; choose another name")
        return files

    @field_validator("outputs")
    @classmethod
    def _relative_patterns(cls, patterns: tuple[str, ...] | None) -> tuple[str, ...] | None:
        for pattern in patterns or ():
            relative_path(pattern, "verifier output")
        return patterns

    @model_validator(mode="after")
    def _one_way_to_verify(self) -> "Verifier":
        if (self.builtin is None) == (self.command is None):
            raise ValueError("a verifier needs exactly one of `builtin` or `command`")
        if self.builtin and (self.hidden_files or self.support_files or self.files or self.outputs is not None):
            raise ValueError("hidden_files, support_files, files and outputs are for command verifiers")
        low, high = self.reward_range
        if not low < high:
            raise ValueError(f"reward_range must be [low, high] with low < high, not {list(self.reward_range)}")
        return self


class Budgets(_Strict):
    max_turns: int = Field(4, ge=1, le=1000, description="model turns (agent programs: model calls) an episode may take")
    max_generated_tokens: int = Field(512, ge=1, le=10_000_000, description="tokens the model may generate over the whole episode")
    wall_time_s: float = Field(
        120.0, gt=0, le=MAX_TIMEOUT_S,
        description="seconds the environment may spend on one episode's tool calls (each also has its own timeout_s); "
        "time waiting for the model is not counted: it depends on the engine's load, not on the agent",
    )


class Agent(_Strict):
    """Your own agent program, run in the sandbox for each episode instead of loopline's harness: it calls the
    policy through an OpenAI-compatible endpoint (`OPENAI_BASE_URL`, `OPENAI_API_KEY` are set for it; nothing
    else is reachable from the sandbox), reads its task from stdin (JSON: id, prompt and the task's fields; also
    in `task.json`), uses whatever tools it has, and leaves its final answer in `answer.txt` in its working
    directory, which the verifier reads as usual. Turns are model calls (`budgets.max_turns`), tokens are the
    generated ones; `budgets.wall_time_s` is the program's own time, not counting its waits for the model."""

    command: str = Field(min_length=1, description="run in the sandbox's workdir, e.g. python3 agent.py")
    files: dict[str, str] = Field(
        default_factory=dict, description="path in the workdir -> a file beside this YAML (its text is registered with the env)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables for the program")
    sources: dict[str, str] = Field(default_factory=dict, description="(filled in at registration: each file's text)")

    @field_validator("files")
    @classmethod
    def _relative(cls, files: dict[str, str]) -> dict[str, str]:
        return {relative_path(path, "agent.files path"): source for path, source in files.items()}


class SmokeStep(_Strict):
    tool: str | None = Field(None, description="the tool this step calls (or none: the step gives the answer)")
    args: dict[str, Any] = Field(default_factory=dict, description="string values may use {task.FIELD} placeholders")
    answer: str | None = Field(None, description="the final answer; may use {task.FIELD} placeholders")


class SmokeTest(_Strict):
    """A scripted episode `envreg test` plays to check the environment end to end."""

    steps: tuple[SmokeStep, ...] = Field((), description="the scripted tool calls and answer, in order (envs played by loopline's harness)")
    replies: tuple[str, ...] = Field(
        (), description="an env with `agent`: what a scripted model answers the program's calls, in order ({task.FIELD} placeholders)"
    )
    expect_reward: float = Field(1.0, description="within the verifier's reward_range")


SANDBOX_SECTION = RegistrySection(SANDBOX_BACKENDS, key="backend")


class EnvSpec(_Strict):
    # (first: pydantic validates fields in order, so a plugin's sandbox backend is registered before it is checked)
    imports: tuple[str, ...] = Field(
        (), description="Python modules imported first wherever the env is used (a sandbox backend of your own registers "
        "its name there); each must be importable on every host that runs episodes (pip install, or PYTHONPATH)",
    )
    name: str = Field(pattern=NAME_PATTERN, description="the registry's name (`envreg add` makes NAME@VERSION)")
    description: str = Field("", description="what the environment is, for people")
    versions: Versions = Field(Versions(), description="behaviour versions, recorded on every trajectory")
    sandbox: Annotated[Sandbox, SANDBOX_SECTION] = Field(
        description="where the agent's commands run and what they may hold: `backend`, then that backend's own settings"
    )
    tasks: TaskSource = Field(description="where tasks come from: {kind: generator, ...} or {kind: jsonl, path}")
    tools: tuple[Tool, ...] = Field((), description="what the model may call (loopline's harness; an `agent` program brings its own)")
    tool_calls: Literal["tags", "hermes"] = Field(
        "tags", description="how the model calls a tool: tags (<NAME>ARG</NAME>, the starters' format) or hermes (the "
        "chat template renders the tools, the model writes <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> "
        "and tool outputs come back as the template's tool messages: Qwen2.5/3, Hermes and other instruction-tuned models)",
    )
    reset: Reset = Field(Reset(), description="how a task is put into a fresh sandbox and shown to the model")
    verifier: Verifier = Field(description="what decides the reward, on a channel the agent cannot write")
    budgets: Budgets = Field(Budgets(), description="an episode's limits: turns, generated tokens, tool time")
    smoke_test: SmokeTest | None = Field(None, description="a scripted episode `envreg test` plays end to end")
    agent: Agent | None = Field(None, description="your own agent program, run in the sandbox instead of loopline's harness")

    @model_validator(mode="before")
    @classmethod
    def _read_stored_sandboxes(cls, data: object) -> object:
        """A spec stored before each backend had settings of its own holds the others' at their defaults."""
        if not isinstance(data, dict) or not isinstance(sandbox := data.get("sandbox"), dict):
            return data
        return {**data, "sandbox": SANDBOX_SECTION.stored_read(Sandbox, sandbox, _SHARED_SANDBOX_DEFAULTS)}

    @field_validator("imports")
    @classmethod
    def _import_first(cls, modules: tuple[str, ...]) -> tuple[str, ...]:
        plugins.load(modules)
        return modules

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
        names = [t.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
        return tools

    @model_validator(mode="after")
    def _consistent(self) -> "EnvSpec":
        declared = {t.name for t in self.tools}
        for step in self.smoke_test.steps if self.smoke_test else ():
            if step.tool is not None and step.tool not in declared:
                raise ValueError(f"smoke_test uses tool {step.tool!r}, which is not declared in `tools`")
        if self.agent is not None and self.tools:
            raise ValueError("an env with `agent` runs your program, which brings its own tools: drop `tools`")
        if self.smoke_test is not None and (self.agent is None) != bool(self.smoke_test.steps):
            raise ValueError(
                "smoke_test: an env with `agent` scripts the model's `replies` to its program; other envs script tool `steps`"
            )
        if self.smoke_test is not None and self.agent is None and self.smoke_test.replies:
            raise ValueError("smoke_test.replies are for envs with `agent`; script tool `steps` here")
        if self.agent is not None and self.sandbox.network:
            raise ValueError("an agent program runs in a sandbox whose only way out is the model endpoint: set `sandbox.network: false`")
        if self.smoke_test is not None:
            low, high = self.verifier.reward_range
            if not low <= self.smoke_test.expect_reward <= high:
                raise ValueError(
                    f"smoke_test.expect_reward {self.smoke_test.expect_reward:g} is outside the verifier's "
                    f"reward_range [{low:g}, {high:g}]"
                )
        return self

    def runs_commands(self) -> bool:
        """Whether anything of this env runs as a process in its sandbox (built-ins run inside loopline)."""
        return bool(self.sandbox.setup or self.verifier.command or self.agent or any(t.command for t in self.tools))

    def task_fields(self) -> dict[str, str]:
        """Each task field the spec uses -> where it is used (every task must have it)."""
        used = {field: "verifier.builtin" for field in BUILTIN_VERIFIER_FIELDS.get(self.verifier.builtin or "", ())}
        used.update({field: f"reset.files[{path!r}]" for path, field in self.reset.files.items()})
        used.update({field: f"verifier.hidden_files[{path!r}]" for path, field in self.verifier.hidden_files.items()})
        for i, step in enumerate(self.smoke_test.steps if self.smoke_test else ()):
            for value in (step.answer, *step.args.values()):
                for field in re.findall(r"{task\.(\w+)}", value if isinstance(value, str) else ""):
                    used.setdefault(field, f"smoke_test.steps.{i}")
        for i, reply in enumerate(self.smoke_test.replies if self.smoke_test else ()):
            for field in re.findall(r"{task\.(\w+)}", reply):
                used.setdefault(field, f"smoke_test.replies.{i}")
        return used

    def canonical(self) -> dict[str, Any]:
        """Every field with defaults filled in: two files that mean the same thing hash the same. A field added
        after specs were first registered is left out while at its default, so a spec that does not use it keeps
        its hash: its registered version, and the starter policy built for it."""
        data = self.model_dump(mode="json")
        data["sandbox"] = _SHARED_SANDBOX_DEFAULTS | data["sandbox"]
        for key, default in _ADDED_LATER.items():
            if data.get(key) == default:
                del data[key]
        if data.get("smoke_test") and not data["smoke_test"]["replies"]:
            del data["smoke_test"]["replies"]  # (added later too)
        if not data["verifier"]["files"]:
            del data["verifier"]["files"]  # (added later; loaded files are in support_files: a file and its inline text hash alike)
        if data["verifier"]["outputs"] is None:
            del data["verifier"]["outputs"]  # (added later)
        return data


_ADDED_LATER = {"tool_calls": "tags", "agent": None, "imports": []}  # field -> its default


def spec_hash(canonical: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- loading, bounded, with line numbers

MAX_SPEC_BYTES = 1 << 20  # 1 MiB: specs are configuration; big data belongs in a task file


def _read_yaml(text: str, file: Path) -> tuple[Any, yaml.Node | None]:
    return read_yaml(text, file, "a spec is configuration, put data in a task file")


def _format_errors(file: Path, error: ValidationError, lines: dict[tuple, int]) -> str:
    out = []
    for err in error.errors():
        path = tuple(err["loc"])
        if len(path) > 1 and path[0] == "tasks" and path[1] in ("generator", "jsonl"):
            path = path[:1] + path[2:]  # pydantic puts the union's tag (tasks.kind) into the location
        probe = path
        while probe and probe not in lines:
            probe = probe[:-1]
        line = lines.get(probe, 1)
        field = ".".join(str(p) for p in path) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and path[:1] == ("sandbox",) and len(path) == 2:
            backends = [name for name, model in SANDBOX_BACKENDS.settings_models(Sandbox).items() if path[1] in model.model_fields]
            message = f"not a setting of this backend; it is {' and '.join(backends)}'s" if backends else message
        out.append(f"{file}:{line}: {field}: {message}")
    return "\n".join(out)


def parse_spec(text: str, file: Path) -> EnvSpec:
    data, node = _read_yaml(text, file)
    if not isinstance(data, dict):
        raise LooplineError(f"{file}:1: expected a mapping of environment fields (name, sandbox, tasks, ...)")
    try:
        return EnvSpec.model_validate(data)
    except ValidationError as exc:
        raise LooplineError(_format_errors(file, exc, line_index(node))) from None


def load_spec(path: str | Path) -> EnvSpec:
    """A spec file with the files it names beside it read in (`verifier.files`, `agent.files`): their text is
    part of the env, so a changed verifier or agent program is a new env version."""
    file = Path(path)
    spec = parse_spec(read_text(file, MAX_SPEC_BYTES, "an environment spec"), file)
    spec = _with_verifier_files(spec, file) if spec.verifier.files else spec
    return _with_agent_sources(spec, file) if spec.agent is not None else spec


def _with_agent_sources(spec: EnvSpec, file: Path) -> EnvSpec:
    assert spec.agent is not None
    sources = {}
    for path, source in spec.agent.files.items():
        try:
            sources[path] = read_text(file.parent / source, MAX_SPEC_BYTES, "an agent file")
        except LooplineError as exc:
            raise LooplineError(f"{file}: agent.files[{path!r}]: {exc}") from None
    return spec.model_copy(update={"agent": spec.agent.model_copy(update={"sources": sources})})


def _with_verifier_files(spec: EnvSpec, file: Path) -> EnvSpec:
    """`verifier.files` read into `support_files`, as if written inline (the same spec, the same hash)."""
    support = dict(spec.verifier.support_files)
    for path, source in spec.verifier.files.items():
        if path in support:
            raise LooplineError(f"{file}: verifier.files and verifier.support_files both write {path!r}; keep one")
        try:
            support[path] = read_text(file.parent / source, MAX_SPEC_BYTES, "a verifier file")
        except LooplineError as exc:
            raise LooplineError(f"{file}: verifier.files[{path!r}]: {exc}") from None
    return spec.model_copy(update={"verifier": spec.verifier.model_copy(update={"support_files": support, "files": {}})})


def json_schema() -> dict[str, Any]:
    return EnvSpec.model_json_schema()
