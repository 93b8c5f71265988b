"""Turns in token space: the first prompt from the chat template, and observations appended as ids.

The history is never re-tokenised: each model call's prompt is the previous
prompt + the ids the engine generated + the ids of the new observation turn,
so what the learner trains on is exactly what the model saw and said
(token-exact trajectories). The observation turn's spelling is read off the tokenizer's own
chat template once, at construction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from loopline.rollout.endpoint.tool_formats import FORMATS, ToolCallFormat, of_template

_ASSISTANT = "\u0001LOOPLINE_ASSISTANT\u0001"
_OBSERVATION = "\u0001LOOPLINE_OBSERVATION\u0001"


_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "d", "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[str, bool] = {}  # by ChatFormat.version (the template and vocabulary's digest)

# The tool prompt loopline writes into the system message when a template does not render `tools` itself:
# Hermes's, as Qwen2.5's template writes it, so the model's calls come back in the `<tool_call>` blocks the
# endpoint parses (`openai_api.parse_tool_calls`).
HERMES_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_tool_prompt(tools: list[dict]) -> str:
    return HERMES_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


@dataclass(frozen=True)
class ChatFormat:
    tokenizer: Any  # a transformers tokenizer with a chat template
    turn_close: str  # what the template writes after an assistant message, e.g. "<|im_end|>\n"
    observation_prefix: str  # from the end of an assistant turn to the observation text
    observation_suffix: str  # from the observation text to the start of the next assistant message
    observation_role: str
    version: str
    # Demonstration turns placed before every task (a policy's few-shot prompt), as chat messages.
    few_shot: tuple[dict, ...] = ()
    # Tools the chat template describes to the model itself (`tool_calls: hermes`), in OpenAI's function format.
    tools: tuple[dict, ...] = ()

    @classmethod
    def for_policy(cls, model_dir) -> "ChatFormat":
        """The tokenizer of a policy directory, with its few-shot turns from `loopline_prompt.json` if any."""
        from pathlib import Path

        from transformers import AutoTokenizer

        chat = cls.from_tokenizer(AutoTokenizer.from_pretrained(model_dir))
        prompt = Path(model_dir) / "loopline_prompt.json"
        if prompt.is_file():
            few_shot = tuple(json.loads(prompt.read_text()).get("few_shot", ()))
            return dataclasses.replace(chat, few_shot=few_shot)
        return chat

    @classmethod
    def from_tokenizer(cls, tokenizer, observation_role: str = "user") -> "ChatFormat":
        def render(messages, generation_prompt):
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}]
        with_assistant = render(base, False)
        with_observation = render(base + [{"role": observation_role, "content": _OBSERVATION}], True)
        if not with_observation.startswith(with_assistant):
            raise ValueError("the chat template rewrites earlier turns; observations cannot be appended as ids")
        turn_close = with_assistant.split(_ASSISTANT, 1)[1]
        prefix, suffix = with_observation[len(with_assistant) :].split(_OBSERVATION)
        digest = hashlib.sha256(
            json.dumps([tokenizer.chat_template, sorted(tokenizer.get_vocab().items())]).encode()
        ).hexdigest()[:16]
        return cls(tokenizer, turn_close, prefix, suffix, observation_role, f"{type(tokenizer).__name__}:{digest}")

    def with_tools(self, tools: tuple[dict, ...]) -> "ChatFormat":
        """The template's own tool calling: it renders `tools` into the first prompt, and a tool's output comes
        back as its `tool` message. A template that ignores `tools` cannot be used so (one line says so)."""
        if not tools or not self.renders_tools():
            raise ValueError(
                "the policy's chat template does not render tools (no tool calling of its own); use the env's tool_calls: tags"
            )
        try:
            again = ChatFormat.from_tokenizer(self.tokenizer, observation_role="tool")
        except Exception as exc:  # the template's own error for a role it does not know
            raise ValueError(f"the policy's chat template cannot show a tool's output as a tool message ({exc})") from None
        return dataclasses.replace(again, few_shot=self.few_shot, tools=tuple(tools))

    def renders_tools(self) -> bool:
        """Whether the chat template writes a request's `tools` into the prompt (SmolLM2's drops them)."""
        if self.version not in _RENDERS_TOOLS:
            plain = [{"role": "user", "content": "q"}]
            render = lambda **kw: self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, **kw)  # noqa: E731
            _RENDERS_TOOLS[self.version] = render(tools=[_PROBE_TOOL]) != render()
        return _RENDERS_TOOLS[self.version]

    def tool_format(self) -> ToolCallFormat:
        """How the policy writes a tool call: its template's convention, or Hermes's where the template drops
        tools (loopline then shows them as Hermes's tool prompt)."""
        return of_template(self.tokenizer.chat_template) if self.renders_tools() else FORMATS["hermes"]

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def initial_ids(self, system: str, user: str) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + list(self.few_shot) + [{"role": "user", "content": user}]
        tools = {"tools": list(self.tools)} if self.tools else {}
        return self._encode(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **tools))

    def observation_ids(self, text: str, generated_ids: list[int]) -> list[int]:
        """Ids to append after an assistant turn: the rest of its closing, the observation turn, the next opening."""
        return self.continuation_ids(self.observation_prefix + text + self.observation_suffix, generated_ids)

    def observations_ids(self, texts: list[str], generated_ids: list[int]) -> list[int]:
        """Ids to append after a turn that called several tools: each output its own message, as the template
        renders consecutive ones (Qwen's puts them in one user turn, one <tool_response> each)."""
        if len(texts) == 1:
            return self.observation_ids(texts[0], generated_ids)
        marks = [f"\u0001LOOPLINE_OBSERVATION_{i}\u0001" for i in range(len(texts))]
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT}]
        with_assistant = self.tokenizer.apply_chat_template(base, tokenize=False)
        rendered = self.tokenizer.apply_chat_template(
            base + [{"role": self.observation_role, "content": m} for m in marks], tokenize=False, add_generation_prompt=True
        )
        pieces = re.split("|".join(map(re.escape, marks)), rendered[len(with_assistant) :])
        if len(pieces) != len(texts) + 1:
            raise ValueError(f"the chat template does not show each of {len(texts)} tool outputs once")
        return self.continuation_ids(pieces[0] + "".join(text + after for text, after in zip(texts, pieces[1:])), generated_ids)

    def continuation_ids(self, after_turn: str, generated_ids: list[int]) -> list[int]:
        """Ids to append after the generated ids of an assistant turn: the rest of the turn's closing (the
        generated eos is part of it already), then `after_turn`, the template's text for what follows."""
        close = self.turn_close
        eos_text = self.tokenizer.decode([self.eos_id]) if generated_ids and generated_ids[-1] == self.eos_id else ""
        if eos_text and close.startswith(eos_text):
            close = close[len(eos_text) :]
        return self._encode(close + after_turn)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
