"""Tool-call parsers: find the calls in a model's message.

A parser never raises on model output: what it cannot read comes back in `errors`, for
the environment to show the agent. Add a format by subclassing `ToolCallParser` and
adding it to `PARSERS`. What a model writes while thinking (`<think>…</think>`) is never an action: parsers
and every env's reading of a message (`agentrl.env.grading.extract_code`) see `without_thoughts(text)`.
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from agentrl.env.tools import ToolCall

_THOUGHT = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def without_thoughts(text: str) -> str:
    """The message with its reasoning taken out: each `<think>…</think>`, an unclosed `<think>` to the end, and
    everything before a `</think>` the message never opened (a template whose generation prompt opens the
    thought). A tool call or code block written while thinking is thereby text, never executed."""
    close, open_ = text.find("</think>"), text.find("<think>")
    if close >= 0 and (open_ < 0 or close < open_):
        text = text[close + len("</think>") :]
    return _THOUGHT.sub("", text)


def has_thought(text: str) -> bool:
    """True when the message holds reasoning (`<think>` or `</think>`)."""
    return "<think>" in text or "</think>" in text


class ParsedAction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str
    """the message with the tool calls taken out"""
    calls: list[ToolCall]
    errors: list[str]
    """one message per call that could not be read, meant for the agent"""
    written: list[ToolCall | str] = []
    """the calls and errors in the order the message wrote them, so that results line up with calls (a chat
    template shows tool results by position); left out: the errors, then the calls"""

    @model_validator(mode="before")
    @classmethod
    def _in_order(cls, data: Any) -> Any:
        if isinstance(data, dict) and "written" not in data:
            data = {**data, "written": [*data.get("errors", []), *data.get("calls", [])]}
        return data


class ToolCallParser(abc.ABC):
    """Set `name` in ALL subclasses."""

    name: str

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedAction: ...

    @abc.abstractmethod
    def format(self, call: ToolCall) -> str:
        """A call as the model would write it: `parse(format(c))` reads back `c`."""


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes and Qwen models write them.

    `arguments` may also be a JSON string holding the object (some models double-encode).
    An opening tag without its closing tag is a malformed call (the message was cut).
    """

    name = "hermes"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        text = without_thoughts(text)
        written = [_read_call(body.strip()) for body in self._call.findall(text)]
        rest = self._call.sub("", text)
        if "<tool_call>" in rest:  # after every closed call: the non-greedy match took any earlier opening
            written.append("a <tool_call> was opened but never closed with </tool_call>")
            rest = rest[: rest.index("<tool_call>")]
        calls = [c for c in written if isinstance(c, ToolCall)]
        errors = [e for e in written if isinstance(e, str)]
        return ParsedAction(content=rest.strip(), calls=calls, errors=errors, written=written)

    def format(self, call: ToolCall) -> str:
        return f"<tool_call>\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n</tool_call>"


def _read_call(body: str) -> ToolCall | str:
    """A ToolCall, or a message saying what is wrong with the call's JSON."""
    try:
        obj = _loads(body)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): {body[:200]}"
    except ValueError as e:
        return f"the tool call's JSON cannot be read ({e}): {body[:200]}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return f'a tool call must be a JSON object with a string "name": {body[:200]}'
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = _loads(args)
        except ValueError as e:
            return f'the "arguments" of {obj["name"]} are a string that is not a JSON object ({e})'
    if not isinstance(args, dict):
        return f'the "arguments" of {obj["name"]} must be a JSON object, got {type(args).__name__}'
    return ToolCall(name=obj["name"], arguments=args)


def _loads(text: str) -> Any:
    """`json.loads`, where every way the model's text can fail it is a ValueError (json.loads also raises one for an
    integer past Python's 4300 digits), and so is text that is no characters: JSON's `\\ud800` escape makes half a
    surrogate pair, which no file or process can take (the sandbox's executor failed on it). NaN and Infinity are
    not JSON (Python's json reads them): a call's arguments go back out as JSON, to an OpenAI client too."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if (why := not_text(value)) is not None:
        raise ValueError(why)
    return value


def not_text(value: Any) -> str | None:
    """Why JSON's `value` holds what is no text, or None: half of a UTF-16 surrogate pair (JSON's unpaired `\\ud800`
    escape, Python's `surrogateescape` for undecodable bytes), which no file, process or tokenizer takes."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        return f"{e.object[e.start : e.end]!r} is half of a UTF-16 surrogate pair, not a character"
    except RecursionError:
        return "nested too deeply"
    return None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen": HermesParser}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid parsers: {sorted(PARSERS)}")
    return PARSERS[name]()
