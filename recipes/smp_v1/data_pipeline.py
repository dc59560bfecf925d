"""Pre-training data for train_gpt_simple.py: JSON-lines files of token ids, one sample per line
(`{"input_ids": [...], "attention_mask": [...]}`, the mask optional), plain or gzipped, read by a
DistributedSampler over the data-parallel ranks, as SMP v1 scripts read theirs."""

from __future__ import annotations

import gzip
import json
from typing import IO

import torch
import torch.utils.data
from torch.utils.data import DistributedSampler

import shardpar as smp  # v1: import smdistributed.modelparallel.torch as smp


class GPTPretrainingDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(
        self, input_paths: list[str], max_sequence_length: int, zipped: bool = True, use_last_file_only: bool = False
    ) -> None:
        self.input_paths = input_paths
        self.max_sequence_length = max_sequence_length
        self.lines: list[str] = []
        for path in input_paths[-1:] if use_last_file_only else input_paths:
            with _open(path, zipped) as f:
                self.lines.extend(line for line in f if line.strip())

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = json.loads(self.lines[index])
        ids = torch.tensor(sample["input_ids"], dtype=torch.long)[: self.max_sequence_length]
        mask = torch.tensor(sample.get("attention_mask", [1] * len(ids)), dtype=torch.long)[: len(ids)]
        return ids, mask


Sampler = DistributedSampler[tuple[torch.Tensor, torch.Tensor]]


def _open(path: str, zipped: bool) -> IO[str]:
    return gzip.open(path, "rt") if zipped else open(path)


def create_pretraining_dataloader(
    input_paths: list[str],
    batch_size: int,
    max_sequence_length: int,
    seed: int,
    dp_rank: int,
    dp_size: int,
    shuffle: bool = False,
    zipped: bool = True,
    use_last_file_only: bool = False,
) -> torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of `input_paths`: every `dp_size`-th sample from `dp_rank` (the same
    seeded shuffle on every rank), whole batches only."""
    data = GPTPretrainingDataset(input_paths, max_sequence_length, zipped, use_last_file_only)
    sampler: Sampler = torch.utils.data.DistributedSampler(
        data, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=True
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    # v1 scripts read data on pipeline stage 0 and told the other stages how many batches follow; with
    # pipeline_parallel_degree 1 the PP group is this rank alone, so the broadcast has no receiver.
    if smp.pp_rank() == 0:
        smp.broadcast(len(loader), smp.PP_GROUP)
    return loader
