"""The smddp engine's job-level agreements: the per-job secret that names every group's shared-memory
segment ([Note: shm trust] in csrc/shm_transport.c), the check that a node's ranks share a host, and
how a group splits into nodes for the hierarchical AllGather."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from shardpar.collectives import shm


def segment_key(secret: str, ranks: Sequence[int]) -> str:
    """The key in the segment name of the group `ranks`: HMAC-SHA256 under the engine's secret, so a
    name seen in /dev/shm reveals neither the secret nor any other group's name ([Note: smddp ordering])."""
    digest = hmac.new(secret.encode(), ",".join(map(str, ranks)).encode(), hashlib.sha256).hexdigest()
    return f"j{digest[:32]}"


def _split_by_node(ranks: tuple[int, ...], rpn: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]] | None:
    """(per-node members, cross-node peers at the same position) or None when nodes hold unequal counts."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // rpn, []).append(r)
    if len({len(v) for v in by_node.values()}) != 1:
        return None
    per_node = [tuple(v) for v in by_node.values()]
    return per_node, [tuple(node[i] for node in per_node) for i in range(len(per_node[0]))]


def _agree_on_job(collective: bool, rank: int, world: int, ranks_per_node: int) -> str:
    """A secret of this engine in this job (rank 0's draw, sent over the process group: never through
    /dev/shm or the store), after checking that every rank counts the same ranks per node and that no
    node spans two hosts: its ranks could not share memory, and would wait for each other at the first
    shm collective until the timeout."""
    mine = (secrets.token_hex(16) if rank == 0 else "", shm.host_id(), ranks_per_node)
    replies: list[Any] = [mine]
    if collective:
        replies = [None] * world  # all_gather_object fills every entry
        dist.all_gather_object(replies, mine)
    rpn = replies[0][2]  # rank 0's, so that every rank raises the same error
    for rank, (_, _, theirs) in enumerate(replies):
        if theirs != rpn:
            raise ValueError(
                f"ranks_per_node is {rpn} on rank 0 but {theirs} on rank {rank}: set ranks_per_node "
                "(or LOCAL_WORLD_SIZE) alike on every rank"
            )
    first_on_node: dict[int, tuple[int, str]] = {}
    for rank, (_, host, _) in enumerate(replies):
        other, other_host = first_on_node.setdefault(rank // rpn, (rank, host))
        if other_host != host:
            raise ValueError(
                f"ranks_per_node={rpn} puts ranks {other} and {rank} on one node, but they run on "
                f"different hosts ({other_host!r}, {host!r}) and cannot share memory: set ranks_per_node "
                "(or LOCAL_WORLD_SIZE) to the number of ranks each host runs"
            )
    secret: str = replies[0][0]
    return secret
