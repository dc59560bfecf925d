"""Cross-entropy over vocab-parallel logits (Megatron-LM's VocabParallelCrossEntropy): no rank ever
holds a full [tokens, vocab] logits tensor.

    m      = max over the TP group of the local row maxima         (AllGather of [tokens])
    S, t   = sum_v exp(z_v - m), z_target - m (0 off this slice)   (one AllReduce of [2, tokens])
    loss   = log S - t
    dloss/dz_v = softmax_v - [v == target], on this rank's slice only

The engine offers SUM and AVG only, so the maxima are all-gathered (tp values per token) rather
than all-reduced with MAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from shardpar.tensor_parallel.comm import TPComm
from shardpar.tensor_parallel.layers import check_indices


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: TPComm, ignore_index: int) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start = comm.rank * local_vocab
        global_max = comm.all_gather_stack(logits.detach().max(dim=-1).values).max(dim=0).values
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        mine = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = comm.all_reduce(torch.stack([exp.sum(dim=-1), picked]))
        ignored = target == ignore_index
        loss = (sums[0].log() - sums[1]).masked_fill(ignored, 0.0)
        exp.div_(sums[0].unsqueeze(-1))  # now the softmax over the full vocabulary, this rank's slice
        ctx.save_for_backward(exp, local_target, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, mine, ignored = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= mine.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: TPComm, *, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token loss (0 where `target == ignore_index`) from this rank's [tokens, vocab/tp] slice of
    the logits; equals `F.cross_entropy(full_logits, target, reduction="none")`."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [tokens, vocab/tp] and target [tokens]; got {logits.shape}, {target.shape}")
    check_indices(
        target,
        logits.shape[-1] * comm.size,
        "target",
        f"labels must be vocabulary ids or ignore_index={ignore_index} (mark padding with {ignore_index})",
        skip=ignore_index,
    )
    out: torch.Tensor = _VocabParallelCrossEntropy.apply(logits, target, comm, ignore_index)
    return out


@dataclass(frozen=True)
class VocabParallelCausalLMLoss:
    """Drop-in for Hugging Face's `ForCausalLMLoss` (set as `model.loss_function`) when the LM head
    returns vocab-parallel logits: same label shift, ignore_index and reductions."""

    comm: TPComm

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if vocab_size is not None and vocab_size != logits.shape[-1] * self.comm.size:
            raise ValueError(
                f"vocab-parallel logits have {logits.shape[-1]} columns x tensor_parallel_degree {self.comm.size}, "
                f"but vocab_size={vocab_size}"
            )
        logits = logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        per_token = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target, self.comm, ignore_index=ignore_index
        )
        total = per_token.sum()
        if num_items_in_batch is None:
            return total / (target != ignore_index).sum()
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
