"""The environment declaration: what a YAML file may say, validated by pydantic.

`envreg schema` exports this as JSON Schema for editors. Errors name the
file, the line and the field path (see `load_spec`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loopline.store.errors import LooplineError

NAME_PATTERN = r"^[a-z][a-z0-9_\-]{0,62}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Versions(_Strict):
    """Bumped by hand when behaviour changes; recorded on every trajectory."""

    env: str = "1"
    verifier: str = "1"
    harness: str = "1"


class Resources(_Strict):
    cpus: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(512, ge=16)
    pids: int = Field(128, ge=8)
    disk_mb: int = Field(256, ge=1)


class Sandbox(_Strict):
    backend: Literal["docker", "e2b", "local"]
    image: str | None = Field(None, description="docker: image name (build with `envreg image build`)")
    template: str | None = Field(None, description="e2b: template id")
    resources: Resources = Resources()
    network: bool = Field(False, description="network access inside the sandbox; off by default")
    workdir: str = "/workspace"
    setup: tuple[str, ...] = Field((), description="commands run once after the sandbox starts")

    @model_validator(mode="after")
    def _backend_needs(self) -> "Sandbox":
        if self.backend == "docker" and not self.image:
            raise ValueError("the docker backend needs `image`")
        if self.backend == "e2b" and not self.template:
            raise ValueError("the e2b backend needs `template`")
        return self


class GeneratorTasks(_Strict):
    """Tasks made by a built-in generator; train and eval come from disjoint templates."""

    kind: Literal["generator"]
    generator: Literal["arithmetic"]
    seed: int = 0
    train_size: int = Field(1000, ge=1)
    eval_size: int = Field(100, ge=1)
    params: dict[str, Any] = Field(default_factory=dict)


class JsonlTasks(_Strict):
    """Tasks in a JSONL file beside the YAML: one object per line with `id`, `split`, `prompt`."""

    kind: Literal["jsonl"]
    path: str


TaskSource = Annotated[Union[GeneratorTasks, JsonlTasks], Field(discriminator="kind")]


class ToolArg(_Strict):
    type: Literal["string", "integer", "number", "boolean"] = "string"
    description: str = ""
    required: bool = True


class Tool(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str
    args: dict[str, ToolArg] = Field(default_factory=dict)
    builtin: Literal["calculator"] | None = Field(None, description="a handler loopline runs itself")
    command: str | None = Field(
        None, description="a command template run in the sandbox, e.g. 'python3 {path}'; values are shell-quoted"
    )
    stdin: str | None = Field(None, description="template whose value is fed to the command's stdin")
    timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _one_way_to_run(self) -> "Tool":
        if (self.builtin is None) == (self.command is None):
            raise ValueError("a tool needs exactly one of `builtin` or `command`")
        for template in (self.command, self.stdin):
            for placeholder in re.findall(r"{(\w+)}", template or ""):
                if placeholder not in self.args:
                    raise ValueError(f"template placeholder {{{placeholder}}} is not one of the tool's args")
        return self


class Reset(_Strict):
    """How a task is put into a fresh sandbox and shown to the agent."""

    system_prompt: str = ""
    prompt: str = Field("{prompt}", description="the first user message; {prompt} is the task's prompt")
    files: dict[str, str] = Field(default_factory=dict, description="path -> task field whose text is written there")
    observation: str = Field("{output}", description="how a tool's output is shown to the model, e.g. <result>{output}</result>")


class Verifier(_Strict):
    """Run by loopline after the episode; the agent's own claims are never read."""

    builtin: Literal["arithmetic_answer"] | None = None
    command: str | None = Field(None, description="run in the sandbox after hidden files are copied in")
    hidden_files: dict[str, str] = Field(default_factory=dict, description="path -> task field, copied in only to verify")
    support_files: dict[str, str] = Field(default_factory=dict, description="path -> literal text, copied in only to verify")
    timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _one_way_to_verify(self) -> "Verifier":
        if (self.builtin is None) == (self.command is None):
            raise ValueError("a verifier needs exactly one of `builtin` or `command`")
        return self


class Budgets(_Strict):
    max_turns: int = Field(4, ge=1)
    max_generated_tokens: int = Field(512, ge=1)
    wall_time_s: float = Field(120.0, gt=0)


class SmokeStep(_Strict):
    tool: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    answer: str | None = Field(None, description="the final answer; may use {task.FIELD} placeholders")


class SmokeTest(_Strict):
    """A scripted episode `envreg test` plays to check the environment end to end."""

    steps: tuple[SmokeStep, ...]
    expect_reward: float = 1.0


class EnvSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    versions: Versions = Versions()
    sandbox: Sandbox
    tasks: TaskSource
    tools: tuple[Tool, ...] = ()
    reset: Reset = Reset()
    verifier: Verifier
    budgets: Budgets = Budgets()
    smoke_test: SmokeTest | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
        names = [t.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")
        return tools

    @model_validator(mode="after")
    def _smoke_uses_declared_tools(self) -> "EnvSpec":
        declared = {t.name for t in self.tools}
        for step in self.smoke_test.steps if self.smoke_test else ():
            if step.tool is not None and step.tool not in declared:
                raise ValueError(f"smoke_test uses tool {step.tool!r}, which is not declared in `tools`")
        return self

    def canonical(self) -> dict[str, Any]:
        """Every field with defaults filled in: two files that mean the same thing hash the same."""
        return self.model_dump(mode="json")


def spec_hash(canonical: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# --------------------------------------------------------------------------- loading with line numbers


def _line_index(node: yaml.Node, path: tuple = (), index: dict | None = None) -> dict[tuple, int]:
    """Map each field path in a YAML document to its 1-based line."""
    index = {} if index is None else index
    index[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _line_index(value, (*path, key.value), index)
            index[(*path, key.value)] = key.start_mark.line + 1  # the key's line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_index(item, (*path, i), index)
    return index


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
        out.append(f"{file}:{line}: {field}: {err['msg']}")
    return "\n".join(out)


def parse_spec(text: str, file: Path) -> EnvSpec:
    try:
        node = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark else str(file)
        raise LooplineError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise LooplineError(f"{file}:1: expected a mapping of environment fields (name, sandbox, tasks, ...)")
    try:
        return EnvSpec.model_validate(data)
    except ValidationError as exc:
        raise LooplineError("invalid environment spec\n" + _format_errors(file, exc, _line_index(node))) from None


def load_spec(path: str | Path) -> EnvSpec:
    file = Path(path)
    if not file.is_file():
        raise LooplineError(f"{file}: no such file")
    return parse_spec(file.read_text(), file)


def json_schema() -> dict[str, Any]:
    return EnvSpec.model_json_schema()
