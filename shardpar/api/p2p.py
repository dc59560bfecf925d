"""SageMaker model-parallel v1's point-to-point object helpers: `smp.send(obj, dest_rank, rank_type)`,
`smp.recv_from(src_rank, rank_type)`, and `smp.broadcast(obj, group)` called by the sender alone.

[Note: p2p through the store]
v1 calls are synchronous: a send returns once the receiver took the object. The sender posts the
pickled object under a key of the rendezvous store naming the pair and the message's number
(`shardpar/p2p/<src>><dst>/<n>`), and waits for the receiver's acknowledgement key; the receiver
waits for the message, reads and deletes it, and acknowledges. Both sides count the messages of each
pair, so messages between two ranks arrive in order. Nothing goes through a process group, so a
send never mismatches another rank's collective, and every wait is bounded by
`collective_timeout_s`: a missing peer is a TimeoutError naming it, never a hang.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any

import torch.distributed as dist

from shardpar.api.context import CommGroup, broadcast_collective, rank, state
from shardpar.api.groups import RankType, group_ranks

_PREFIX = "shardpar/p2p"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _global_rank(peer: int, rank_type: RankType, what: str) -> int:
    if not isinstance(rank_type, RankType):
        raise TypeError(f"{what}: rank_type must be an smp.RankType (e.g. smp.RankType.WORLD_RANK), got {rank_type!r}")
    ranks = group_ranks(rank_type.group_kind)
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < len(ranks):
        raise ValueError(
            f"{what}: rank {peer!r} is not a {rank_type.name} of this rank's group (global ranks {list(ranks)}); "
            f"pass 0..{len(ranks) - 1}"
        )
    target = ranks[peer]
    if target == rank():
        raise ValueError(f"{what}: {rank_type.name} {peer} is this rank itself (global rank {target})")
    return target


def _wait(store: dist.Store, key: str, what: str) -> None:
    timeout = state().config.collective_timeout_s
    try:
        store.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as exc:  # the store raises a DistStoreError / RuntimeError on timeout
        raise TimeoutError(f"{what} did not happen within collective_timeout_s={timeout:g} s") from exc


def _send_global(obj: Any, dest: int, what: str) -> None:
    st, me, store = state(), rank(), _store()
    n = st.p2p_sent.get(dest, 0)
    st.p2p_sent[dest] = n + 1
    key = f"{_PREFIX}/{me}>{dest}/{n}"
    store.set(key, pickle.dumps(obj))  # type: ignore[arg-type]  # c10d stores take bytes too
    _wait_for_ack(store, key + "/ack", f"{_PREFIX}/{dest}>{me}/{st.p2p_received.get(dest, 0)}", dest, what)
    store.delete_key(key + "/ack")


def _wait_for_ack(store: dist.Store, ack: str, theirs: str, dest: int, what: str) -> None:
    """Wait for `dest` to take the object; a `dest` that is itself sending to this rank would wait for
    this rank's recv_from forever, as this rank waits for its: an error now, not a timeout later.
    That is also what every member calling `smp.broadcast(obj, group)` without `src` looks like."""
    timeout = state().config.collective_timeout_s
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while not store.check([ack]):
        # Read ack again after seeing theirs: a receiver that took the object and then started sending
        # to us posts its ack first, so that ack is visible now, while between our two reads it may not
        # have been (the race a loaded machine shows).
        if store.check([theirs]) and not store.check([ack]):
            raise ValueError(
                f"{what}: global rank {dest} is sending to this rank while this rank sends to it, so each waits "
                "for the other's smp.recv_from. SMP v1's smp.broadcast(obj, group) is called by the sender alone, "
                "with smp.recv_from on the others; for a collective that every member calls, pass src=<global rank>"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: global rank {dest} taking the object (its smp.recv_from({rank()}, ...)) did not happen "
                f"within collective_timeout_s={timeout:g} s"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send `obj` (picklable) to the rank `dest_rank` of this rank's `rank_type` group; returns once it
    called the matching `smp.recv_from` ([Note: p2p through the store])."""
    what = f"smp.send(dest_rank={dest_rank}, {rank_type!r})"
    _send_global(obj, _global_rank(dest_rank, rank_type, what), what)


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """The object sent by the rank `src_rank` of this rank's `rank_type` group (with `smp.send` or
    `smp.broadcast`)."""
    what = f"smp.recv_from(src_rank={src_rank}, {rank_type!r})"
    src = _global_rank(src_rank, rank_type, what)
    st, me, store = state(), rank(), _store()
    n = st.p2p_received.get(src, 0)
    key = f"{_PREFIX}/{src}>{me}/{n}"
    _wait(store, key, f"{what}: global rank {src} sending (smp.send or smp.broadcast)")
    obj = pickle.loads(store.get(key))
    st.p2p_received[src] = n + 1
    store.delete_key(key)
    store.set(key + "/ack", "1")
    return obj


def broadcast(obj: Any, group: CommGroup = CommGroup.WORLD, *, src: int | None = None) -> Any:
    """SageMaker v1's form, `smp.broadcast(obj, group)`, is called by the sender alone: every other
    member of `group` receives `obj` with `smp.recv_from(...)`, and it returns None once they all did.

    With `src` (a global rank) it is a collective instead: every member calls it and gets the object
    `src` holds."""
    if not isinstance(group, CommGroup):
        raise TypeError(f"smp.broadcast: group must be an smp.CommGroup (e.g. smp.WORLD), got {group!r}")
    if src is not None:
        return broadcast_collective(obj, group, src)
    for dest in group_ranks(group.value):
        if dest != rank():
            _send_global(obj, dest, f"smp.broadcast({group.name})")
    return None
