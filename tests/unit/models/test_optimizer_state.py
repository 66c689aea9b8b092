"""AdamW's state carried across updates (models/training/optimizer_state.py): an update split in two with the
state saved and loaded between equals one uninterrupted update; a state that does not fit is refused."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from models.training import optimizer_state
from models.checkpoint import is_committed, read_marker
from models.training.distributed import DistInfo
from models.training.files import optimizer_url
from models.training.update import make_optimizer

MAIN = DistInfo(0, 1, 0, torch.device("cpu"))


def net(frozen_bias: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    m[0].bias.requires_grad_(not frozen_bias)
    return m


def steps(model: nn.Module, opt: torch.optim.Optimizer, batches) -> None:
    for x, y in batches:
        opt.zero_grad()
        ((model(x).squeeze(-1) - y) ** 2).mean().backward()
        opt.step()


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, generator=g)) for _ in range(n)]


def clone(model: nn.Module) -> nn.Module:
    copy = net()
    copy.load_state_dict(model.state_dict())
    return copy


def test_split_update_with_carried_state_equals_one_update(tmp_path):
    data = batches(6)
    whole = net()
    steps(whole, make_optimizer(whole, 1e-2, 0.01), data)

    first = net()
    opt = make_optimizer(first, 1e-2, 0.01)
    steps(first, opt, data[:3])
    url = str(tmp_path / "iter-000000" / "actor-optimizer")
    optimizer_state.save(first, opt, url, MAIN)
    assert is_committed(url) and set(read_marker(url)["files"]) == {optimizer_state.FILE}

    resumed, fresh = clone(first), clone(first)  # the next iteration's process: weights from the checkpoint
    opt_resumed = make_optimizer(resumed, 1e-2, 0.01)
    assert optimizer_state.load(resumed, opt_resumed, url) == 3
    steps(resumed, opt_resumed, data[3:])
    steps(fresh, make_optimizer(fresh, 1e-2, 0.01), data[3:])
    for (name, want), got, restarted in zip(whole.state_dict().items(), resumed.state_dict().values(),
                                            fresh.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        assert not torch.equal(restarted, want)  # restarting AdamW is not the same update


def test_learning_rate_comes_from_the_new_optimizer_not_the_saved_state(tmp_path):
    model = net()
    opt = make_optimizer(model, 1e-2)
    steps(model, opt, batches(1))
    url = str(tmp_path / "opt")
    optimizer_state.save(model, opt, url, MAIN)
    opt2 = make_optimizer(model, 5e-4)
    optimizer_state.load(model, opt2, url)
    assert opt2.param_groups[0]["lr"] == 5e-4
    assert all(float(s["step"]) == 1 for s in opt2.state.values()) and len(opt2.state) == 4


def test_state_that_does_not_fit_leaves_a_fresh_optimizer(tmp_path, capsys):
    model = net()
    opt = make_optimizer(model, 1e-2)
    steps(model, opt, batches(1))
    url = str(tmp_path / "opt")
    optimizer_state.save(model, opt, url, MAIN)

    other = net(frozen_bias=True)  # one parameter fewer to train: the state has an entry too many
    opt_other = make_optimizer(other, 1e-2)
    assert optimizer_state.load(other, opt_other, url) is None
    assert not opt_other.state
    assert "does not fit this model" in capsys.readouterr().out

    wider = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 1))  # same names, other shapes
    opt_wider = make_optimizer(wider, 1e-2)
    assert optimizer_state.load(wider, opt_wider, url) is None and not opt_wider.state
    assert "has shape (9, 4), the saved state (8, 4)" in capsys.readouterr().out


def test_no_state_or_an_uncommitted_one_means_fresh(tmp_path):
    model = net()
    opt = make_optimizer(model, 1e-2)
    assert optimizer_state.load(model, opt, str(tmp_path / "missing")) is None
    steps(model, opt, batches(1))
    url = str(tmp_path / "opt")
    optimizer_state.save(model, opt, url, MAIN)
    os.remove(os.path.join(url, "COMMITTED.json"))  # as a crash before the commit leaves it
    opt2 = make_optimizer(model, 1e-2)
    assert optimizer_state.load(model, opt2, url) is None and not opt2.state


@pytest.mark.integration  # a moto S3 server process (tests/conftest.py)
def test_state_on_s3_round_trips(s3_url):
    model = net()
    opt = make_optimizer(model, 1e-2)
    steps(model, opt, batches(2))
    url = f"{s3_url}/iter-000000/actor-optimizer"
    optimizer_state.save(model, opt, url, MAIN)
    opt2 = make_optimizer(model, 1e-2)
    assert optimizer_state.load(model, opt2, url) == 2
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt2.state[p][key], opt.state[p][key], rtol=0, atol=0)


@pytest.mark.parametrize("url,want", [("s3://b/run/iter-000003/actor", "s3://b/run/iter-000003/actor-optimizer"),
                                      ("/runs/r/iter-000003/critic/", "/runs/r/iter-000003/critic-optimizer")])
def test_state_lives_beside_its_checkpoint(url, want):
    assert optimizer_url(url) == want
