"""Pure shard arithmetic for one unit: where each parameter lives in the flat buffer and which slice
of it this rank owns. No torch.distributed here, so it is tested without processes.

A unit's sharded parameters are laid end to end in one flat buffer, padded to a multiple of the
sharding degree so every rank owns an equal, contiguous shard (MiCS / ZeRO-3 flat layout; one
AllGather per unit instead of one per parameter -- gloo's fixed cost per call is ~1 ms here):

    flat:   | w_q (6) | w_k (6) | bias (3) |pad|          numel 15, sdp 4 -> padded 16, shard 4
    shards: [ rank 0  ][ rank 1  ][ rank 2  ][ rank 3  ]
            0         4          8          12        16

A parameter may straddle shards; each rank's piece of it is `ParamSlice.local` (shard coordinates)
and `ParamSlice.param` (coordinates inside the flattened parameter).

With shard_optimizer_state every shard is further cut into one equal piece per replica ([Note:
replica-sharded main], runtime/replica_shard.py): `align` = the number of replicas pads the shard to
a multiple of it, and `owned_layout` is the same buffer cut sdp x replicas ways.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamSpec:
    """One original parameter inside a unit's flat buffer."""

    fqn: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # start inside the flat (unpadded) buffer


@dataclass(frozen=True)
class ParamSlice:
    """The part of one parameter that a given shard holds (possibly empty)."""

    spec: ParamSpec
    local_start: int  # inside the shard
    param_start: int  # inside the flattened parameter
    length: int

    @property
    def local(self) -> slice:
        return slice(self.local_start, self.local_start + self.length)

    @property
    def param(self) -> slice:
        return slice(self.param_start, self.param_start + self.length)


@dataclass(frozen=True)
class FlatLayout:
    specs: tuple[ParamSpec, ...]
    num_shards: int
    align: int = 1  # shard_numel is a multiple of it (the replicas, with shard_optimizer_state)

    @property
    def numel(self) -> int:
        return self.specs[-1].offset + self.specs[-1].numel if self.specs else 0

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // (self.num_shards * self.align)) * self.align  # ceil, then aligned

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    def shard_range(self, shard: int) -> tuple[int, int]:
        if not 0 <= shard < self.num_shards:
            raise AssertionError(f"shard {shard} outside 0..{self.num_shards - 1}")
        return shard * self.shard_numel, (shard + 1) * self.shard_numel

    def slices(self, shard: int) -> tuple[ParamSlice, ...]:
        """Every parameter's piece in `shard` (length 0 when the parameter lies elsewhere)."""
        lo, hi = self.shard_range(shard)
        out = []
        for spec in self.specs:
            start, end = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
            length = max(0, end - start)
            out.append(
                ParamSlice(
                    spec=spec,
                    local_start=(start - lo) if length else 0,
                    param_start=(start - spec.offset) if length else 0,
                    length=length,
                )
            )
        return tuple(out)


def owned_layout(layout: FlatLayout, num_pieces: int) -> FlatLayout:
    """The same buffer cut into `num_pieces` equal pieces per shard: piece `shard * num_pieces + j` is
    the j-th of shard `shard` (the piece replica j owns under shard_optimizer_state)."""
    if layout.shard_numel % num_pieces:
        raise AssertionError(f"shard of {layout.shard_numel} elements does not split into {num_pieces} pieces")
    owned = FlatLayout(layout.specs, layout.num_shards * num_pieces)
    if owned.padded_numel != layout.padded_numel:
        raise AssertionError(f"owned pieces cover {owned.padded_numel} elements, the shards {layout.padded_numel}")
    return owned


def flat_layout(params: list[tuple[str, tuple[int, ...]]], num_shards: int, *, align: int = 1) -> FlatLayout:
    """Lay `(fqn, shape)` pairs end to end, in the order given; each shard a multiple of `align`."""
    if num_shards < 1 or align < 1:
        raise AssertionError(f"num_shards={num_shards} and align={align} must be >= 1")
    specs, offset = [], 0
    for fqn, shape in params:
        numel = 1
        for d in shape:
            numel *= d
        specs.append(ParamSpec(fqn, tuple(shape), numel, offset))
        offset += numel
    return FlatLayout(tuple(specs), num_shards, align)
