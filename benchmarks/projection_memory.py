"""GPU memory of the update on paper: what one rank of the actor's (the critic's) trainer holds while it trains a
micro-batch, per preset, against its GPU (``tests/unit/benchmarks/test_projection_memory.py`` holds every GPU preset
to it). Each term is in bytes per GPU; :func:`update_memory_gb` gives them in GB.

- **state**: full fine-tuning, float32 master weights, their gradients and AdamW's two moments, 16 bytes a parameter
  over the trainer's ranks (FSDP2); a LoRA model, its frozen base in the compute dtype and its adapters' 16 bytes.
- **frozen**: on the actor's ranks, π_ref and the reward model, float32 and sharded as the actor
  (``models/stages/score_ranks.py``); a resident actor trainer keeps them between updates.
- **gathered**: FSDP2 unshards one decoder layer at a time in the compute dtype and prefetches the next, and the
  layer's unsharded float32 gradient lives until its reduce-scatter: 2·2 + 4 bytes a layer parameter (none on
  one process).
- **activations**: :func:`activation_bytes` of the micro-batch's tokens (every row at the longest, prompt budget +
  response budget: padding or packing, no more).

A preset fits when the sum is within :data:`GPU_GB` less :data:`ALLOWANCE_GB`.
"""

from __future__ import annotations

from typing import Dict, Optional

from benchmarks.projection_inputs import Dims, Shape, critic_size

GPU_GB = 80.0
"""An H100 SXM's memory, GB (NVIDIA's H100 datasheet: 80 GB HBM3), ``resources.accelerator: nvidia-h100``."""
ALLOWANCE_GB = 6.0
"""Left for what the terms do not count: the CUDA context and library workspaces (cuBLAS, ~1 GB), NCCL's buffers, a
colocated engine asleep (its context and graph pool) and the allocator's fragmentation. An allowance, unmeasured."""
COMPUTE_BYTES = 2
"""Bytes of an activation: the presets compute in bfloat16 (``model.dtype``)."""


def layer_activation_bytes(d: Dims) -> float:
    """Bytes one decoder layer keeps for the backward per token, checkpointing off, in bfloat16.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv:2205.05198,
    §4.1) count ``s·b·h·(34 + 5·a·s/h)`` bytes a GPT layer (16-bit, with dropout). For a Llama layer with
    fused attention (SDPA/flash: the ``a·s²`` scores are recomputed, only the output and the log-sum-exp kept), no
    dropout, RMSNorm (Hugging Face's upcasts its input to float32) and SwiGLU, in elements a token:
      attention: norm input in float32 2h, q/k/v input h, q h, k and v 2·h_kv, output h     = 5h + 2·h_kv
      MLP:       norm input in float32 2h, gate/up input h, gate, up, SiLU(gate), product 4f = 3h + 4f
    times :data:`COMPUTE_BYTES`, plus the log-sum-exp (4 bytes a head): 16h + 4·h_kv + 8f + 4a bytes. Llama-3-70B:
    364,800 bytes a token a layer (~44.5·h); Llama-3-8B: 184,448 (~45·h)."""
    elements = 8 * d.d_model + 2 * d.d_kv + 4 * d.ffn
    return COMPUTE_BYTES * elements + 4 * d.heads


def activation_bytes(d: Dims, tokens: int, checkpointed: bool) -> float:
    """Activations of one micro-batch of ``tokens`` tokens through the whole model.

    Off: every layer's :func:`layer_activation_bytes`. On (``*.activation_checkpointing``, Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"): each layer keeps only its input, h elements a token, and the
    backward recomputes one layer's whole set at a time: ``layers · 2h + layer set`` bytes a token. Either way the
    final norm and the head's input, 4h elements a token (the head's logits are made in vocabulary chunks and
    recomputed in the backward, ``kernels/logprobs_hidden.py``: no [tokens, vocab] tensor is kept)."""
    per_layer = layer_activation_bytes(d)
    kept = d.layers * COMPUTE_BYTES * d.d_model + per_layer if checkpointed else d.layers * per_layer
    return tokens * (kept + 4 * COMPUTE_BYTES * d.d_model)


def lora_params(d: Dims, rank: int) -> float:
    """Adapter parameters on every attention and MLP projection of every layer: rank × (in + out) each."""
    h, kv, f = d.d_model, d.d_kv, d.ffn
    return d.layers * rank * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)


def trainer_memory(s: Shape, role: str) -> Optional[Dict[str, float]]:
    """Bytes per GPU of ``role``'s (``actor`` or ``critic``) trainer training one micro-batch, by term (see the
    module docstring); None when the shape has no dims or no such trainer."""
    actor = role == "actor"
    d = s.dims if actor or s.critic_dims is None else s.critic_dims
    gpus = s.actor_nodes * s.gpus_per_node if actor else s.critic_gpus
    if d is None or gpus == 0:
        return None
    params = s.params if actor else critic_size(s)
    lora = not actor and s.critic_lora
    state = (params * COMPUTE_BYTES + 16 * lora_params(d, s.critic_lora_rank)) if lora else 16 * params
    frozen = (2 if s.reward_model else 1) * s.params * s.checkpoint_bytes_per_param if actor else 0.0
    gathered = d.layer_params() * (2 * COMPUTE_BYTES + 4) if gpus > 1 else 0.0
    rows = s.micro_batch if actor else s.critic_micro_batch
    checkpointed = s.activation_checkpointing if actor else s.critic_activation_checkpointing
    tokens = rows * (s.max_prompt_tokens + s.response_tokens)
    return {"state": state / gpus, "frozen": frozen / gpus, "gathered": gathered,
            "activations": activation_bytes(d, tokens, checkpointed)}


def update_memory_gb(s: Shape) -> Dict[str, Dict[str, float]]:
    """Each trainer's :func:`trainer_memory` in GB, with its ``total``."""
    out = {}
    for role in ("actor", "critic"):
        terms = trainer_memory(s, role)
        if terms is not None:
            out[role] = {k: v / 1e9 for k, v in terms.items()}
            out[role]["total"] = sum(out[role].values())
    return out


def misfits(s: Shape) -> Dict[str, str]:
    """The trainers of ``s`` whose update does not fit :data:`GPU_GB` less :data:`ALLOWANCE_GB`, each with why."""
    out = {}
    for role, gb in update_memory_gb(s).items():
        if gb["total"] > GPU_GB - ALLOWANCE_GB:
            on = s.activation_checkpointing if role == "actor" else s.critic_activation_checkpointing
            out[role] = (f"{s.name}: the {role}'s update needs {gb['total']:.1f} GB a GPU (activations "
                         f"{gb['activations']:.1f} GB, {role}.activation_checkpointing={str(on).lower()}), more than "
                         f"{GPU_GB:g} - {ALLOWANCE_GB:g} GB")
    return out


def memory_line(s: Shape) -> str:
    """One line: each trainer's GB a GPU in the update, and its activations."""
    parts = [f"{role} {gb['total']:.1f} GB (activations {gb['activations']:.1f})"
             for role, gb in update_memory_gb(s).items()]
    return f"  update memory per GPU: {', '.join(parts)} of {GPU_GB:g} GB (benchmarks/projection_memory.py)"
