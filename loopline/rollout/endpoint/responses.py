"""`/v1/responses`, the OpenAI Responses API (the OpenAI Agents SDK's default), as the chat completion it
amounts to: a request's `instructions` and `input` items become chat messages, its function `tools` chat tools,
and the chat reply becomes `output` items. The episode serves it through its chat path, so the chaining and
token-exactness of `openai_api` hold alike: the Agents SDK sends the whole conversation each call (its earlier
`function_call` items and their `function_call_output`s), which extends the previous call's ids.

The subset served is what agents send: `input` as text or items (`message` with text parts, `function_call`,
`function_call_output`; `reasoning` items carry nothing here and are skipped), function tools, `tool_choice`,
`max_output_tokens`, `parallel_tool_calls`, `stream` (the events the SDK reads: the response created, each
output item added and done with its text or arguments, the response completed). What would change the answer
and is not served is a 400 naming it: `previous_response_id` and `conversation` (loopline keeps no responses),
hosted tools (web search, file search, ...), non-text `text.format`, non-text input parts."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from loopline.rollout.endpoint.api import RequestError


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request a Responses request amounts to."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name):
            raise RequestError(f"{name}: not served (loopline keeps no responses); send the whole conversation as `input`")
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type", "text") != "text":
        raise RequestError(f"text.format: {text['format'].get('type')!r} is not served (the output is not constrained); use text")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise RequestError("instructions: a string")
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise RequestError("input: a string, or a list of input items")
    for item in items:
        _add(messages, item)
    chat: dict[str, Any] = {"messages": messages, "tools": [_tool(t) for t in body.get("tools") or []]}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    for key, value in (("tool_choice", choice), ("max_tokens", body.get("max_output_tokens")),
                       ("parallel_tool_calls", body.get("parallel_tool_calls")), ("top_logprobs", body.get("top_logprobs"))):
        if value is not None:
            chat[key] = value
    return chat


def _add(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"input: a message's role is system, developer, user or assistant, not {role!r}")
        messages.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"))})
    elif kind == "function_call":
        call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)):
            raise RequestError("input: a function_call item has a call_id, a name and its arguments as a JSON string")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the reply's text and its calls: one assistant message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise RequestError("input: a function_call_output item names the call_id it answers")
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output if isinstance(output, str) else _text(output)})
    elif kind != "reasoning":  # (a reasoning item of an earlier reply: nothing the policy wrote is in it here)
        raise RequestError(f"input: items of type {kind!r} are not served (messages, function_call, function_call_output)")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError("input: a message's content is a string or a list of text parts")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise RequestError(f"input: content parts of type {part.get('type') if isinstance(part, dict) else part!r} are not served (text only)")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _tool(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise RequestError(f"tools: {kind!r} tools are not served (hosted tools run at OpenAI); function tools only")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}}


def response(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The chat reply as a Responses API `response`: its text as a message item, each tool call a function_call."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("content"):
        output.append({
            "type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": message["content"], "annotations": [], "logprobs": []}],
        })
    for call in message.get("tool_calls") or ():
        output.append({
            "type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed",
        })
    usage = chat["usage"]
    length = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": chat["model"],
        "status": "incomplete" if length else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if length else None, "error": None,
        "output": output, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": {"format": {"type": "text"}}, "metadata": body.get("metadata") or {}, "truncation": "disabled",
        "usage": {
            "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"], "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def events(done: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished response as the stream of events the SDK reads (each with its `type` and `sequence_number`)."""
    out: list[dict[str, Any]] = []

    def event(kind: str, **fields: Any) -> None:
        out.append({"type": kind, "sequence_number": len(out), **fields})

    event("response.created", response={**done, "status": "in_progress", "output": []})
    for index, item in enumerate(done["output"]):
        if item["type"] == "message":
            event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []})
            part = item["content"][0]
            event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part={**part, "text": ""})
            event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0, delta=part["text"], logprobs=[])
            event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=part["text"], logprobs=[])
            event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
        else:
            event("response.output_item.added", output_index=index, item={**item, "status": "in_progress", "arguments": ""})
            event("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
            event("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"])
        event("response.output_item.done", output_index=index, item=item)
    event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)
    return out


def sse(events_: list[dict[str, Any]]) -> list[str]:
    """Server-sent events as the Responses API frames them: the event's type named on its own line."""
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events_]
