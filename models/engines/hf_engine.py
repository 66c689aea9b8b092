"""The transformers engine: ``generate`` for the model plumbing (KV cache, padding, stop criteria),
every sampling decision ours (:class:`_SampleStep`), so it draws from the distribution the spec
names and nothing from the checkpoint's ``generation_config.json`` (its ``repetition_penalty``,
``top_k``, ``temperature``, ... would change the distribution the trainer scores)."""

from __future__ import annotations

import glob
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kernels.sampling import exponential_race, processed_logprobs
from models.engines.base import (EngineLoadError, Generation, SamplingSpec, SwappableEngine, request_indices,
                                 sample_seed)
from models.engines.weight_patch import patch_into
from models.engines.weight_stream import bits
from models.faults import drop_pushed


class _SampleStep:
    """A logits processor that *is* the sampler: it turns the step's logits into the processed
    log-probs (temperature, top-k/top-p; stop tokens masked before ``min_new_tokens``), draws each
    row's token from that row's own generator, records its log-prob, and leaves only that token
    possible, so ``generate``'s greedy step picks it."""

    def __init__(self, spec: SamplingSpec, seeds: Sequence[int], prompt_len: int, stop_ids: Sequence[int],
                 device: torch.device, version: int = 0, between_steps: Optional[Callable[[], int]] = None):
        self.spec, self.prompt_len, self.stop_ids = spec, prompt_len, list(stop_ids)
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.logprobs: List[torch.Tensor] = []  # per step [N]
        self.version, self.between_steps = version, between_steps
        self.versions: List[int] = []  # per step: the policy version whose weights computed its logits

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.spec
        z = scores.float()  # [N, V]
        if input_ids.shape[1] - self.prompt_len < s.min_new_tokens and self.stop_ids:
            z[:, self.stop_ids] = float("-inf")
        logp = processed_logprobs(z, s.temperature, s.top_k, s.top_p)  # [N, V]
        token = z.argmax(dim=-1) if s.temperature == 0 else exponential_race(logp, self.generators)  # [N]
        self.logprobs.append(logp.gather(1, token[:, None]).squeeze(1))
        self.versions.append(self.version)
        if self.between_steps is not None:  # new weights may come in here: the next step's forward uses them
            self.version = self.between_steps()
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, token[:, None], 0.0)


def _ends_in_stop_string(tokenizer, tokens: List[int], stop_strings: Sequence[str]) -> bool:
    """Whether the text of ``tokens`` holds a stop string that its last token completed."""
    if not stop_strings:
        return False
    text, before = tokenizer.decode(tokens), tokenizer.decode(tokens[:-1])
    return any(s in text and s not in before for s in stop_strings)


class HFEngine(SwappableEngine):
    """Transformers ``generate``; fast for tiny models on CPU, and the debugging reference."""

    def __init__(self, checkpoint_dir: str, dtype: str = "float32", device: Optional[str] = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = getattr(torch, dtype)
        self.model = None
        self._begin(checkpoint_dir)

    def _start(self, checkpoint_dir: str) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        from models.checkpoint.local import cached_tokenizer

        self.model = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir, dtype=self.dtype, use_safetensors=True
        ).to(self.device).eval()
        # generate() fills every setting a call leaves unset from the model's generation config:
        # a neutral one keeps the checkpoint's sampling defaults out of the distribution
        self.model.generation_config = GenerationConfig()
        self.tokenizer = cached_tokenizer(checkpoint_dir)

    def _reload_in_place(self, checkpoint_dir: str) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))):
            state.update(load_file(f, device=self.device))
        self._load_state(state, f"weights of {checkpoint_dir}")

    def _begin_push_in_place(self, names: List[str]) -> None:
        self.set_adapter(None)  # the state dict is the plain model's
        self._left = set(names)

    def _push_chunk_in_place(self, tensors: Dict[str, torch.Tensor]) -> None:
        self._left -= set(tensors)
        unexpected = self._model().load_state_dict(drop_pushed(tensors), strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"the weights given do not fit the engine's model: unexpected={unexpected[:5]}")

    def _end_push_in_place(self) -> None:
        if self._left:
            raise RuntimeError(f"the push named weights it did not send: {sorted(self._left)[:5]}")
        if "lm_head.weight" not in self._layout.shapes:  # a tied head follows the embedding
            self.model.tie_weights()

    def _begin_patch_in_place(self) -> None:
        self.set_adapter(None)  # the state dict is the plain model's

    def _patch_chunk_in_place(self, patches: Dict[str, Any]) -> None:
        """Each patch into the model's own tensor (a tied head shares the embedding's), in place
        (:func:`~models.engines.weight_patch.patch_into`: a BLOCK8 delta in one pass from its payload)."""
        state = self._model().state_dict()
        for name, patch in drop_pushed(patches).items():
            if name not in state:
                raise RuntimeError(f"the delta names {name!r}, which the engine's model does not hold")
            patch_into(state[name], patch)

    def _load_state(self, state: Dict[str, torch.Tensor], what: str) -> None:
        """``load_state_dict`` (copies into the model's own tensors, in its dtype and on its device); a
        tied ``lm_head`` left out of ``state`` follows the embedding."""
        self.set_adapter(None)  # the state dict is the plain model's
        missing, unexpected = self._model().load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
            raise RuntimeError(f"{what} do not fit the engine's model: missing={missing[:5]} "
                               f"unexpected={unexpected[:5]}")
        if "lm_head.weight" in missing:
            self.model.tie_weights()

    def read_back(self, positions, dtypes):
        state = self._model().state_dict()
        out = {}
        for name, where in positions.items():
            if name not in state:
                continue
            flat = state[name].reshape(-1)
            held = bits(flat[torch.tensor(where, dtype=torch.long, device=flat.device)].to(getattr(torch, dtypes[name])))
            out[name] = [[b] for b in held.tolist()]
        return out

    def set_adapter(self, adapter_dir: Optional[str]) -> None:
        from peft import PeftModel

        t0 = time.perf_counter()
        if isinstance(self.model, PeftModel):
            self.model = self.model.unload()  # the base model, LoRA layers removed (weights untouched)
        if adapter_dir is not None:
            self.model = PeftModel.from_pretrained(self.model, adapter_dir).to(self.device).eval()
        self.stats.reload_s += time.perf_counter() - t0

    def _model(self):
        if self.model is None:
            raise EngineLoadError("HFEngine is closed (closed by its owner, or its last restart failed)")
        return self.model

    @torch.no_grad()
    def prompt_logprobs(self, sequences: List[List[int]]) -> List[List[float]]:
        model = self._model()
        out = []
        for seq in sequences:  # one at a time: no padding to get wrong
            logits = model(input_ids=torch.tensor([seq], device=self.device)).logits[0, :-1].float()  # [L-1, V]
            logp = logits.log_softmax(-1).gather(-1, torch.tensor(seq[1:], device=self.device)[:, None])
            out.append(logp.squeeze(-1).cpu().tolist())
        return out

    def generate(self, prompts: List[List[int]], spec: SamplingSpec, first_index: int = 0,
                 indices: Optional[Sequence[int]] = None) -> List[List[Generation]]:
        """``first_index``: the index of ``prompts[0]`` in the whole request, or ``indices``: each prompt's (see
        ``VLLMEngine.generate``)."""
        return self.generate_versions(prompts, spec, first_index, indices=indices)[0]

    @torch.no_grad()
    def generate_versions(self, prompts: List[List[int]], spec: SamplingSpec, first_index: int = 0, version: int = 0,
                          between_steps: Optional[Callable[[], int]] = None,
                          indices: Optional[Sequence[int]] = None) -> Tuple[List[List[Generation]], List[List[int]]]:
        """:meth:`generate`, and each sample's per-token policy versions (prompt-major, as the samples): the
        weights served at the start are ``version``; ``between_steps()``, called once every step's tokens are
        drawn, may change them in place (partial rollouts: the next step's forward uses the new weights, the KV
        cache of the tokens before is kept) and returns the version served from then on."""
        model = self._model()
        at = request_indices(prompts, first_index, indices)

        def guarded() -> int:
            served = between_steps()
            if self.model is not model:  # a restart: this generation's model is not the engine's any more
                raise EngineLoadError("the engine's model was replaced during a generation")
            return served

        t0 = time.perf_counter()
        tok = self.tokenizer
        stop_ids = self.stop_ids(spec)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0] if stop_ids else 0
        expanded = [p for p in prompts for _ in range(spec.n)]
        max_len = max(len(p) for p in expanded)
        input_ids = torch.full((len(expanded), max_len), pad_id, dtype=torch.long)  # [N, P] left-padded
        attn = torch.zeros_like(input_ids)
        for i, p in enumerate(expanded):
            input_ids[i, max_len - len(p):] = torch.tensor(p)
            attn[i, max_len - len(p):] = 1
        seeds = [sample_seed(spec.seed, at[i], j) for i in range(len(prompts)) for j in range(spec.n)]
        step = _SampleStep(spec, seeds, max_len, stop_ids, torch.device(self.device), version,
                           guarded if between_steps is not None else None)
        kwargs = dict(do_sample=False, max_new_tokens=spec.max_new_tokens, pad_token_id=pad_id,
                      eos_token_id=stop_ids or None, logits_processor=[step])
        if spec.stop_strings:
            kwargs.update(stop_strings=list(spec.stop_strings), tokenizer=tok)
        seqs = model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                              **kwargs)[:, max_len:].cpu()  # [N, R]
        logp = torch.stack(step.logprobs, dim=1).cpu()  # [N, R]
        results: List[List[Generation]] = [[] for _ in prompts]
        versions: List[List[int]] = []
        stops = set(stop_ids)
        for i in range(len(expanded)):
            toks, lps, ended = [], [], False
            for t in range(seqs.shape[1]):  # up to the first stop (generate pads finished rows after it)
                toks.append(int(seqs[i, t]))
                lps.append(float(logp[i, t]))
                ended = toks[-1] in stops or _ends_in_stop_string(tok, toks, spec.stop_strings)
                if ended:
                    break
            results[i // spec.n].append(Generation(toks, lps, ended))
            versions.append(step.versions[:len(toks)])
            self.stats.generated_tokens += len(toks)
        self.stats.generate_s += time.perf_counter() - t0
        return results, versions

    def close(self) -> None:
        self.model = None
