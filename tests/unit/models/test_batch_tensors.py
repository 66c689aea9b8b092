"""Padded tensors, model inputs and shards from RolloutBatch, against hand-built values."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models.data import ragged
from models.data.batch import RolloutBatch
from tests.unit.tasks.test_batch import rollout_batch


def test_to_padded_matches_hand_built_tensors():
    scored = rollout_batch().with_columns(reward=[1.0, 0.0, 0.5, 2.0])
    out = scored.to_padded(["prompt_id", "prompt_tokens", "response_tokens", "sampler_logprobs",
                            "is_end", "reward"], pad_value=-1)
    # PROMPTS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]], RESPONSES = [[11, 12], [], [13, 14, 15], [16]]
    torch.testing.assert_close(out["response_tokens"], torch.tensor(
        [[11, 12, -1], [-1, -1, -1], [13, 14, 15], [16, -1, -1]]))
    torch.testing.assert_close(out["response_mask"], torch.tensor(
        [[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool))
    torch.testing.assert_close(out["sampler_logprobs"], torch.tensor(
        [[-0.5, -1.5, -1], [-1, -1, -1], [-0.1, -0.2, -0.3], [-2.0, -1, -1]]))
    torch.testing.assert_close(out["prompt_tokens"], torch.tensor(  # left-padded by default
        [[-1, 1, 2, 3], [-1, -1, -1, 4], [-1, -1, 5, 6], [7, 8, 9, 10]]))
    torch.testing.assert_close(out["prompt_mask"], torch.tensor(
        [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool))
    torch.testing.assert_close(out["is_end"], torch.tensor([True, False, True, False]))
    torch.testing.assert_close(out["reward"], torch.tensor([1.0, 0.0, 0.5, 2.0]))
    assert out["prompt_id"].dtype == torch.int64 and out["response_tokens"].dtype == torch.int64
    assert out["sampler_logprobs"].dtype == torch.float32


def test_to_padded_right_padded_prompts_and_shard():
    out = rollout_batch().to_padded(["prompt_tokens", "response_tokens"], shard=(1, 2),
                                    prompt_padding="right")
    # rank 1 of 2 holds rows 2 and 3; widths are this shard's longest rows
    torch.testing.assert_close(out["prompt_tokens"], torch.tensor([[5, 6, 0, 0], [7, 8, 9, 10]]))
    torch.testing.assert_close(out["response_tokens"], torch.tensor([[13, 14, 15], [16, 0, 0]]))


def test_model_inputs_concatenate_prompt_and_response_right_padded():
    out = rollout_batch().to_model_inputs(pad_token_id=99)
    torch.testing.assert_close(out.input_ids, torch.tensor([
        [1, 2, 3, 11, 12], [4, 99, 99, 99, 99], [5, 6, 13, 14, 15], [7, 8, 9, 10, 16]]))
    torch.testing.assert_close(out.attention_mask, torch.tensor([
        [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    torch.testing.assert_close(out.is_response, torch.tensor([
        [0, 0, 0, 1, 1], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool))
    torch.testing.assert_close(out.response_positions, torch.tensor([
        [3, 4, 4], [1, 2, 3], [2, 3, 4], [4, 4, 4]]))
    padded = rollout_batch().to_padded(["response_tokens"])
    torch.testing.assert_close(out.response_mask, padded["response_mask"])
    picked = out.input_ids.gather(1, out.response_positions)  # [B, T_resp]
    torch.testing.assert_close(picked[out.response_mask], padded["response_tokens"][padded["response_mask"]])


def test_response_positions_select_the_logits_that_score_each_response_token():
    # A fake "LM" whose logits at position p are one-hot on the token at p+1: the log-prob
    # gathered via response_positions - 1 must then be 0 exactly at every response token.
    out = rollout_batch().to_model_inputs()
    vocab = 20
    nxt = torch.roll(out.input_ids, -1, dims=1)  # [B, L] token at p+1
    logits = torch.nn.functional.one_hot(nxt, vocab).float() * 50.0  # [B, L, V]
    logp_all = torch.log_softmax(logits[:, :-1], -1).gather(-1, out.input_ids[:, 1:, None])[..., 0]
    logp = logp_all.gather(1, out.response_positions - 1)  # [B, T_resp]
    assert torch.all(logp[out.response_mask] > -1e-6)


def test_empty_prompt_is_refused_for_model_inputs():
    batch = rollout_batch(prompts=[[1], [], [2], [3]])
    with pytest.raises(ValueError, match="row 1 has an empty prompt"):
        batch.to_model_inputs()


def _reference_pad(rows, pad, side):
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad, dtype=np.int64)
    for b, r in enumerate(rows):  # the plain loop the vectorised code must match
        if side == "right":
            out[b, :len(r)] = r
        else:
            out[b, width - len(r):] = r
    return out


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 1000), max_size=6), max_size=7),
       side=st.sampled_from(["left", "right"]), start=st.integers(0, 3))
def test_padding_matches_a_plain_loop(rows, side, start):
    arr = pa.array(rows, pa.list_(pa.int32())).slice(min(start, len(rows)))  # sliced: offsets != 0
    values, mask = ragged.padded_from_list(arr, pad_value=-7, side=side, dtype=np.int64)
    np.testing.assert_array_equal(values, _reference_pad(rows[start:], -7, side))
    assert mask.sum() == sum(len(r) for r in rows[start:])
    back = ragged.list_from_padded(values, mask, pa.int32())
    assert back.to_pylist() == rows[start:]


@settings(max_examples=80, deadline=None)
@given(num_rows=st.integers(0, 40), world_size=st.integers(1, 9))
def test_shards_cover_every_row_exactly_once_like_array_split(num_rows, world_size):
    bounds = [ragged.shard_bounds(num_rows, r, world_size) for r in range(world_size)]
    rows = np.concatenate([np.arange(a, b) for a, b in bounds])
    np.testing.assert_array_equal(rows, np.arange(num_rows))
    expected = [len(x) for x in np.array_split(np.arange(num_rows), world_size)]
    assert [b - a for a, b in bounds] == expected


def test_batch_shards_cover_all_rows(tmp_path):
    prompts = [[i + 1] for i in range(7)]
    batch = rollout_batch(prompts=prompts, responses=[[1]] * 7, logp=[[0.0]] * 7)
    url = batch.write(str(tmp_path / "b.arrow")).uri
    ids = [RolloutBatch.read(url, shard=(r, 3)).to_padded(["prompt_id"])["prompt_id"] for r in range(3)]
    assert [len(x) for x in ids] == [3, 2, 2]
    torch.testing.assert_close(torch.cat(ids), torch.arange(7))
    with pytest.raises(ValueError, match="rank=3, world_size=3"):
        batch.shard(3, 3)


def test_unpermute_flat_restores_row_order():
    from models.data.ragged import unpermute_flat

    # rows 0..3 hold [a], [b b], [], [c c c]; scored in order 3, 0, 2, 1
    flat_in_order = np.array([30, 31, 32, 0, 10, 11])
    got = unpermute_flat(flat_in_order, np.array([1, 2, 0, 3]), np.array([3, 0, 2, 1]))
    assert got.tolist() == [0, 10, 11, 30, 31, 32]
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, 50)
    rows = [rng.normal(size=n) for n in lengths]
    order = rng.permutation(50)
    flat = np.concatenate([rows[i] for i in order])
    np.testing.assert_array_equal(unpermute_flat(flat, lengths, order), np.concatenate(rows))
