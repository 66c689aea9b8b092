"""Tools for multi-turn episodes: their schemas (the transformers ``tools=`` convention), the parser
of tool calls in the format the chat template defines, the calculator, and concurrent execution.

A tool is a Python callable plus its JSON schema (``{"type": "function", "function": {"name", "description",
"parameters"}}``), the form ``tokenizer.apply_chat_template(..., tools=...)`` renders. A call the
model writes is parsed by the template's parser (:class:`HermesParser` for ChatML/Qwen/Hermes:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); a call that does not parse, names an
unknown tool, has bad arguments, raises or runs past its timeout becomes a ``tool`` message with the
error, which the model reads on its next turn (and ``episode/tool_errors_mean`` counts): never a crash.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple


@dataclass(frozen=True)
class Tool:
    """A callable the model may call: ``fn(**arguments) -> str``, and the schema the template shows."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments (``{"type": "object", "properties": {...}, "required": [...]}``)."""
    fn: Callable[..., Any]

    def schema(self) -> Dict[str, Any]:
        """The transformers/OpenAI tool schema passed to ``apply_chat_template(tools=...)``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass
class ToolCall:
    """One call the model wrote: ``name`` and ``arguments``, or ``error`` when it does not parse."""

    name: str = ""
    arguments: Dict[str, Any] = field(default_factory=dict)
    error: str = ""
    raw: str = ""

    def as_message_call(self) -> Dict[str, Any]:
        """The call as an assistant message's ``tool_calls`` entry (transformers convention)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser(Protocol):
    stop_strings: Tuple[str, ...]
    """Text that ends a call: generation stops there so the tool runs before the model goes on."""

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        """The assistant turn's text → its content (calls removed) and its calls in order."""


class HermesParser:
    """Hermes/Qwen2/ChatML calls: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``; an
    opened call that is never closed (the turn hit its token limit) is a malformed call."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"
    stop_strings = (close_tag,)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        calls: List[ToolCall] = []
        pattern = re.compile(re.escape(self.open_tag) + r"(.*?)(" + re.escape(self.close_tag) + r"|$)", re.DOTALL)
        for m in pattern.finditer(text):
            body = m.group(1).strip()
            if not m.group(2):
                calls.append(ToolCall(error=f"{self.open_tag} without {self.close_tag}", raw=body))
            else:
                calls.append(_call_from_json(body))
        content = pattern.sub("", text).strip()
        return content, calls


def _call_from_json(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(error=f"the call is not JSON ({err.msg} at character {err.pos})", raw=body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(error='the call must be a JSON object {"name": <string>, "arguments": <object>}', raw=body)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire format)
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], error="the call's arguments must be a JSON object", raw=body)
    return ToolCall(name=obj["name"], arguments=args, raw=body)


PARSERS: Dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}
"""Tool-call formats by name (``rollout.tool_parser``); add one for a template with another format."""


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"rollout.tool_parser={name!r} is not one of {sorted(PARSERS)}")
    return PARSERS[name]()


@dataclass
class ToolResult:
    """A call's answer (the ``tool`` message's content) and whether it was an error."""

    name: str
    content: str
    error: bool


def run_tool_calls(calls: Sequence[Tuple[int, ToolCall]], tools: Sequence[Mapping[str, Tool]], timeout_s: float,
                   pool: ThreadPoolExecutor) -> Dict[int, List[ToolResult]]:
    """Run every episode's calls concurrently, each with ``timeout_s``: ``calls`` are (episode index,
    call), ``tools[k]`` episode k's tools by name. Results per episode in call order. A timed-out call
    is answered with an error (its thread cannot be killed; the sandboxed Python tool kills its own
    process at its wall-clock limit)."""
    futures = []
    for k, call in calls:
        tool = tools[k].get(call.name)
        if call.error or tool is None:
            why = call.error or f"unknown tool {call.name!r} (tools: {sorted(tools[k])})"
            futures.append((k, call, None, why))
        else:
            futures.append((k, call, pool.submit(tool.fn, **call.arguments), ""))
    out: Dict[int, List[ToolResult]] = {}
    for k, call, fut, why in futures:
        if fut is not None:
            try:
                out.setdefault(k, []).append(ToolResult(call.name, str(fut.result(timeout=timeout_s)), False))
                continue
            except FutureTimeout:
                why = f"the call ran past {timeout_s:g} s"
            except Exception as err:  # the tool's failure is the model's observation
                why = f"{type(err).__name__}: {err}"
        out.setdefault(k, []).append(ToolResult(call.name or "invalid", f"error: {why}", True))
    return out


# ---- the calculator: exact arithmetic on an AST (no eval) -----------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CALC_DIGITS = 1000
"""A result or power exponent larger than this many digits is refused (``9**9**9`` would hang)."""


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(int(left)))) > MAX_CALC_DIGITS:
            raise ValueError("the power is too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_CALC_DIGITS * 3.33:
            raise ValueError("the result is too large")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` (numbers, + - * / // % **, parentheses), exact on
    integers; anything else (names, calls, attributes) is refused."""
    try:
        tree = ast.parse(str(expression), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression!r}: {err.msg}") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression exactly (+, -, *, /, //, %, **, parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  calculate)


def python_tool(timeout_s: float = 5.0, memory_mb: int = 256) -> Tool:
    """Python code run in the bubblewrap sandbox (:mod:`models.environments.sandbox`); its stdout (and stderr) back."""
    from models.environments.sandbox import run_python

    def run(code: str) -> str:
        return run_python(code, wall_s=timeout_s, memory_mb=memory_mb).observation()

    return Tool("python", "Run Python 3 code in a sandbox without network; print what you need.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run)


def tools_by_name(tools: Optional[Sequence[Tool]]) -> Dict[str, Tool]:
    return {t.name: t for t in tools or ()}
