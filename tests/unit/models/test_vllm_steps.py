"""The stop-string cut of vLLM's step loop (models/engines/vllm_steps.py), by hand: a sample submitted again after
a push is checked for a stop string over all its tokens, as vLLM checks it over the text of one request."""

from models.demos.tokenizer import build_char_tokenizer
from models.engines.vllm_steps import cut_at_stop_string


def test_a_stop_string_is_cut_after_the_token_that_completes_it():
    tok = build_char_tokenizer()
    ids = tok("ab##cd##", add_special_tokens=False)["input_ids"]  # one token a character
    assert cut_at_stop_string(tok, ids, ["##"]) == 4  # "ab##": the second '#' completes it; the rest goes
    assert cut_at_stop_string(tok, ids, ["b#", "cd"]) == 3  # the first to complete wins
    assert cut_at_stop_string(tok, ids, ["zz"]) == len(ids) == cut_at_stop_string(tok, ids, [])
