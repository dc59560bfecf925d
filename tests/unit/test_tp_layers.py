"""TP layers, communication regions and the vocab-parallel loss on 2 simulated TP ranks (threads in one
process sharing an in-memory engine), against the plain single-device modules: outputs AND grads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardpar.collectives import CompletedWork, Group, ReduceOp, Work
from shardpar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPComm,
    VocabParallelCausalLMLoss,
    VocabParallelEmbedding,
    gather_from_tp_region,
    scatter_to_tp_region,
    vocab_parallel_cross_entropy,
)

TOL = 1e-6


class ThreadEngine:
    """Collectives between threads: every rank deposits its tensor, all wait, all read in rank order."""

    name = "threads"

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=20)
        self._slots: list[torch.Tensor | None] = [None] * size
        self.calls: list[str] = []

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t.clone()
        self._barrier.wait()
        out = [s for s in self._slots if s is not None]
        self._barrier.wait()  # nobody overwrites a slot before everyone read it
        return out

    def all_reduce(
        self, tensor: torch.Tensor, group: Group, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work:
        rank = _RANK.value
        if rank == 0:
            self.calls.append("all_reduce")
        total = torch.stack(self._exchange(rank, tensor)).sum(dim=0)
        tensor.copy_(total / self.size if op is ReduceOp.AVG else total)
        return CompletedWork()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: Group, *, async_op: bool = False) -> Work:
        rank = _RANK.value
        if rank == 0:
            self.calls.append("all_gather")
        output.copy_(torch.cat(self._exchange(rank, input)))
        return CompletedWork()


class _Rank(threading.local):
    value = 0


_RANK = _Rank()


def on_tp_ranks(size: int, fn: Callable[[TPComm], Any]) -> tuple[list[Any], ThreadEngine]:
    """fn(comm) on `size` threads, one per simulated TP rank; results in rank order."""
    engine = ThreadEngine(size)
    group = Group("tp", tuple(range(size)))
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        _RANK.value = rank
        try:
            results[rank] = fn(TPComm(engine, group, rank))  # type: ignore[arg-type]
        except BaseException as e:
            errors.append(e)
            engine._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results, engine


def _mlp(seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    return nn.Linear(6, 10), nn.Linear(10, 6)


def test_column_then_row_equals_the_plain_mlp() -> None:
    up, down = _mlp()
    x = torch.randn(3, 5, 6, requires_grad=True)
    ref = down(torch.tanh(up(x)))
    ref.square().sum().backward()

    def rank_fn(comm: TPComm) -> dict[str, torch.Tensor]:
        col = ColumnParallelLinear(up.weight, up.bias, comm)
        row = RowParallelLinear(down.weight, down.bias, comm)
        xr = x.detach().clone().requires_grad_()
        y = row(torch.tanh(col(xr)))
        y.square().sum().backward()
        return {"y": y.detach(), "x_grad": xr.grad, "col_w": col.weight.grad, "row_w": row.weight.grad,
                "row_b": row.bias.grad}  # fmt: skip

    (r0, r1), engine = on_tp_ranks(2, rank_fn)
    for r in (r0, r1):
        assert (r["y"] - ref).abs().max() <= TOL
        assert (r["x_grad"] - x.grad).abs().max() <= TOL  # copy_to_tp summed the partial input grads
        assert (r["row_b"] - down.bias.grad).abs().max() <= TOL  # replicated bias: the full grad
    assert torch.equal(r0["row_b"], r1["row_b"]) and torch.equal(r0["x_grad"], r1["x_grad"])
    assert (torch.cat([r0["col_w"], r1["col_w"]]) - up.weight.grad).abs().max() <= TOL
    assert (torch.cat([r0["row_w"], r1["row_w"]], dim=1) - down.weight.grad).abs().max() <= TOL
    # forward: one AllReduce (row); backward: one (column's copy region)
    assert engine.calls == ["all_reduce", "all_reduce"]


def test_transposed_fused_qkv_column_keeps_whole_heads() -> None:
    """GPT-2's Conv1D c_attn: weight [in, 3*out], output [q | k | v]; rank r must get head block r of each."""
    torch.manual_seed(1)
    w, b = torch.randn(4, 12), torch.randn(12)
    x = torch.randn(2, 4)
    full = x @ w + b  # [q(4) | k(4) | v(4)]

    def rank_fn(comm: TPComm) -> torch.Tensor:
        return ColumnParallelLinear(w, b, comm, transposed=True, num_parts=3)(x).detach()

    (y0, y1), _ = on_tp_ranks(2, rank_fn)
    q, k, v = full.split(4, dim=-1)
    assert torch.allclose(y0, torch.cat([q[:, :2], k[:, :2], v[:, :2]], dim=-1), atol=TOL)
    assert torch.allclose(y1, torch.cat([q[:, 2:], k[:, 2:], v[:, 2:]], dim=-1), atol=TOL)


def test_vocab_parallel_embedding_and_padding_row() -> None:
    torch.manual_seed(2)
    emb = nn.Embedding(8, 3, padding_idx=5)
    ids = torch.tensor([[0, 5, 7, 3], [4, 4, 1, 5]])
    emb(ids).sum().backward()

    def rank_fn(comm: TPComm) -> tuple[torch.Tensor, torch.Tensor]:
        layer = VocabParallelEmbedding(emb.weight, comm, padding_idx=5)
        out = layer(ids)
        out.sum().backward()
        return out.detach(), layer.weight.grad

    (r0, r1), _ = on_tp_ranks(2, rank_fn)
    assert torch.equal(r0[0], emb(ids).detach()) and torch.equal(r1[0], r0[0])  # one rank adds each row
    assert torch.equal(torch.cat([r0[1], r1[1]]), emb.weight.grad)
    assert r1[1][1].abs().sum() == 0  # row 5 = local row 1 of rank 1: the padding row gets no grad


def test_gather_and_scatter_regions_are_inverse() -> None:
    x = torch.randn(2, 3, 8, requires_grad=True)

    def rank_fn(comm: TPComm) -> tuple[torch.Tensor, torch.Tensor]:
        xr = x.detach().clone().requires_grad_()
        local = scatter_to_tp_region(xr, comm)
        back = gather_from_tp_region(local * (comm.rank + 1), comm)
        back.sum().backward()
        return back.detach(), xr.grad

    (r0, r1), _ = on_tp_ranks(2, rank_fn)
    expected = torch.cat([x[..., :4], 2 * x[..., 4:]], dim=-1).detach()
    assert torch.equal(r0[0], expected) and torch.equal(r1[0], expected)
    assert torch.equal(r0[1], torch.cat([torch.ones(2, 3, 4), 2 * torch.ones(2, 3, 4)], dim=-1))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_vocab_parallel_cross_entropy_equals_cross_entropy(size: int) -> None:
    torch.manual_seed(3)
    logits = (5 * torch.randn(7, 16)).requires_grad_()
    target = torch.tensor([0, 15, 3, -100, 8, 9, 7])
    ref = F.cross_entropy(logits, target, reduction="none")
    ref.sum().backward()

    def rank_fn(comm: TPComm) -> tuple[torch.Tensor, torch.Tensor]:
        local = comm.slice_last(logits.detach()).requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, comm)
        loss.sum().backward()
        return loss.detach(), local.grad

    results, _ = on_tp_ranks(size, rank_fn)
    for loss, _ in results:
        assert (loss - ref.detach()).abs().max() <= 1e-5
    grad = torch.cat([g for _, g in results], dim=-1)
    assert (grad - logits.grad).abs().max() <= 1e-6
    assert grad[3].abs().sum() == 0  # ignored token


def test_causal_lm_loss_matches_hugging_face() -> None:
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(4)
    logits = torch.randn(2, 5, 12)
    labels = torch.randint(0, 12, (2, 5))
    labels[0, 2] = -100
    for items in (None, torch.tensor(6)):
        ref = ForCausalLMLoss(logits, labels, vocab_size=12, num_items_in_batch=items)

        def rank_fn(comm: TPComm, items: Any = items) -> torch.Tensor:
            return VocabParallelCausalLMLoss(comm)(comm.slice_last(logits), labels, 12, num_items_in_batch=items)

        results, _ = on_tp_ranks(2, rank_fn)
        for r in results:
            assert abs(r.item() - ref.item()) <= 1e-6
    with pytest.raises(ValueError, match="vocab_size=13"):
        on_tp_ranks(2, lambda comm: VocabParallelCausalLMLoss(comm)(comm.slice_last(logits), labels, 13))


def _raised(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except IndexError as e:
        return str(e)
    return "no error"


def test_ids_and_targets_outside_the_vocabulary_raise_on_every_rank() -> None:
    """Split lookups cannot rely on torch's own range check: an id outside every rank's slice would
    read as zeros on all ranks, and a target outside every slice would give a finite loss."""
    emb = nn.Embedding(8, 3)
    logits = torch.randn(3, 8)
    cases: dict[str, Callable[[TPComm], Any]] = {
        "id 8": lambda comm: VocabParallelEmbedding(emb.weight, comm)(torch.tensor([[1, 8]])),
        "id -1": lambda comm: VocabParallelEmbedding(emb.weight, comm)(torch.tensor([[-1, 2]])),
        "target 8": lambda comm: vocab_parallel_cross_entropy(comm.slice_last(logits), torch.tensor([1, 8, 2]), comm),
        "target -1": lambda comm: vocab_parallel_cross_entropy(comm.slice_last(logits), torch.tensor([1, -1, 2]), comm),
    }
    for name, fn in cases.items():
        results, _ = on_tp_ranks(2, lambda comm, fn=fn: _raised(lambda: fn(comm)))  # type: ignore[misc]
        value = name.split()[1]
        for message in results:
            assert f"{value} is outside [0, 8)" in message, (name, message)
    # ignore_index is not a vocabulary id and passes
    on_tp_ranks(2, lambda comm: vocab_parallel_cross_entropy(comm.slice_last(logits), torch.tensor([1, -100, 7]), comm))


def test_the_range_check_off_the_host_never_reads_values() -> None:
    """On an accelerator the check must not sync the host: no boolean indexing (nonzero) or .item().
    Meta tensors have no values, so any such read raises here."""
    from shardpar.tensor_parallel.layers import check_indices

    ids = torch.empty(5, dtype=torch.long, device="meta")
    check_indices(ids, 8, "target", "fix", skip=-100)
    check_indices(ids, 8, "input id", "fix")
