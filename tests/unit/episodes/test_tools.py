"""Tool calls parsed in the Hermes/ChatML format (well-formed, malformed, several), the calculator's
exact arithmetic without eval, and concurrent execution where every failure is an observation."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from models.environments.tools import CALCULATOR, HermesParser, Tool, calculate, run_tool_calls, tools_by_name


def test_a_well_formed_call():
    content, calls = HermesParser().parse(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>')
    assert content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "123*456"}, "")]


def test_several_calls_in_order_and_string_arguments():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    content, calls = HermesParser().parse(text)
    assert content == "and"
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>', "not JSON"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+', "without </tool_call>"),
])
def test_malformed_calls_are_reported_not_raised(text, error):
    _, calls = HermesParser().parse(text)
    assert len(calls) == 1 and error in calls[0].error


def test_no_call():
    assert HermesParser().parse("The answer is 5.") == ("The answer is 5.", [])


@pytest.mark.parametrize("expr, value", [("123456*654321", str(123456 * 654321)), ("(2+3)*-4", "-20"),
                                         ("7/2", "3.5"), ("8/2", "4"), ("2**10 % 1000", "24"), ("99999+1", "100000")])
def test_calculator_is_exact(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "open('/etc/passwd')", "x + 1",
                                  "(1).__class__", "9**9**9", "'a' * 3", "1 +"])
def test_calculator_refuses_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        calculate(expr)


def test_calls_run_concurrently_and_every_failure_is_an_observation():
    barrier = threading.Barrier(2, timeout=10)  # met only if two episodes' calls run at the same time
    meet = Tool("meet", "", {}, lambda: barrier.wait() * 0 or "met")
    slow = Tool("slow", "", {}, lambda seconds: time.sleep(seconds) or "woke")
    boom = Tool("boom", "", {}, lambda: 1 / 0)
    tools = [tools_by_name([CALCULATOR, meet, slow, boom])] * 3
    _, calls = HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2*21"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "os"}}</tool_call>'
        '<tool_call>not json</tool_call>')
    meeting = HermesParser().parse('<tool_call>{"name": "meet", "arguments": {}}</tool_call>')[1]
    with ThreadPoolExecutor(8) as pool:
        out = run_tool_calls([(0, c) for c in calls] + [(1, meeting[0]), (2, meeting[0])], tools, 5.0, pool)
        late = run_tool_calls([(0, HermesParser().parse(
            '<tool_call>{"name": "slow", "arguments": {"seconds": 1}}</tool_call>')[1][0])], tools, 0.2, pool)
    assert [(r.content, r.error) for r in out[1]] == [("met", False)] == [(r.content, r.error) for r in out[2]]
    results = out[0]
    assert (results[0].content, results[0].error) == ("42", False)
    assert "unknown tool 'nope'" in results[1].content and results[1].error
    assert "ZeroDivisionError" in results[2].content
    assert "unsupported expression" in results[3].content
    assert "not JSON" in results[4].content and all(r.error for r in results[1:])
    assert "ran past 0.2 s" in late[0][0].content
