"""The rollout service probes its engine after every weight change, as the rollout task does for an
engine in its own process: the gap comes back with the answer, a stale head is repaired by a
restart, and an engine that stays wrong is refused with 409 and the largest gap named. The HF
engine on the Qwen2-shaped checkpoint (tied embeddings), behind the service layer's server in-process."""

from __future__ import annotations

import contextlib

import pytest
import torch

from models.checkpoint import save_checkpoint
from models.engines import HFEngine, SamplingSpec
from models.hosts.rollout import RolloutHost, RolloutServiceConfig
from models.service.client import ServiceClient, ServiceError
from models.service.server import Server, Settings
from tests.unit.models.hub_copies import trained_copy

SPEC = SamplingSpec(n=2, max_new_tokens=4, seed=0)
PROMPTS = [[9, 10, 11, 12], [20, 21]]


@pytest.fixture(scope="module")
def ckpts(qwen2_chat_dir, tmp_path_factory):
    """The base and three trained-looking copies of it, committed."""
    root = tmp_path_factory.mktemp("probe-server")
    out = {"base": str(root / "base"), "root": root}
    save_checkpoint(str(qwen2_chat_dir), out["base"])
    for i in (1, 2, 3):
        out[i] = str(root / f"t{i}")
        save_checkpoint(str(trained_copy(qwen2_chat_dir, root / f"hf{i}", seed=i)), out[i])
    return out


def _body(url: str, tolerance: float = 1e-3) -> dict:
    sampling = {"n": SPEC.n, "max_new_tokens": SPEC.max_new_tokens, "seed": SPEC.seed}
    return {"prompts": PROMPTS, "sampling": sampling, "checkpoint_url": url, "probe_tolerance": tolerance}


@contextlib.contextmanager
def served(ckpts):
    service = RolloutHost(RolloutServiceConfig(checkpoint_url=ckpts["base"], engine="hf"))
    server = Server(service, Settings(root=str(ckpts["root"]), serial=False))
    try:
        yield service, ServiceClient(server.url, label="rollout server")
    finally:
        server.close()
        service.close()


def test_every_weight_change_is_probed_and_a_stale_head_is_repaired(ckpts, monkeypatch):
    with served(ckpts) as (service, http):
        first = http.call("generate", _body(ckpts[1]))
        assert first["probe_gap_max"] < 1e-5 and service.engine.stats.reloads == 1
        assert http.call("generate", _body(ckpts[1]))["probe_gap_max"] is None  # served already
        reload = HFEngine._reload_in_place

        def reload_keeping_the_head(self, checkpoint_dir):  # the old head stays, as vLLM's CPU reload did
            head = self.model.lm_head.weight.detach().clone()
            reload(self, checkpoint_dir)
            self.model.lm_head.weight = torch.nn.Parameter(head)

        monkeypatch.setattr(HFEngine, "_reload_in_place", reload_keeping_the_head)
        repaired = http.call("generate", _body(ckpts[2]))
        assert repaired["probe_gap_max"] < 1e-5 and service.engine.stats.restarts == 1
        start = HFEngine._start

        def start_wrong(self, checkpoint_dir):
            start(self, checkpoint_dir)
            self.model.lm_head.weight = torch.nn.Parameter(self.model.lm_head.weight.detach() * 1.5)

        monkeypatch.setattr(HFEngine, "_start", start_wrong)
        with pytest.raises(ServiceError, match="returned 409: EngineMismatchError: .*still differ after restarting "
                                               "the engine from the checkpoint: largest gap"):
            http.call("generate", _body(ckpts[3]))


def test_a_zero_tolerance_turns_the_probe_off(ckpts):
    with served(ckpts) as (_, http):
        assert http.call("generate", _body(ckpts[1], tolerance=0.0))["probe_gap_max"] is None
        with pytest.raises(ServiceError, match=r"returned 403: Refused: checkpoint_url '/etc' is outside"):
            http.call("generate", _body("/etc"))
