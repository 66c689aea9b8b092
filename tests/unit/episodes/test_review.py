"""Episodes in review: the MLflow sample table and the Flyte deck show the conversation (turns, tool
calls and their results), not the raw token text."""

from __future__ import annotations

import json

from models.data.batch import BatchMetadata, RolloutBatch
from models.stages.samples import conversation_text
from tasks.decks import batch_html
from models.stages.samples import sample_table

MESSAGES = [{"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant", "content": "Let me calculate.",
             "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                              "arguments": {"expression": "6*7"}}}]},
            {"role": "tool", "name": "calculator", "content": "42"},
            {"role": "assistant", "content": "42"}]
TRANSCRIPT = ("[user] What is 6 * 7?\n[assistant] Let me calculate.\n  → calculator({\"expression\": \"6*7\"})\n"
              "[tool calculator] 42\n[assistant] 42")


def _batch() -> RolloutBatch:
    return RolloutBatch.from_columns(
        BatchMetadata(iteration=3, policy_version=3, algorithm="grpo"), prompt_id=[0], prompt_tokens=[[1]],
        response_tokens=[[2, 3, 4]], sampler_logprobs=[[-1.0, 0.0, -1.0]], is_end=[True],
        old_logprobs=[[-1.0, 0.0, -1.0]], ref_logprobs=[[-1.5, 0.0, -1.0]], reward=[1.0], prompt=["p"],
        response=["r"], loss_mask=[[True, False, True]], episode=[json.dumps(MESSAGES)])


def test_conversation_text():
    assert conversation_text(json.dumps(MESSAGES)) == TRANSCRIPT


def test_sample_table_and_deck_show_the_conversation():
    table = sample_table(_batch(), 5)
    assert table["conversation"] == [TRANSCRIPT]
    html = batch_html(_batch(), "Rollout")
    assert "[tool calculator] 42" in html and "→ calculator" in html and "white-space: pre-wrap" in html
