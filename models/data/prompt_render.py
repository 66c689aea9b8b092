"""From a validated data row to the prompt text the model sees: the prompt template, the system
prompt and the tokenizer's chat template; and the check for characters the tokenizer cannot
represent. Every problem is reported with the row's place (see :mod:`models.data.prompts`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a conversation may hold."""

Conversation = List[Dict[str, Any]]


def check_messages(where: str, messages: Any, column: str) -> Optional[str]:
    """What is wrong with a conversation cell, or None: a non-empty list of ``{"role", "content"}``
    messages with known roles and text content, ending with a turn the model answers."""
    if not isinstance(messages, list) or not messages:
        return f"{where}: '{column}' is {type(messages).__name__}, not a non-empty list of messages"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"{where}: '{column}'[{k}] is not a message with a 'role' (got {str(m)[:80]!r})"
        if m["role"] not in ROLES:
            return f"{where}: '{column}'[{k}] has role {m['role']!r}, not one of {list(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"{where}: '{column}'[{k}] has content of type {type(m.get('content')).__name__}, not a string"
    if messages[-1]["role"] == "assistant":
        return (f"{where}: '{column}' ends with an assistant message; a prompt ends with the turn the model answers "
                f"(keep reference answers in another column)")
    return None


def _conversation(row: Dict[str, Any], text: Optional[str], config) -> Conversation:
    """The row's messages (``messages_column``) or its text as one user turn, with the system prompt
    before them unless the conversation has its own."""
    messages = [dict(m) for m in row[config.messages_column]] if config.messages_column \
        else [{"role": "user", "content": text}]
    if config.system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _template_text(where: str, row: Dict[str, Any], config, errors) -> Optional[str]:
    if not config.prompt_template:
        return row[config.prompt_column]
    try:
        return config.prompt_template.format_map(row)
    except KeyError as err:
        errors.add(f"{where}: prompt_template names column {err}, which this row lacks (columns: {sorted(row)})")
    except (IndexError, ValueError, AttributeError) as err:
        errors.add(f"{where}: prompt_template {config.prompt_template!r} cannot be filled: {err}")
    return None


def render_prompts(records: Sequence[Tuple[str, Optional[dict]]], config, tokenizer,
                   errors) -> Tuple[List[Optional[str]], List[Optional[Conversation]]]:
    """Per record: the prompt text the model sees (None where the row failed) and the conversation
    the chat template rendered (None without one). ``config``: a :class:`models.data.prompts.PromptDataConfig`."""
    chat = config.uses_chat_template
    if chat and not getattr(tokenizer, "chat_template", None):
        errors.add("the tokenizer has no chat template, but data.apply_chat_template / data.messages_column need "
                   "one (use an instruction model's checkpoint, or plain text prompts)")
        return [None] * len(records), [None] * len(records)
    texts: List[Optional[str]] = []
    conversations: List[Optional[Conversation]] = []
    for where, row in records:
        text = _template_text(where, row, config, errors) if row is not None and not config.messages_column else None
        messages = _conversation(row, text, config) if chat and row is not None and (
            text is not None or config.messages_column) else None
        if messages is not None:
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as err:  # jinja raises its own errors (e.g. raise_exception in the template)
                errors.add(f"{where}: the tokenizer's chat template failed on this row: {err}")
                text = None
        texts.append(text)
        conversations.append(messages if text is not None else None)
    return texts, conversations


def _char_name(ch: str) -> str:
    return f"{ch!r} U+{ord(ch):04X}"


def unknown_chars(texts: Sequence[str], encoded: Sequence[Sequence[int]], tokenizer) -> List[Tuple[int, List[str]]]:
    """``(row, characters)`` of the texts whose tokens hold the tokenizer's unknown token where the
    text does not spell that token itself; empty for tokenizers without one (byte-level BPE)."""
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    if unk_id is None:
        return []
    cache: Dict[str, bool] = {}

    def unknown(ch: str) -> bool:
        if ch not in cache:
            cache[ch] = unk_id in tokenizer(ch, add_special_tokens=False)["input_ids"]
        return cache[ch]

    found = []
    for i, (text, ids) in enumerate(zip(texts, encoded)):
        if unk_id in ids and (unk is None or text.count(unk) < list(ids).count(unk_id)):
            found.append((i, sorted({ch for ch in text if unknown(ch)})))
    return found


def report_unknown_chars(wheres: Sequence[str], texts: Sequence[str], encoded: Sequence[Sequence[int]], tokenizer,
                         allow: bool, errors) -> int:
    """Add one error per prompt with characters the tokenizer cannot represent (unless ``allow``);
    the number of such prompts."""
    found = unknown_chars(texts, encoded, tokenizer)
    if allow:
        if found:
            print(f"data.allow_unknown_chars: {len(found)} prompt(s) hold characters the tokenizer cannot represent "
                  f"(first: {wheres[found[0][0]]}: {', '.join(map(_char_name, found[0][1][:5]))}); they become "
                  f"{tokenizer.unk_token!r}", flush=True)
        return len(found)
    for i, chars in found:
        errors.add(f"{wheres[i]}: characters the tokenizer cannot represent (they would become "
                   f"{tokenizer.unk_token!r}): {', '.join(map(_char_name, chars[:8]))}")
    return len(found)
