"""Token-exact multi-turn prompts on the Qwen2-shaped chat checkpoint: appending the template's
rendering of only the new messages gives the template's full rendering where it is prefix-stable,
and sampled tokens are kept as sampled, never re-tokenised."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from models.environments.chat_tokens import ChatTokens
from models.demos.tool_tasks import ArithmeticEnv, demonstration
from models.environments.tools import CALCULATOR

ROW = {"prompt": "What is 48213 * 9127?", "expression": "48213*9127", "answer": str(48213 * 9127)}


@pytest.fixture(scope="module")
def tok(qwen2_chat_dir):
    return AutoTokenizer.from_pretrained(qwen2_chat_dir)


def _episode_ids(tok, chat, conversation, sampled_turns):
    """Build the ids turn by turn as the episode loop does: first prompt, each sampled turn, then the
    continuation for the messages after it."""
    first = [i for i, m in enumerate(conversation) if m["role"] == "assistant"][0]
    ids = chat.first_prompt(conversation[:first])
    history, k = conversation[:first], first
    for n, sampled in enumerate(sampled_turns):
        ids += sampled
        nxt = next((j for j in range(k + 1, len(conversation)) if conversation[j]["role"] == "assistant"), None)
        if nxt is None:
            break
        ids += chat.continuation(history, conversation[k + 1:nxt], ids)
        history, k = conversation[:nxt], nxt
    return ids


def test_appending_new_messages_matches_the_full_rendering(tok):
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    conversation = demonstration(ROW)
    full_text = chat.render(conversation, False)
    # what the policy sampled: the call up to </tool_call> (stop token), then the answer and <|im_end|>
    call_text = full_text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert call_text.endswith("</tool_call>")
    turn1 = chat.encode(call_text)
    turn2 = chat.encode(ROW["answer"]) + [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = _episode_ids(tok, chat, conversation, [turn1, turn2])
    expected = chat.encode(full_text)
    assert expected[-1] == chat.encode("\n")[0] and ids == expected[:-1]  # the template's final newline follows eos
    assert "<tool_response>\n" + ROW["answer"] + "\n</tool_response>" in tok.decode(ids)


def test_sampled_tokens_are_never_retokenised(tok):
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    env = ArithmeticEnv(ROW)
    messages = env.start()
    prompt = chat.first_prompt(messages)
    # a non-canonical split: every character of the text its own token (BPE would merge them)
    text = "Hello there"
    sampled = [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(chat.encode(text))
               for c in c] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(sampled, skip_special_tokens=True) == text and len(sampled) - 1 > len(chat.encode(text))
    user = [{"role": "user", "content": "And 2 + 2?"}]
    cont = chat.continuation(messages, user, prompt + sampled)
    ids = prompt + sampled + cont
    assert ids[len(prompt):len(prompt) + len(sampled)] == sampled
    assert tok.decode(cont) == "\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    # re-rendering and re-tokenising the conversation would have changed the sampled tokens
    rerendered = chat.encode(chat.render(messages + [{"role": "assistant", "content": text}] + user, True))
    assert rerendered != ids and tok.decode(rerendered) == tok.decode(ids)


def test_a_turn_stopped_at_a_tool_call_gets_the_templates_end_of_turn(tok):
    chat = ChatTokens(tok, [CALCULATOR.schema()])
    messages = ArithmeticEnv(ROW).start()
    sampled = chat.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>')
    cont = chat.continuation(messages, [{"role": "tool", "name": "calculator", "content": "2"}], sampled)
    assert tok.decode(cont) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\n")
