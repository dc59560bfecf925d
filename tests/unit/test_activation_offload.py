"""offload_activations in one process (world of one, CPU): what checkpoints keep leaves its storage after
forward and comes back ahead of the recomputation, `activation_loading_horizon` checkpoints early, and
the gradients are bit-identical to an unchanged model's ([Note: activation offloading])."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import shardpar as smp
from shardpar.api import context
from shardpar.api.activation_offload import ActivationOffloader, OffloadStats
from shardpar.config import Config
from tests.conftest import init_world_of_one
from tests.unit.test_activation_checkpointing import Net, _calls, _equal, _grads


@pytest.fixture(params=[1, 3], ids=["horizon-1", "horizon-3"])
def offloader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ActivationOffloader]:
    with init_world_of_one(monkeypatch, offload_activations=True, activation_loading_horizon=request.param):
        found = context.activation_offloader()
        assert found is not None and found.horizon == request.param
        found.stats.events = []
        yield found


def _events(stats: OffloadStats, net: Net) -> list[tuple[str, int]]:
    index = {id(b): i for i, b in enumerate(net.blocks)}
    return [(kind, index[id(m)]) for kind, m in stats.events or []]


@pytest.mark.parametrize("loop", ["plain", "dropout", "inplace", "skip", "slice", "sequential"])
@pytest.mark.parametrize("strategy", ["each", "group_2", "contiguous"])
def test_gradients_are_bit_identical_and_every_checkpoint_went_out_and_came_back(
    offloader: ActivationOffloader, strategy: str, loop: str
) -> None:
    ref = Net(loop=loop, sequential=loop == "sequential")
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks, strategy=strategy)
    calls = _calls(net)
    assert _equal(_grads(net), _grads(ref))
    skipped = {"skip": {1}, "slice": {0}}.get(loop, set())
    assert calls == [0 if i in skipped else 2 for i in range(4)], calls
    kinds = [kind for kind, _ in _events(offloader.stats, net)]
    # One reload and one recompute per checkpoint; one offload per call that kept an activation (a group
    # whose parent loop changes the hidden state between blocks keeps it per block).
    assert kinds.count("recompute") == kinds.count("reload") >= 1 and kinds.count("offload") >= 1, kinds
    assert offloader.stats.num_offloaded == offloader.stats.num_reloaded > 0
    assert offloader.queued == 0  # every offloaded checkpoint was recomputed


@pytest.mark.parametrize(("strategy", "frames"), [("each", [0, 1, 2, 3]), ("group_2", [0, 2])])
def test_reloads_run_horizon_checkpoints_ahead_of_the_recomputation(
    offloader: ActivationOffloader, strategy: str, frames: list[int]
) -> None:
    net = Net()
    smp.set_activation_checkpointing(net.blocks, strategy=strategy)
    _grads(net)
    h, last = offloader.horizon, len(frames) - 1
    expected = [("offload", f) for f in frames]
    expected += [("reload", frames[j]) for j in range(last, max(-1, last - h - 1), -1)] + [("recompute", frames[last])]
    for i in range(last - 1, -1, -1):
        expected += ([("reload", frames[i - h])] if i >= h else []) + [("recompute", frames[i])]
    assert _events(offloader.stats, net) == expected


def _kept_outputs(strategy: str) -> list[int]:
    """Which block outputs' storages are still alive between forward and backward."""
    net = Net()
    smp.set_activation_checkpointing(net.blocks, strategy=strategy)
    freed: set[int] = set()
    for i, block in enumerate(net.blocks):

        def watch(module: nn.Module, args: object, out: torch.Tensor, i: int = i) -> None:
            weakref.finalize(out.untyped_storage(), freed.add, i)

        block.register_forward_hook(watch)
    loss = net(torch.randn(5, 13, requires_grad=True))
    gc.collect()
    kept = [i for i in range(4) if i not in freed]
    loss.backward()
    return kept


def test_offloaded_activations_leave_their_storage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control first: without offloading, 'each' keeps blocks 0-2's outputs (blocks 1-3's inputs)
    alive until backward; with it only the last block's output (saved by the loss, not a checkpoint)."""
    with init_world_of_one(monkeypatch):
        assert context.activation_offloader() is None
        assert _kept_outputs("each") == [0, 1, 2, 3]
    with init_world_of_one(monkeypatch, offload_activations=True):
        assert _kept_outputs("each") == [3]
        assert _kept_outputs("group_2") == [3]  # block 1's output: group [2, 3]'s kept input


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * mask


def test_inputs_that_need_no_gradient_stay(offloader: ActivationOffloader) -> None:
    """A mask every layer gets is alive in the parent anyway: moving it would free nothing."""
    layers = nn.ModuleList(_Masked() for _ in range(3))
    ref = copy.deepcopy(layers)
    smp.set_activation_checkpointing(layers)
    x, mask = torch.randn(4, 6, requires_grad=True), (torch.rand(4, 6) > 0.3).float()

    def run(ls: nn.ModuleList) -> list[torch.Tensor | None]:
        h = x
        for layer in ls:
            h = layer(h, mask)
        h.sum().backward()
        grads = [p.grad for p in ls.parameters()]
        return grads

    assert _equal(run(layers), run(ref))
    assert offloader.stats.num_offloaded == 3  # the hidden states only
    assert offloader.stats.bytes_offloaded == 3 * 4 * 6 * 4


def test_a_forward_without_backward_frees_what_it_offloaded(offloader: ActivationOffloader) -> None:
    net = Net()
    smp.set_activation_checkpointing(net.blocks, strategy="each")
    loss = net(torch.randn(5, 13, requires_grad=True))
    assert offloader.queued == 4
    del loss
    gc.collect()
    assert offloader.queued == 0


def test_a_second_backward_of_a_kept_graph_recomputes_from_the_reloaded_inputs(offloader: ActivationOffloader) -> None:
    ref = Net()
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks, strategy="group_2")
    for model in (net, ref):
        loss = model(torch.ones(5, 13, requires_grad=True))
        loss.backward(retain_graph=True)
        loss.backward()
    assert _equal([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()])
    assert offloader.stats.num_reloaded == offloader.stats.num_offloaded == 2  # reloaded once


def test_nested_checkpoints_offload_only_outside_backward(offloader: ActivationOffloader) -> None:
    """The inner checkpoint runs again inside the outer one's recomputation, in backward: it is recomputed
    right away there, so it offloads only in the real forward."""
    ref = Net(loop="dropout")
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks[1].up)
    smp.set_activation_checkpointing(net.blocks, strategy="group_2")
    assert _equal(_grads(net), _grads(ref))
    assert offloader.queued == 0


class _Inplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h.mul_(2.0)  # a module that changes its own input: its recomputation would read other values
        return torch.tanh(self.lin(h))


def test_an_input_modified_in_place_is_still_refused(offloader: ActivationOffloader) -> None:
    layers = nn.ModuleList([_Inplace(), _Inplace()])
    smp.set_activation_checkpointing(layers, strategy="group_2")
    h = torch.randn(3, 6, requires_grad=True) * 1.0
    out = layers[1](layers[0](h * 1.0))
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_offloading_is_off_without_the_knob_or_without_init(monkeypatch: pytest.MonkeyPatch) -> None:
    assert context.activation_offloader() is None  # smp.init not called
    net = Net()
    smp.set_activation_checkpointing(net.blocks)
    assert _equal(_grads(net), _grads(Net()))
    assert Config.from_dict({}, env={}).offload_activations is False
    assert Config.from_dict({}, env={}).activation_loading_horizon == 4  # v1's default


@pytest.mark.parametrize("horizon", [0, -1, 1.5, True])
def test_a_horizon_below_one_is_refused(horizon: object) -> None:
    with pytest.raises(ValueError, match="activation_loading_horizon"):
        Config.from_dict({"offload_activations": True, "activation_loading_horizon": horizon}, env={})


def test_v1_functional_checkpoints_offload_too(offloader: ActivationOffloader) -> None:
    from shardpar.patches.checkpoint import checkpoint, checkpoint_sequential

    ref = Net(sequential=True)
    net = copy.deepcopy(ref)
    x = torch.randn(5, 13, requires_grad=True)
    checkpoint(net.blocks[0], checkpoint_sequential(net.blocks, x, strategy="group_2")).square().mean().backward()
    ref.blocks[0](ref.blocks(x.detach().requires_grad_())).square().mean().backward()
    assert _equal([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()])
    assert offloader.stats.num_offloaded == offloader.stats.num_reloaded == 3  # two groups, one call
    assert offloader.queued == 0
