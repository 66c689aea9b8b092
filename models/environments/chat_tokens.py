"""Token-exact multi-turn prompts: each turn's prompt is the previous ids, the sampled tokens as
sampled, and the chat template's rendering of only the NEW messages, tokenised on their own.

Re-rendering the whole conversation each turn and tokenising it again would not give back what the
policy sampled: BPE merges across the boundary between a sampled token and the text after it
(``"4"`` + ``"2"`` → ``"42"``), a model may sample a non-canonical split of a word, and templates
rewrite past turns (strip reasoning, reformat tool calls). The trainer must score exactly the
tokens the engine sampled, so those are never re-tokenised.

The new part is found by rendering: the conversation so far, a placeholder assistant turn (content
:data:`SENTINEL`, no tool calls), the new messages and the generation prompt; everything after the
placeholder is the template's closing of the assistant turn plus the new turns. Where the sampled
turn already ended with the template's end-of-turn token (e.g. ``<|im_end|>``), that token's text is
not appended again. Only the template's text around the new messages is used, so a template that
rewrites earlier turns (its rendering not a prefix of the next one) is handled too.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

SENTINEL = "\u2063EPISODE-TURN-END\u2063"
"""Placeholder content of the last assistant turn when rendering what follows it."""


class ChatTokens:
    """The chat template of ``tokenizer`` with the episode's ``tools`` (transformers schemas)."""

    def __init__(self, tokenizer, tools: Optional[Sequence[Dict[str, Any]]] = None):
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None

    def render(self, messages: List[Dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> List[int]:
        """Template text as ids: its special tokens as written, nothing added (no second BOS)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: List[Dict[str, Any]]) -> List[int]:
        """The first turn's prompt: the whole rendering, with the generation prompt."""
        return self.encode(self.render(messages, True))

    def continuation(self, history: List[Dict[str, Any]], new_messages: List[Dict[str, Any]],
                     sampled: Sequence[int]) -> List[int]:
        """Ids to append after the sampled turn ``sampled`` (conversation before it: ``history``): the
        template's end of that assistant turn, ``new_messages`` (tool results, user turns) and the
        next generation prompt."""
        text = self.render(list(history) + [{"role": "assistant", "content": SENTINEL}] + list(new_messages), True)
        if text.count(SENTINEL) != 1:
            raise ValueError("the chat template does not render the last assistant turn's content as given: "
                             "multi-turn prompts cannot be built token-exactly from it")
        after = text.split(SENTINEL, 1)[1]
        if sampled:
            last = self.tokenizer.decode([sampled[-1]], skip_special_tokens=False)
            if last and after.startswith(last) and last in self.tokenizer.all_special_tokens:
                after = after[len(last):]  # the turn's end-of-turn token was sampled: kept as sampled
        return self.encode(after)
