"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019): ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding.

Each layer keeps its parameters under the original names (`weight`, `bias`) and in the original
orientation (`transposed=True` for GPT-2's Conv1D, whose weight is [in, out]), so a converted model's
FQNs are the Hugging Face ones and only the shapes of TP-split parameters shrink. `tp_splits()` says
which parameters are split and how (`TPSplit`); everything else is TP-replicated.

    ColumnParallelLinear   Y_r = X W_r^T + b_r        W, b cut along the output features
    RowParallelLinear      Y   = sum_r X_r W_r^T + b  W cut along the input features; b replicated
    VocabParallelEmbedding E   = sum_r E_r(ids)       rows cut by vocab; ids outside the slice give 0
                                                  (ids outside the vocabulary raise)

The layers are device-agnostic: they compute on whatever device their parameters live on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardpar.sharding.tp_split import TPSplit
from shardpar.tensor_parallel.comm import (
    TPComm,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
)


def check_indices(indices: torch.Tensor, limit: int, what: str, fix: str, *, skip: int | None = None) -> None:
    """Raise IndexError unless every entry of `indices` (but `skip`) lies in [0, limit). A split lookup
    cannot leave this to torch: an index outside every rank's slice would silently read as zeros.
    Every TP rank holds the same indices, so the whole group raises together. On an accelerator the
    check is a device-side assert, as torch's own embedding does there, to keep the host unsynced."""
    ok = (indices >= 0) & (indices < limit)
    if skip is not None:
        ok |= indices == skip
    if indices.device.type != "cpu":  # no boolean indexing either: it would sync through nonzero()
        torch._assert_async(ok.all(), f"{what} outside [0, {limit}); {fix}")
        return
    bad = indices[~ok]
    if bad.numel():
        raise IndexError(f"{what} {int(bad[0])} is outside [0, {limit}); {fix}")


def _local_param(full: torch.Tensor, split: TPSplit, rank: int) -> nn.Parameter:
    # clone: a view would keep the full tensor's storage alive
    return nn.Parameter(split.local_of(full.detach(), rank).clone(), requires_grad=full.requires_grad)


class TPLayer(nn.Module):
    """A layer whose parameters are (partly) split over the TP group."""

    comm: TPComm

    def tp_splits(self) -> dict[str, TPSplit]:
        """Local parameter name -> how it is split; parameters not named are TP-replicated."""
        raise NotImplementedError


class ColumnParallelLinear(TPLayer):
    """Output features split over the TP group.

    `copy_input=False` when the caller already put the input through `copy_to_tp_region` once for
    several column-parallel layers (Llama's q/k/v), so backward all-reduces their summed input grad
    once. `gather_output=True` all-gathers the output features (an LM head whose caller wants full logits).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: TPComm,
        *,
        transposed: bool = False,
        num_parts: int = 1,
        gather_output: bool = False,
        copy_input: bool = True,
    ) -> None:
        """`weight`/`bias` are the FULL tensors (same values on every TP rank); this rank keeps its piece."""
        super().__init__()
        self.comm = comm
        self.transposed = transposed
        self.gather_output = gather_output
        self.copy_input = copy_input
        self._weight_split = TPSplit(dim=1 if transposed else 0, size=comm.size, num_parts=num_parts)
        self._bias_split = TPSplit(dim=0, size=comm.size, num_parts=num_parts)
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape
        self._weight_split.check_full_dim(self.out_features, f"output features of a {tuple(weight.shape)} weight")
        self.weight = _local_param(weight, self._weight_split, comm.rank)
        self.bias = None if bias is None else _local_param(bias, self._bias_split, comm.rank)

    def tp_splits(self) -> dict[str, TPSplit]:
        splits = {"weight": self._weight_split}
        if self.bias is not None:
            splits["bias"] = self._bias_split
        return splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp_region(x, self.comm)
        w = self.weight.t() if self.transposed else self.weight
        y = F.linear(x, w, self.bias)
        return gather_from_tp_region(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        local = self.out_features // self.comm.size
        return f"in={self.in_features}, out={self.out_features} ({local} on TP rank {self.comm.rank})"


class RowParallelLinear(TPLayer):
    """Input features split over the TP group; the input is already split (the output of a
    column-parallel layer); the bias is added once, after the partial outputs are summed."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, comm: TPComm, *, transposed: bool = False
    ) -> None:
        super().__init__()
        self.comm = comm
        self.transposed = transposed
        self._weight_split = TPSplit(dim=0 if transposed else 1, size=comm.size)
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape
        self._weight_split.check_full_dim(self.in_features, f"input features of a {tuple(weight.shape)} weight")
        self.weight = _local_param(weight, self._weight_split, comm.rank)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def tp_splits(self) -> dict[str, TPSplit]:
        return {"weight": self._weight_split}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.transposed else self.weight
        y = reduce_from_tp_region(F.linear(x, w), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        local = self.in_features // self.comm.size
        return f"in={self.in_features} ({local} on TP rank {self.comm.rank}), out={self.out_features}"


class VocabParallelEmbedding(TPLayer):
    """Embedding rows (the vocabulary) split over the TP group; each rank looks up the ids in its
    slice, zeros the others, and the TP group sums: exactly one rank contributes each row."""

    def __init__(
        self,
        weight: torch.Tensor,
        comm: TPComm,
        *,
        padding_idx: int | None = None,
        embed_scale: torch.Tensor | None = None,
    ) -> None:
        """`embed_scale`: a scaled embedding's factor (Gemma's sqrt(hidden_size)), kept as its
        non-persistent buffer and applied in the weight's dtype, as the Hugging Face module does."""
        super().__init__()
        self.comm = comm
        self.embed_scale: torch.Tensor | None
        self.register_buffer(
            "embed_scale", None if embed_scale is None else embed_scale.detach().clone(), persistent=False
        )
        self._weight_split = TPSplit(dim=0, size=comm.size)
        self.num_embeddings, self.embedding_dim = weight.shape
        self._weight_split.check_full_dim(self.num_embeddings, f"vocabulary of a {tuple(weight.shape)} embedding")
        self.vocab_start = comm.rank * (self.num_embeddings // comm.size)
        self.vocab_end = self.vocab_start + self.num_embeddings // comm.size
        self.padding_idx = padding_idx
        self.weight = _local_param(weight, self._weight_split, comm.rank)

    def tp_splits(self) -> dict[str, TPSplit]:
        return {"weight": self._weight_split}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_indices(
            ids,
            self.num_embeddings,
            "input id",
            "resize the embeddings to the tokenizer (model.resize_token_embeddings) before wrapping the model",
        )
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = pad - self.vocab_start if pad is not None and self.vocab_start <= pad < self.vocab_end else None
        out = F.embedding(local_ids, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.embed_scale is not None:  # zeros stay zeros: the one rank holding a row scales it
            out = out * self.embed_scale.to(self.weight.dtype)
        return reduce_from_tp_region(out, self.comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


class HeadParallelEmbedding(TPLayer):
    """An embedding whose columns are attention heads (T5's relative_attention_bias, [buckets, heads]):
    columns split over the TP group, output kept local -- each rank looks up the bias of its own heads,
    as a column-parallel projection hands on its own heads."""

    def __init__(self, weight: torch.Tensor, comm: TPComm) -> None:
        super().__init__()
        self.comm = comm
        self._weight_split = TPSplit(dim=1, size=comm.size)
        self.num_embeddings, self.embedding_dim = weight.shape
        self._weight_split.check_full_dim(self.embedding_dim, f"head columns of a {tuple(weight.shape)} embedding")
        self.weight = _local_param(weight, self._weight_split, comm.rank)

    def tp_splits(self) -> dict[str, TPSplit]:
        return {"weight": self._weight_split}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # ids are the same on every TP rank: nothing to reduce

    def extra_repr(self) -> str:
        local = self.embedding_dim // self.comm.size
        return f"{self.num_embeddings}, {self.embedding_dim} ({local} on TP rank {self.comm.rank})"


def tp_split_table(root: nn.Module) -> dict[str, TPSplit]:
    """FQN (as in `root.named_parameters(remove_duplicate=False)`) -> TPSplit of every TP-split
    parameter under `root`; empty for a model without TP layers. Tied parameters appear under each
    name, also where the other name belongs to a plain module (BERT's cls.predictions.bias is the
    LM head's bias)."""
    by_param: dict[int, TPSplit] = {}
    for module in root.modules():
        if isinstance(module, TPLayer):
            for pname, split in module.tp_splits().items():
                by_param[id(getattr(module, pname))] = split
    return {name: by_param[id(p)] for name, p in root.named_parameters(remove_duplicate=False) if id(p) in by_param}
