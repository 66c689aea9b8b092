"""pack_weights/unpack_weights: a state dict to bytes and back, bit-exact in every dtype, one tensor
under two names (a tied head) kept as one."""

import pytest
import torch

from models.engines.weights import pack_weights, unpack_weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN payloads and -0.0 included), for a bit-exact comparison."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _awkward(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 5, generator=gen).to(dtype)
    t[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]).to(dtype)  # 1e-40: subnormal in float32
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    w = _awkward(dtype)
    state = {"w": w, "transposed": w.t(), "rows": w[2:5], "scalar": torch.tensor(3, dtype=torch.int64)}
    got = unpack_weights(pack_weights(state))
    assert set(got) == set(state)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and got[name].device.type == "cpu"
        assert torch.equal(_bits(got[name]), _bits(t)), name
    assert not got["rows"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_a_tied_model_state_dict_comes_back_tied_and_is_written_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    state = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    data = pack_weights(state)
    got = unpack_weights(data)
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    assert all(torch.equal(_bits(got[k]), _bits(v)) for k, v in state.items())
    embedding_bytes = 512 * 32 * 2
    untied = pack_weights({k: v.clone() for k, v in state.items()})
    assert len(untied) - len(data) >= embedding_bytes  # the tied head is not written a second time


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="weight 'w' is a list, not a tensor"):
        pack_weights({"w": [1.0, 2.0]})
    with pytest.raises(ValueError, match="not packed weights: 3 bytes"):
        unpack_weights(b"abc")
    with pytest.raises(ValueError, match="not packed weights: no safetensors header"):
        unpack_weights(b"\xff" * 64)
    data = pack_weights({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="not packed weights"):
        unpack_weights(data[:-4])  # cut short
