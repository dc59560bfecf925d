"""offload_activations on CUDA (marked gpu; skipped without CUDA): kept activations go to pinned host
memory on a side stream after forward, the device memory they held is free before backward, and the
gradients are bit-identical to an unchanged model's ([Note: activation offloading])."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import shardpar as smp
from shardpar.api import context
from tests.conftest import init_world_of_one

pytestmark = pytest.mark.gpu

WIDTH, ROWS, DEPTH = 1024, 2048, 6
ACTIVATION = ROWS * WIDTH * 4  # one fp32 hidden state: 8 MiB


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with init_world_of_one(monkeypatch, offload_activations=True, activation_loading_horizon=2):
        assert smp.device().type == "cuda"
        yield


def _run(model: nn.Module) -> tuple[int, list[torch.Tensor]]:
    """(bytes allocated on the device between forward and backward, the gradients)."""
    x = torch.randn(ROWS, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    return held, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]  # type: ignore[union-attr]


def test_offloading_frees_the_device_and_keeps_gradients_bit_identical(on_cuda: None) -> None:
    offloader = context.activation_offloader()
    assert offloader is not None
    ref = _Stack().cuda()
    plain = copy.deepcopy(ref)
    smp.set_activation_checkpointing(plain.layers)
    ref_held, ref_grads = _run(ref)
    offloader.stats.events = []
    held, grads = _run(plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    assert offloader.stats.num_offloaded == offloader.stats.num_reloaded == DEPTH
    kinds = [k for k, _ in offloader.stats.events or []]
    assert kinds.count("reload") == kinds.count("recompute") == DEPTH
    # The checkpointed layers' inputs (DEPTH - 1 hidden states past the model input) left the device;
    # without checkpointing every layer keeps its Linear input and GELU input.
    assert held <= ref_held - DEPTH * ACTIVATION, (held, ref_held)
    assert held <= 2 * ACTIVATION, held  # the loss's saved input, and allocator rounding


def test_the_host_copies_are_pinned_and_the_copies_run_on_a_side_stream(on_cuda: None) -> None:
    offloader = context.activation_offloader()
    assert offloader is not None
    t = torch.randn(ROWS, WIDTH, device="cuda")
    expected = t.clone()
    handle = offloader.offload(t)
    assert handle._host is not None and handle._host.is_pinned()
    side = offloader._streams[t.device]
    assert side != torch.cuda.current_stream()
    del t  # its memory may be reused at once; record_stream keeps it until the copy has read it
    torch.randn(ROWS, WIDTH, device="cuda").fill_(7.0)  # would overwrite it without record_stream
    handle.start_reload()
    assert torch.equal(handle.wait(), expected)
