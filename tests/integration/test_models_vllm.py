"""The tiny actor in vLLM's CPU engine agrees with Hugging Face: greedy tokens and log-probs.

vLLM loads the actor directory as is: `LlamaForCausalLM`, head_dim 32 (supported by the
CPU attention backend) and the character tokenizer through `AutoTokenizer` (no
`skip_tokenizer_init` needed). Prompts go in as token ids so both sides see the same
`<bos> ... =` sequence; `<eos>` comes from the saved generation config and stops decoding.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from models.demos.reverse_task import PromptGenerator, ReverseTaskConfig
from models.demos.tokenizer import load_tokenizer
from models.demos.warm_start import warm_start

pytestmark = pytest.mark.integration

TASK = ReverseTaskConfig()


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    # warm-started rather than random, so the greedy choice is rarely a near tie
    return warm_start(tmp_path_factory.mktemp("warm_start_cache"))


@pytest.fixture(scope="module")
def hf_actor(actor_dir):
    return AutoModelForCausalLM.from_pretrained(str(actor_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(actor_dir):
    tok = load_tokenizer(actor_dir)
    return tok(PromptGenerator(TASK, "eval", seed=0).prompts(6)).input_ids


@pytest.fixture(scope="module")
def llm(actor_dir):
    with pytest.MonkeyPatch.context() as mp:
        # in-process engine (2 s start instead of 13 s); vLLM reads these when it builds one
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm = pytest.importorskip("vllm")
        engine = vllm.LLM(
            model=str(actor_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=64
        )
        engine.generate([{"prompt_token_ids": [1]}], vllm.SamplingParams(max_tokens=1))  # warm-up
        yield engine
        engine.llm_engine.engine_core.shutdown()  # else the process may abort at exit


def _hf_greedy(model, ids, max_new_tokens, eos_id):
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=eos_id,
    )[0, len(ids):].tolist()
    return out[: out.index(eos_id) + 1] if eos_id in out else out


def _hf_token_logprobs(model, prompt, response):
    """log π(response_t | prompt, response_<t) from one forward pass. Shape: (len(response),)"""
    ids = torch.tensor([prompt + response])  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [R, V]
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_vllm_greedy_equals_hf_greedy(llm, hf_actor, prompt_ids, actor_dir):
    from vllm import SamplingParams

    tok = load_tokenizer(actor_dir)
    params = SamplingParams(temperature=0.0, max_tokens=TASK.max_new_tokens)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    stopped = 0
    for ids, out in zip(prompt_ids, outputs):
        got = list(out.outputs[0].token_ids)
        assert got == _hf_greedy(hf_actor, ids, TASK.max_new_tokens, tok.eos_token_id)
        assert out.outputs[0].text == tok.decode(got, skip_special_tokens=True)
        stopped += out.outputs[0].finish_reason == "stop"
    assert stopped >= len(prompt_ids) // 2  # the warm-started policy emits <eos>


def test_vllm_sample_logprobs_match_hf_forward(llm, hf_actor, prompt_ids):
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, n=4, seed=0, max_tokens=TASK.max_new_tokens, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    worst, samples = 0.0, set()
    for ids, out in zip(prompt_ids, outputs):
        for completion in out.outputs:
            response = list(completion.token_ids)
            vllm_logp = torch.tensor(
                [step[tok_id].logprob for step, tok_id in zip(completion.logprobs, response)]
            )
            hf_logp = _hf_token_logprobs(hf_actor, ids, response)
            worst = max(worst, (vllm_logp - hf_logp).abs().max().item())
            samples.add(tuple(response))
    print(f"max |logp_vllm - logp_hf| = {worst:.2e}")
    assert worst < 1e-3
    assert len(samples) > len(prompt_ids)  # n=4 gave distinct samples, not 4 copies
