"""layout.py's shard arithmetic, for any parameter shapes and sharding degree: the shards partition
every parameter exactly, are equal in size, and pad by less than one element per shard."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardpar.sharding.layout import FlatLayout, flat_layout, owned_layout

# Shapes with zero-size dims, scalars (shape ()) and sizes that rarely divide the degree.
shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
param_lists = st.lists(shapes, min_size=0, max_size=8).map(lambda ss: [(f"p{i}", s) for i, s in enumerate(ss)])
degrees = st.integers(1, 8)


def _shard_contents(layout: FlatLayout, shard: int) -> list[tuple[str, int] | None]:
    """What each element of `shard` holds -- (fqn, index in the flattened parameter) or None for
    padding -- read back through the shard's `ParamSlice`s only."""
    out: list[tuple[str, int] | None] = [None] * layout.shard_numel
    for sl in layout.slices(shard):
        assert sl.local_start >= 0 and sl.local_start + sl.length <= layout.shard_numel
        assert sl.param_start >= 0 and sl.param_start + sl.length <= sl.spec.numel
        for k in range(sl.length):
            assert out[sl.local_start + k] is None, f"shard {shard} element {sl.local_start + k} claimed twice"
            out[sl.local_start + k] = (sl.spec.fqn, sl.param_start + k)
    return out


@given(param_lists, degrees)
def test_shards_partition_every_parameter_exactly(params: list[tuple[str, tuple[int, ...]]], sdp: int) -> None:
    layout = flat_layout(params, sdp)
    numel = sum(math.prod(s) for _, s in params)
    assert layout.numel == numel
    assert [s.numel for s in layout.specs] == [math.prod(s) for _, s in params]
    # equal, contiguous shards; padding is the ceil rule: less than one element per shard
    assert layout.padded_numel == layout.shard_numel * sdp
    assert 0 <= layout.padded_numel - numel < sdp
    assert [layout.shard_range(r) for r in range(sdp)] == [
        (r * layout.shard_numel, (r + 1) * layout.shard_numel) for r in range(sdp)
    ]
    # concatenated in rank order, the shards are the flat buffer: every element of every parameter
    # exactly once, in order, then padding (an AllGather of the shards rebuilds the parameters)
    gathered = [x for r in range(sdp) for x in _shard_contents(layout, r)]
    flat = [(fqn, k) for fqn, shape in params for k in range(math.prod(shape))]
    assert gathered == flat + [None] * (layout.padded_numel - numel)


@given(param_lists, degrees)
def test_specs_lie_end_to_end(params: list[tuple[str, tuple[int, ...]]], sdp: int) -> None:
    layout = flat_layout(params, sdp)
    offset = 0
    for spec, (fqn, shape) in zip(layout.specs, params, strict=True):
        assert (spec.fqn, spec.shape, spec.offset) == (fqn, shape, offset)
        offset += spec.numel
    for r in range(sdp):
        assert len(layout.slices(r)) == len(params), "every parameter has a (possibly empty) slice in every shard"


def test_the_module_docstring_example() -> None:
    layout = flat_layout([("w_q", (2, 3)), ("w_k", (6,)), ("bias", (3,))], 4)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (15, 16, 4)
    w_k = next(sl for sl in layout.slices(1) if sl.spec.fqn == "w_k")  # straddles shards 1 and 2
    assert (w_k.local, w_k.param) == (slice(2, 4), slice(0, 2))


@given(param_lists, degrees, st.integers(1, 5))
def test_owned_pieces_split_each_shard_over_the_replicas(
    params: list[tuple[str, tuple[int, ...]]], sdp: int, replicas: int
) -> None:
    """shard_optimizer_state: shards aligned to the replicas pad by less than sdp x replicas elements, and
    piece j of shard s is the j-th of its equal parts -- what a ReduceScatter of the shard over the
    replication group hands replica j ([Note: replica-sharded main], runtime/replica_shard.py)."""
    layout = flat_layout(params, sdp, align=replicas)
    assert layout.shard_numel % replicas == 0
    assert 0 <= layout.padded_numel - layout.numel < sdp * replicas
    owned = owned_layout(layout, replicas)
    n = layout.shard_numel // replicas
    assert owned.shard_numel == n and owned.padded_numel == layout.padded_numel
    for s in range(sdp):
        shard = _shard_contents(layout, s)
        for j in range(replicas):
            assert _shard_contents(owned, s * replicas + j) == shard[j * n : (j + 1) * n]


def test_bad_arguments_are_internal_errors() -> None:
    with pytest.raises(AssertionError, match="does not split into 2 pieces"):
        owned_layout(flat_layout([("w", (5,))], 2), 2)  # shards of 3: a layout not aligned to the replicas
    with pytest.raises(AssertionError, match="num_shards=0"):
        flat_layout([("w", (3,))], 0)
    with pytest.raises(AssertionError, match=r"shard 2 outside 0\.\.1"):
        flat_layout([("w", (3,))], 2).shard_range(2)
