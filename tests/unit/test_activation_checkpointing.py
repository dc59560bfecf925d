"""smp.set_activation_checkpointing in one process: gradients equal an unchanged model's, what a group
keeps from forward, the parent loops a group must survive, and the argument errors."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import shardpar as smp
from shardpar.sharding.plan import choose_unit_modules
from tests import memory, models


class Net(nn.Module):
    """A ModuleList whose parent loop the test chooses: plain (each block's output is the next one's
    input), a parent op between blocks (dropout, out of place or in place), a skipped block, or a slice
    of the list."""

    def __init__(self, depth: int = 4, loop: str = "plain", sequential: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [models.Block(13, 7) for _ in range(depth)]
        self.blocks: nn.Module = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.drop = nn.Dropout(0.3)
        self.loop = loop
        self.seen: list[weakref.ref[torch.Tensor]] = []  # every block's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.blocks, nn.Sequential):
            return self.blocks(x).square().mean()
        blocks = list(self.blocks)
        if self.loop == "skip":
            blocks = [b for i, b in enumerate(blocks) if i != 1]
        elif self.loop == "slice":
            blocks = list(self.blocks[1:])
        h = x
        for b in blocks:
            h = b(h)
            self.seen.append(weakref.ref(h))
            if self.loop == "dropout":
                h = self.drop(h)
            elif self.loop == "scale":
                h = h * 1.5
            elif self.loop == "inplace":
                h.mul_(1.5)
        return h.square().mean()


def _grads(net: nn.Module, seed: int = 3) -> list[torch.Tensor | None]:
    torch.manual_seed(seed)
    x = torch.randn(5, 13, requires_grad=True)
    net(x).backward()
    return [p.grad for p in net.parameters()] + [x.grad]


def _equal(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return all(
        (s is None and t is None) or (s is not None and t is not None and torch.equal(s, t))
        for s, t in zip(a, b, strict=True)
    )


def _calls(net: Net) -> list[int]:
    counts = [0] * len(net.blocks)
    for i, b in enumerate(net.blocks):
        b.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("loop", ["plain", "dropout", "scale", "inplace", "skip", "slice", "sequential"])
@pytest.mark.parametrize("strategy", ["each", "group_2", "group_3", "contiguous"])
def test_gradients_equal_the_unchanged_model(strategy: str, loop: str) -> None:
    ref = Net(loop=loop, sequential=loop == "sequential")
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks, strategy=strategy)
    calls = _calls(net)
    ours, theirs = _grads(net), _grads(ref)
    assert _equal(ours, theirs)
    skipped = {"skip": {1}, "slice": {0}}.get(loop, set())
    assert calls == [0 if i in skipped else 2 for i in range(4)], calls  # forward + recomputation


class _Dropping(nn.Module):
    """A block with dropout inside: what the recomputation must draw again alike."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.drop = block, nn.Dropout(0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(self.block(h))


@pytest.mark.parametrize("strategy", ["each", "group_2"])
def test_dropout_inside_checkpointed_blocks_needs_the_preserved_rng_state(strategy: str) -> None:
    ref = Net()
    ref.blocks = nn.ModuleList(_Dropping(b) for b in ref.blocks)
    theirs = _grads(ref)
    preserved, dropped = copy.deepcopy(ref), copy.deepcopy(ref)
    smp.set_activation_checkpointing(preserved.blocks, strategy=strategy)
    smp.set_activation_checkpointing(dropped.blocks, strategy=strategy, preserve_rng_state=False)
    assert _equal(_grads(preserved), theirs)
    assert not _equal(_grads(dropped), theirs), "the control"


def test_a_group_keeps_its_first_input_only() -> None:
    """Bytes of the forward's storages still alive before backward. Under 'each' every block's input is
    kept, under group_2 only each group's first one (block 1's output, the input of group [2, 3]),
    under contiguous none but the model's input; the last block's output is square's saved input."""
    activation = 5 * 13 * 4
    kept = {}
    for strategy in ("each", "group_2", "contiguous"):
        ref = Net(loop="plain")
        net = copy.deepcopy(ref)
        smp.set_activation_checkpointing(net.blocks, strategy=strategy)
        x = torch.randn(5, 13, requires_grad=True)
        with memory.LiveBytes() as live:
            loss = net(x)
            gc.collect()
            kept[strategy] = live.live
        loss.backward()
        ref(x.detach().requires_grad_()).backward()
        assert _equal([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()]), strategy
    assert kept["each"] - kept["group_2"] == 2 * activation, kept
    assert kept["each"] - kept["contiguous"] == 3 * activation, kept


def test_state_dict_names_and_hooks_unchanged_and_units_still_found() -> None:
    net = Net()
    keys = list(net.state_dict())
    before = net.blocks[0]
    calls = _calls(net)
    smp.set_activation_checkpointing(net.blocks[0])  # one layer: the list must still read as repeated
    assert net.blocks[0] is before and list(net.state_dict()) == keys
    assert type(net.blocks[0]).__name__ == "Block" and isinstance(net.blocks[0], models.Block)
    assert [n for n, _ in choose_unit_modules(net, None)] == [f"blocks.{i}" for i in range(4)]
    _grads(net)
    assert calls == [2, 1, 1, 1]
    with torch.no_grad():
        net(torch.randn(2, 13))
    assert calls == [3, 2, 2, 2], "no checkpoint (no recomputation) without grad"


def test_a_second_call_is_a_no_op_with_the_same_setting_and_an_error_otherwise() -> None:
    net = Net()
    smp.set_activation_checkpointing(net.blocks, strategy="group_2")
    cls = type(net.blocks[0])
    smp.set_activation_checkpointing(net.blocks, strategy="group_2")
    assert type(net.blocks[0]) is cls
    with pytest.raises(ValueError, match=r"already checkpointed \(strategy='group_2'.*cannot be undone or changed"):
        smp.set_activation_checkpointing(net.blocks, strategy="each")
    with pytest.raises(ValueError, match="through another call"):
        smp.set_activation_checkpointing(net.blocks[1])


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            {"strategy": "group_1"},
            ValueError,
            r"strategy='group_1' is not .*strategy='each'\).*'group_N' with an integer N >= 2",
        ),
        (
            {"strategy": "groups_2"},
            ValueError,
            r"strategy='groups_2' is not a checkpointing strategy; use 'each', 'contiguous'",
        ),
        ({"strategy": "group_x"}, ValueError, "is not a checkpointing strategy"),
        ({"strategy": 2}, TypeError, "strategy must be a string.*got int 2"),
        ({"preserve_rng_state": "yes"}, TypeError, "preserve_rng_state must be True or False, got str 'yes'"),
        ({"pack_args_as_tuple": None}, TypeError, "pack_args_as_tuple must be True or False, got NoneType"),
    ],
)
def test_argument_errors_name_the_value_and_the_fix(args: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        smp.set_activation_checkpointing(Net().blocks, **args)


def test_module_errors() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Module, got function"):
        smp.set_activation_checkpointing(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"strategy='group_2' groups the children of an nn.ModuleList.*Block is neither"
    ):
        smp.set_activation_checkpointing(models.Block(3, 2), strategy="group_2")
    with pytest.raises(ValueError, match="ModuleList is empty"):
        smp.set_activation_checkpointing(nn.ModuleList())


def test_pack_args_as_tuple_is_accepted() -> None:
    ref = Net()
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks, True, True, "group_2")  # v1's positional order
    assert _equal(_grads(net), _grads(ref))


def test_a_deep_copy_of_a_checkpointed_model_is_checkpointed_alike() -> None:
    ref = Net()
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks, strategy="group_2")
    _grads(net)  # a forward under way in the original is not the copy's
    twin = copy.deepcopy(net)
    twin.zero_grad()
    calls = _calls(twin)
    ref.zero_grad()
    assert _equal(_grads(twin), _grads(ref))
    assert calls == [2, 2, 2, 2]


class _Debuggable(nn.Module):
    def forward(self, h: torch.Tensor, *, debug: bool = False, context_fn: Any = None) -> torch.Tensor:
        return torch.tanh(h) * (2.0 if debug else 1.0) + (0.0 if context_fn is None else 1.0)


def test_keyword_arguments_reach_the_module_even_when_checkpoint_has_them_too() -> None:
    module = _Debuggable()
    smp.set_activation_checkpointing(module)
    x = torch.randn(3, requires_grad=True)
    out = module(x, debug=True, context_fn="mine")
    assert torch.equal(out, torch.tanh(x) * 2.0 + 1.0)
    out.sum().backward()
    assert torch.allclose(x.grad, 2.0 * (1 - torch.tanh(x) ** 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("outer", ["each", "group_2", "contiguous"])
def test_nested_checkpoints(outer: str) -> None:
    """A checkpointed submodule inside checkpointed blocks, and HF-style torch checkpoints of a block's
    forward inside ours: each recomputation checkpoints the inner one again, as torch's nesting does."""
    ref = Net(loop="dropout")
    net = copy.deepcopy(ref)
    smp.set_activation_checkpointing(net.blocks[1].up)
    smp.set_activation_checkpointing(net.blocks, strategy=outer)
    inner = net.blocks[2].down
    plain_forward = inner.forward
    inner.forward = lambda h: torch.utils.checkpoint.checkpoint(plain_forward, h, use_reentrant=False)  # type: ignore[method-assign]
    assert _equal(_grads(net), _grads(ref))


@pytest.mark.parametrize("loop", ["plain", "scale"])
def test_a_forward_without_backward_leaves_no_frame_alive(loop: str) -> None:
    """A parent op between the blocks makes a later block's input a tensor computed inside the group:
    the frame must not keep its graph (whose saved tensors point back at the frame) alive."""
    from shardpar.api.checkpoint_group import GroupFrame

    def frames() -> int:
        gc.collect()
        return sum(type(o) is GroupFrame for o in gc.get_objects())

    net = Net(loop=loop)
    smp.set_activation_checkpointing(net.blocks, strategy="contiguous")
    before = frames()
    loss = net(torch.randn(5, 13, requires_grad=True))
    assert frames() == before + 1
    del loss
    assert frames() == before


@pytest.mark.parametrize("strategy", ["each", "group_2", "contiguous"])
def test_v1_functional_checkpoints(strategy: str) -> None:
    """smdistributed.modelparallel.torch.patches.checkpoint's two functions, imported the v1 way."""
    from shardpar.patches.checkpoint import checkpoint, checkpoint_sequential

    ref = Net(sequential=True)
    net = copy.deepcopy(ref)
    calls = _calls(net)
    x = torch.randn(5, 13, requires_grad=True)
    ours = checkpoint_sequential(net.blocks, x, strategy=strategy, pack_args_as_tuple=False).square().mean()
    ours.backward()
    ref.blocks(x.detach().requires_grad_()).square().mean().backward()
    assert _equal([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()])
    assert calls == [2, 2, 2, 2]  # forward + recomputation
    block = net.blocks[0]
    block.zero_grad()
    checkpoint(block, x, preserve_rng_state=False).sum().backward()
    assert calls[0] == 4
    with pytest.raises(TypeError, match=r"needs an nn\.Module"):
        checkpoint(torch.tanh, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"needs an nn\.Sequential"):
        checkpoint_sequential(nn.ModuleList([block]), x)  # type: ignore[arg-type]
