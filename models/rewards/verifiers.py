"""Verifiable rewards a user would otherwise write by hand, as reward functions (``reward.functions``),
each 1.0 or 0.0 per sample:

- ``models.rewards.verifiers:math_reward``: the response's final answer equals the ``answer`` column as
  mathematics (``math-verify``);
- ``models.rewards.verifiers:exact_match_reward``: the final answer equals ``answer`` after
  :func:`normalize_text`;
- ``models.rewards.verifiers:format_reward``: the whole response matches ``reward.format_pattern``
  (``re.fullmatch``, DOTALL).

The final answer of a response (and of an ``answer`` cell, which may hold a whole GSM8K solution)
is, by :func:`extract_final_answer`: the content of the last ``\\boxed{...}``, else of the last
``<answer>...</answer>``, else what follows the last ``####`` on its line, else the last number.
An ``answer`` cell may also be a list of accepted answers (any one matches).

``math_reward`` parses both sides with ``math-verify`` (Hugging Face's LaTeX/expression parser
and SymPy comparison, the grader of Open R1 and TRL's examples): ``\\frac{1}{2}``, ``0.5`` and
``50\\%`` are equal, so are ``1,000`` and ``1000``, ``x+1`` and ``1+x``; ``3`` and ``3.0001`` are
not. An answer ``math-verify`` cannot parse is compared as normalised text.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from typing import Any, List, Optional, Sequence

DEFAULT_FORMAT_PATTERN = r"<think>.*</think>\s*<answer>.*</answer>"
"""DeepSeek-R1's format: reasoning in ``<think>`` tags, then the answer in ``<answer>`` tags."""

_NUMBER = re.compile(r"(?:-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+)(?:\s*\\?%)?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: no answer


def extract_final_answer(text: str) -> Optional[str]:
    """The final answer written in ``text`` (see the module docstring for the order), stripped;
    None if there is none."""
    found = _last_boxed(text)
    if found is None:
        tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.DOTALL)
        found = tags[-1] if tags else None
    if found is None and "####" in text:
        found = text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    if found is None:
        numbers = _NUMBER.findall(text)
        found = numbers[-1] if numbers else None
    if found is None:
        return None
    found = found.strip().rstrip(".").strip()
    return found or None


def normalize_text(text: str) -> str:
    """Unicode NFKC, case folded, whitespace collapsed, surrounding quotes, ``$`` and final
    punctuation stripped, thousands separators dropped from plain numbers (``"1,000"`` → ``"1000"``)."""
    text = " ".join(unicodedata.normalize("NFKC", str(text)).casefold().split())
    text = text.strip().strip("\"'`").strip()
    text = re.sub(r"^\\?\$|\\?\$$", "", text).strip().rstrip(".!;:").strip()
    return text.replace(",", "") if _THOUSANDS.match(text) else text


def _gold_answers(answer: Any) -> List[str]:
    """The accepted answers of one ``answer`` cell: its final answer(s), else the cell as text."""
    cells = answer if isinstance(answer, (list, tuple)) else [answer]
    out = []
    for cell in cells:
        if cell is None:
            continue
        text = str(cell)
        final = extract_final_answer(text) if re.search(r"\\boxed\{|\\fbox\{|<answer>|####", text) else None
        out.append(final if final is not None else text.strip())
    return out


def _timeout() -> Optional[int]:
    """math-verify's time limit uses SIGALRM, which only the main thread may set."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(gold: str, predicted: str) -> bool:
    """``predicted`` equals ``gold`` as mathematics (``math-verify``), or as normalised text when
    either side does not parse."""
    from math_verify import parse, verify

    g, p = normalize_text(gold), normalize_text(predicted)
    if g == p:
        return True
    timeout = _timeout()
    gold_parsed = parse(f"${g}$", parsing_timeout=timeout)
    pred_parsed = parse(f"${p}$", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def math_reward(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> List[float]:
    """1.0 where the response's final answer equals the ``answer`` column as mathematics, else 0.0."""
    out = []
    for response, gold in zip(responses, answer):
        predicted = extract_final_answer(response)
        out.append(float(predicted is not None and any(math_equal(g, predicted) for g in _gold_answers(gold))))
    return out


def exact_match_reward(prompts: Sequence[str], responses: Sequence[str], answer: Sequence[Any]) -> List[float]:
    """1.0 where the response's final answer (else the whole response) equals the ``answer`` column
    after :func:`normalize_text`, else 0.0."""
    out = []
    for response, gold in zip(responses, answer):
        predicted = normalize_text(extract_final_answer(response) or response)
        out.append(float(any(normalize_text(g) == predicted for g in _gold_answers(gold))))
    return out


def format_reward(prompts: Sequence[str], responses: Sequence[str],
                  format_pattern: str = DEFAULT_FORMAT_PATTERN) -> List[float]:
    """1.0 where the whole response (surrounding whitespace aside) matches ``format_pattern``
    (``re.fullmatch`` with DOTALL; from ``reward.format_pattern``), else 0.0."""
    pattern = re.compile(format_pattern, flags=re.DOTALL)
    return [float(pattern.fullmatch(r.strip()) is not None) for r in responses]
