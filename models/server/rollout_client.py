"""Client of the rollout server, and :class:`RemoteEngine`, a generation engine backed by it.

Same retries and error messages as the reward/critic client (:class:`models.server.client.JSONClient`):
``ServerError: rollout server http://10.0.0.7:8124/generate returned 422: prompt 0: token id 500 in
prompts is outside the vocabulary [0, 99)``. A generation is resent after a dropped connection
(the same request with the same seed gives the same answer); a timeout is not.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import List, NamedTuple, Optional

from models.engines import EngineStats, Generation, SamplingSpec
from models.server.client import JSONClient
from models.server.rollout_schemas import GenerateResponse, RolloutHealth


class GenerateResult(NamedTuple):
    generations: List[List[Generation]]
    """Per prompt its ``n`` generations."""
    load_s: float
    """Server seconds spent loading new weights for this request."""
    generate_s: float
    probe_gap_max: Optional[float] = None
    """The server's engine-vs-trainer probe after this request's weight change (None: no change)."""


class RolloutClient(JSONClient):
    """``generate`` / ``health`` of the rollout server."""

    name = "rollout server"

    def generate(self, prompts: List[List[int]], spec: SamplingSpec, checkpoint_url: str,
                 adapter_url: Optional[str] = None, probe_tolerance: float = 1e-3,
                 trainer_dtype: str = "float32") -> GenerateResult:
        """``spec.n`` generations per prompt from the committed policy at ``checkpoint_url`` (+ adapter);
        after a weight change the server probes its engine with ``probe_tolerance`` against the
        trainer's forward in ``trainer_dtype``."""
        sampling = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()}
        body = {"prompts": [list(map(int, p)) for p in prompts], "sampling": sampling,
                "checkpoint_url": checkpoint_url, "adapter_url": adapter_url, "probe_tolerance": probe_tolerance,
                "trainer_dtype": trainer_dtype}
        out = GenerateResponse.model_validate_json(self._request("POST", "/generate", body).content)
        generations = [[Generation(g.tokens, g.logprobs, g.is_end) for g in per_prompt]
                       for per_prompt in out.generations]
        return GenerateResult(generations, out.load_s, out.generate_s, out.probe_gap_max)

    def health(self) -> RolloutHealth:
        return RolloutHealth.model_validate_json(self._request("GET", "/health").content)


class RemoteEngine:
    """:class:`models.engines.GenerationEngine` on a rollout server: ``load_weights`` and
    ``set_adapter`` take committed checkpoint URLs (as the server sees them) and only record them;
    the server loads them with the next ``generate``."""

    def __init__(self, client: RolloutClient, checkpoint_url: str = "", adapter_url: Optional[str] = None,
                 probe_tolerance: float = 1e-3):
        self.client, self.checkpoint_url, self.adapter_url = client, checkpoint_url, adapter_url
        self.probe_tolerance, self.trainer_dtype = probe_tolerance, "float32"
        self.stats = EngineStats()

    def load_weights(self, checkpoint_url: str) -> None:
        """Sample from the committed checkpoint at ``checkpoint_url`` from now on (no adapter)."""
        self.checkpoint_url, self.adapter_url = checkpoint_url, None

    def set_adapter(self, adapter_url: Optional[str]) -> None:
        self.adapter_url = adapter_url

    def generate(self, prompts: List[List[int]], spec: SamplingSpec) -> List[List[Generation]]:
        if not self.checkpoint_url:
            raise ValueError("RemoteEngine: call load_weights(checkpoint_url) before generate")
        out = self.client.generate(prompts, spec, self.checkpoint_url, self.adapter_url, self.probe_tolerance,
                                   self.trainer_dtype)
        if out.probe_gap_max is not None:
            self.stats.extra["probe_gap_max"] = out.probe_gap_max
        self.stats.reload_s += out.load_s
        self.stats.generate_s += out.generate_s
        self.stats.generated_tokens += sum(len(g.tokens) for per_prompt in out.generations for g in per_prompt)
        return out.generations

    def close(self) -> None:
        self.client.close()
