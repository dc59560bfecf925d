"""smp.send / smp.broadcast's mutual-send check ([Note: p2p through the store]) against the store
interleaving a loaded machine produced in the 4-rank test: the receiver takes the object, acks, and
starts its own send to us, all between our read of the ack key and our read of its message key."""

from __future__ import annotations

import pytest

from shardpar.api.p2p import _wait_for_ack


class _Store:
    """A store whose keys appear in the order a peer wrote them: each check() is one step later."""

    def __init__(self, appear: dict[str, int]) -> None:
        self.appear = appear
        self.now = 0

    def check(self, keys: list[str]) -> bool:
        self.now += 1
        return all(self.appear.get(k, 10**9) <= self.now for k in keys)


def test_a_receiver_that_acked_and_then_sent_is_no_deadlock(world_of_one: None) -> None:
    # our 1st read: no ack; peer then acks (step 2) and sends (step 2); our 2nd read sees its send
    _wait_for_ack(_Store({"ack": 2, "theirs": 2}), "ack", "theirs", 1, "smp.broadcast(WORLD)")


def test_a_peer_sending_without_taking_ours_is_an_error(world_of_one: None) -> None:
    with pytest.raises(ValueError, match="global rank 1 is sending to this rank while this rank sends to it"):
        _wait_for_ack(_Store({"theirs": 1}), "ack", "theirs", 1, "smp.broadcast(WORLD)")
