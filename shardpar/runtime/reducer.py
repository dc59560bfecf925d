"""Gradient ReduceScatter in buckets of up to `sdp_reduce_bucket_size` elements (reference 003).

Units whose backward finished are packed rank-major -- shard r of every unit in the bucket side by
side -- so ONE ReduceScatter hands each rank exactly its shards of all of them:

    unit A (shard 3), unit B (shard 2), 2 ranks:
    bucket  = [ A0 A0 A0 B0 B0 | A1 A1 A1 B1 B1 ]   (row r = what rank r receives)
    rank 0 <- [A0 A0 A0 B0 B0]  = its main-grad pieces of A and B

A complete bucket is issued asynchronously (the engine's thread / NCCL stream runs it while backward
goes on); the results are added to the fp32 main grads when the reducer is drained at the end of
backward. [Note: bucket lifetime] says how long each buffer lives.

[Note: bucket plan]
Which units share a bucket, and the column range of each, is fixed when the model is built
(`plan_buckets`): trainable units in reverse order -- the order backward usually finishes them --
packed up to sdp_reduce_bucket_size elements, a unit bigger than that alone. A bucket is issued once
every unit of it has arrived, and buckets are issued in plan order. So every rank sends the same
layout in the same sequence of collectives whatever order its units' gradients arrive in: a unit
without a gradient on one rank (a branch that rank's data did not take) is packed as zeros at the
end of backward there and mid-backward elsewhere, and its columns still line up. Packing in arrival
order instead would let ranks reduce different units' columns into each other, or issue different
collectives and hang. The price: a unit that finishes later than its plan position (a loss taken
from an intermediate output, a weight shared with a later unit) holds back the buckets after it,
whose buffers then wait, allocated, until it arrives. Units with frozen parameters, which are only
added at the end of backward, are planned last for that reason.

[Note: bucket packing]
A bucket's [num_shards, width] buffer is allocated when its first unit arrives, exactly as wide as
its planned units, and every unit packs its gradients straight into its column range; the full buffer
is sent as it is. Packing each unit into a block of its own and `torch.cat`-ing the blocks at flush
cost a second model-sized buffer and ~85 ms a step at 25M parameters (docs/performance-history.md, fix 1).

[Note: gradients read in place]
Where the engine can read a ReduceScatter input in spans (`Engine.reads_spans`: smddp inside a
node), no bucket buffer exists at all: each unit's gradients are taken off its parameters as they are
(`Unit.take_grads`), and the bucket's collective reads row r of every unit straight from them, zero
counts standing for padding and missing grads (`Unit.grad_spans`). Same layout, same collective,
same bits; what goes is the model-sized buffer, allocated afresh every step (glibc mmaps anything
above 32 MiB: ~70 ms of page faults per 105 MB here), and one copy of every gradient into it
(docs/performance-history.md, item 7). Engines that would pack the spans anyway (native: gloo and NCCL need
one buffer) keep the bucket, packed unit by unit as grads arrive, so the grads are freed early.

[Note: bucket lifetime]
Gradient memory in a backward is about one bucket plus the sharded gradients (issue 19):
  * a unit's full gradients live until `add` packs them into its bucket (`Unit.take_grads` takes them
    off the parameters; the copy is their last use) -- or, read in place, until the bucket is issued;
  * a bucket's [num_shards, width] buffer lives from its first unit's arrival until its ReduceScatter
    completes. The reducer drops its own reference when it issues the bucket, but a torch.distributed
    Work keeps its input tensors until the Work object itself goes, so each `add` retires the issued
    buckets whose collective has completed (`_retire_completed`: a finished wait, no blocking); only
    the sharded output stays for `drain`. Without that every bucket stayed allocated until the end of
    backward: with a bucket of one unit, the whole model's gradients unsharded;
  * double buffering: before a new bucket takes its first unit, at most one issued bucket may still
    be in flight -- an older one is waited for (`_limit_inflight`). It was issued a whole bucket of
    backward compute ago, so the wait is normally already over; where the collectives are slower than
    backward computes, it bounds the buckets alive to two instead of letting them pile up. Every rank
    issues the same collectives in the same order ([Note: bucket plan]), so the wait cannot deadlock;
  * the outputs ([width] per bucket, this rank's shard) become the main grads at `drain`.
So gradient memory in backward is at most one unit's full gradients, two buckets of
sdp_reduce_bucket_size elements, and the sharded gradients. The default (5e8 elements, the
reference's) is one bucket for most models: set it to a few units to bound gradient memory.

[Note: replication in the bucket]
With sdp 1 (plain data parallelism, reference 001's balanced fusion buffer) a bucket needs no
ReduceScatter: it IS this rank's reduced shard the moment it is complete. In the backward that ends
an accumulation window the replication AllReduce is therefore issued on the bucket right then,
asynchronously, so the AllReduce of early buckets runs while backward computes the rest, instead of
one AllReduce per unit after backward (`Unit.finish_accumulation`). That needs more than one bucket:
with the default sdp_reduce_bucket_size (5e8, one bucket for most models) the only bucket completes
at the end of backward. Each unit first folds what the boundary would have reduced into its column
range -- earlier micro-steps' main grad + scale x this one, rounded once to the reduce dtype
(`Unit.fold_main_grad`) -- so every element is reduced from the same values. The results are
bit-identical to the per-unit AllReduce wherever the AllReduce sums each element in an order that
does not depend on its position in the tensor: 2 replicas, and the smddp engine (rank order); ring
AllReduces over 3+ replicas (gloo, NCCL) may round differently. With sdp > 1 the AllReduce would
need the ReduceScatter's result (and, under accumulation, the main grad added to it) first, so it
stays at the boundary.

[Note: replication after the ReduceScatter]
At sdp > 1 the replication AllReduce needs a bucket's ReduceScatter result (and, under accumulation,
the main grad added to it), so it cannot ride in the bucket. In the backward that ends a window it
follows each bucket's ReduceScatter instead: when bucket b+1 is issued -- a fixed point in every
rank's sequence of collectives -- bucket b's ReduceScatter is waited for (issued a bucket of backward
ago, normally done), its units fold their main grads into its output (`Unit.fold_main_grad`: what
`finish_accumulation` would AllReduce, rounded once) and its AllReduce is issued, overlapping the rest
of backward; the last bucket's follows at `drain`. Across nodes this AllReduce is MiCS's only traffic
when the sharding group is a node, so hiding it behind backward is most of the step there. With the
default bucket (5e8 elements: one bucket for most models) it still runs at the end of backward, as
before. The values are the same fold and AllReduce as at the boundary: bit for bit with 2 replicas or
the smddp engine; a ring AllReduce over 3+ replicas chunks a bucket differently from a unit and may
round differently ([Note: replication in the bucket]).

With shard_optimizer_state the bucket of a boundary backward at sdp 1 carries a ReduceScatter over the
replication group instead of the AllReduce ([Note: replica-sharded main], replica_shard.py). Row j of
the reduced bucket must then be piece j of every unit, so that backward packs the bucket
[replicas, width / replicas], each unit's gradient as its own [replicas, w / replicas] block (`split`):

    units A (w 4), B (w 2), 2 replicas:   [ A0 A1 B0 | A2 A3 B1 ]   (row j -> replica j)
    instead of one row:                   [ A0 A1 A2 A3 B0 B1 ]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardpar.collectives import CompletedWork, Engine, Group, ReduceOp, Span, Work
from shardpar.runtime.two_hop import CrossInflight, TwoHopReduce
from shardpar.runtime.unit import Unit


@dataclass(frozen=True)
class BucketPlan:
    """The units of one bucket and where their columns start ([Note: bucket plan])."""

    units: tuple[Unit, ...]
    columns: tuple[int, ...]
    width: int  # shard elements of all its units: the bucket is [num_shards, width]

    def pieces(self, out: torch.Tensor, split: int = 1) -> list[tuple[Unit, torch.Tensor]]:
        """Each unit with its column range of `out`, this rank's reduced row of the bucket (of a bucket
        packed `split` rows per shard: 1/split of each unit's columns)."""
        return [
            (u, out[c // split : (c + u.layout.shard_numel) // split])
            for u, c in zip(self.units, self.columns, strict=True)
        ]


def pack_in_order(numels: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Positions of `numels`, in order, cut into buckets of at most `bucket_size` elements (one bigger
    than that goes alone). The estimator packs its units with it too (cli/memory_model.py)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(numels):
        if not groups or total + n > bucket_size:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def plan_buckets(units: list[Unit], bucket_size: int) -> list[BucketPlan]:
    """Trainable units in reverse order, packed into buckets of at most `bucket_size` elements; a unit
    bigger than that goes alone. Units with frozen parameters come last: they are only added at the end
    of backward (hooks.py), and planned earlier they would hold back every bucket after them."""
    trainable = [u for u in reversed(units) if u.num_trainable]
    order = sorted(trainable, key=lambda u: u.has_frozen)  # stable: reverse order within each kind
    plans = []
    for positions in pack_in_order([u.layout.padded_numel for u in order], bucket_size):
        group = [order[i] for i in positions]
        widths = [u.layout.shard_numel for u in group]
        columns = tuple(sum(widths[:i]) for i in range(len(group)))
        plans.append(BucketPlan(tuple(group), columns, sum(widths)))
    return plans


@dataclass
class _Inflight:
    work: Work
    plan: BucketPlan
    out: torch.Tensor | None  # None: a two-hop node sum kept for the boundary ([Note: cross hop at the boundary])
    replicated: bool  # `out` holds final main grads, AllReduced over the replication group
    split: int = 1  # > 1: `out` holds replica pieces, ReduceScattered over the replication group
    retired: bool = False  # the collective completed and its Work (and input) were dropped
    factor: float | None = None  # two-hop: what `out` enters the main grads with (else drain's scale)


@dataclass
class GradReducer:
    engine: Engine
    sharding: Group
    replication: Group
    reduce_dtype: torch.dtype
    device: torch.device
    plans: list[BucketPlan]
    # id(unit) -> (bucket, column, position in the bucket)
    _where: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    _buffers: list[torch.Tensor | None] = field(default_factory=list)  # [num_shards, width] once started
    # Each bucket's units' grads, by unit position, where the engine reads them in place (else unused).
    _grads: list[list[list[torch.Tensor | None] | None] | None] = field(default_factory=list)
    reads_in_place: bool = field(init=False, default=False)  # [Note: gradients read in place]
    _arrived: list[int] = field(default_factory=list)  # units packed into each bucket in this backward
    _next: int = 0  # the next bucket to issue, in plan order
    _inflight: list[_Inflight] = field(default_factory=list)
    # Set by begin_backward: fold and AllReduce each bucket as it is issued ([Note: replication in the bucket]).
    _replicate_scale: float | None = None
    # sdp > 1, a boundary backward: fold and AllReduce each bucket after its ReduceScatter ([Note: replication
    # after the ReduceScatter]).
    _replicate_after: float | None = None
    # Rows per shard of this backward's buckets: the replicas where the bucket carries their ReduceScatter.
    _split: int = 1
    # A sharding group spanning nodes, sdp_hierarchical_reduce_scatter: [Note: two-hop ReduceScatter].
    two_hop: TwoHopReduce | None = None

    def __post_init__(self) -> None:
        for b, plan in enumerate(self.plans):
            for position, (unit, column) in enumerate(zip(plan.units, plan.columns, strict=True)):
                self._where[id(unit)] = (b, column, position)
        probe = torch.empty(0, dtype=self.reduce_dtype, device=self.device)
        first_hop = self.sharding if self.two_hop is None else self.two_hop.node
        self.reads_in_place = self.sharding.size > 1 and self.engine.reads_spans(probe, first_hop)
        self._clear()

    def _clear(self) -> None:
        self._next, self._inflight = 0, []
        self._arrived = [0] * len(self.plans)
        self._buffers = [None] * len(self.plans)
        self._grads = [None] * len(self.plans)

    def begin_backward(self, *, boundary: bool, scale: float) -> None:
        """Called as each backward starts; `boundary` = it ends an accumulation window, `scale` = the
        factor its gradients enter the main grads with ([Note: micro-batch averaging] in model.py).

        Starts from an empty reducer: a backward that raised half-way never drained, and its half-filled
        buckets and issued collectives must not leak into this one. Those collectives are dropped, not
        waited for (their tensors stay alive as long as the engine uses them); if the ranks did not
        all raise at the same point, the collectives they go on with no longer match, which the smddp
        engine reports and a native one may not -- restart the step on every rank."""
        fold = boundary and self.sharding.size == 1 and self.replication.size > 1
        self._replicate_scale = scale if fold else None
        # shard_optimizer_state: the units' pieces are per replica ([Note: replica-sharded main])
        owned = fold and all(u.replicas.splits for p in self.plans for u in p.units)
        self._split = self.replication.size if owned else 1
        after = boundary and self.sharding.size > 1 and self.replication.size > 1 and self.two_hop is None
        after = after and not any(u.replicas.splits for p in self.plans for u in p.units)
        self._replicate_after = scale if after else None
        if self.two_hop is not None:
            self.two_hop.begin_backward(boundary=boundary, scale=scale)
        self._clear()

    @property
    def replicates(self) -> bool:
        """Whether this backward's buckets carry the replication AllReduce (then the boundary skips it)."""
        return self._replicate_scale is not None or self._replicate_after is not None

    def add(self, unit: Unit) -> None:
        """Take the unit's grads (freeing them) into its bucket; issue every bucket that is complete
        and next in plan order."""
        if id(unit) not in self._where:
            raise AssertionError(
                f"unit {unit.name} has no place in the bucket plan (trainable when the model was built?)"
            )
        b, column, position = self._where[id(unit)]
        if self._arrived[b] == 0:
            self._limit_inflight()  # a new bucket starts: at most one other in flight ([Note: bucket lifetime])
        if self.reads_in_place:
            grads = self._grads[b]
            if grads is None:
                grads = self._grads[b] = [None] * len(self.plans[b].units)
            grads[position] = unit.take_grads(self.reduce_dtype)
        else:
            buffer, split = self._buffers[b], self._split
            if buffer is None:
                rows, width = unit.layout.num_shards * split, self.plans[b].width // split
                if self.two_hop is not None:  # [L, N, width] in memory, packed in shard order
                    buffer = self.two_hop.bucket_buffer(width)[1]
                else:
                    buffer = torch.empty(rows, width, dtype=self.reduce_dtype, device=self.device)
                self._buffers[b] = buffer
            unit.pack_grads(buffer[..., column // split : (column + unit.layout.shard_numel) // split])
        unit.reduced = True
        self._arrived[b] += 1
        while self._next < len(self.plans) and self._arrived[self._next] == len(self.plans[self._next].units):
            self._issue(self._next)
            self._next += 1
        self._retire_completed()

    def _limit_inflight(self, most: int = 1) -> None:
        """Wait for the oldest issued buckets until at most `most` are still in flight."""
        self._retire_completed()
        pending = [item for item in self._inflight if not item.retired]
        for item in pending[: max(0, len(pending) - most)]:
            item.work.wait()
            item.work, item.retired = CompletedWork(), True

    def _retire_completed(self) -> None:
        """Finish the issued buckets whose collective has completed, dropping their Work -- and with it
        the input buffer it keeps alive ([Note: bucket lifetime]); the output waits for `drain`."""
        for item in self._inflight:
            if not item.retired and item.work.is_completed():
                item.work.wait()  # returns at once; finishes an AVG the backend did as SUM
                item.work, item.retired = CompletedWork(), True

    def _issue(self, b: int) -> None:
        """Start bucket b's collective asynchronously: ReduceScatter, or at sdp 1 the replication
        AllReduce in a boundary backward, or nothing (sdp 1: the bucket is the reduced shard)."""
        plan = self.plans[b]
        if self.reads_in_place:
            issued = self._issue_in_place(b)
            if issued is not None:
                self._inflight.append(issued)
                self._replicate_reduced(keep_last=True)
            return
        bucket = self._buffers[b]
        if bucket is None:
            raise AssertionError(f"bucket {b} is complete but has no buffer")
        self._buffers[b] = None  # the engine keeps it alive while it needs it
        if self.two_hop is not None:
            self._take_cross(self.two_hop.issue(b, plan.width, bucket.transpose(0, 1)))
            return
        if self._split > 1:
            self._issue_replica_pieces(plan, bucket)
            return
        work: Work = CompletedWork()
        if self.sharding.size == 1:
            out = bucket.reshape(-1)  # one row: this rank's reduced shard already
            if self._replicate_scale is not None:
                for unit, piece in plan.pieces(out):
                    unit.fold_main_grad(piece, scale=self._replicate_scale)
                work = self.engine.all_reduce(out, self.replication, op=ReduceOp.AVG, async_op=True)
        else:
            out = torch.empty(plan.width, dtype=self.reduce_dtype, device=self.device)
            work = self.engine.reduce_scatter(out, bucket.reshape(-1), self.sharding, op=ReduceOp.AVG, async_op=True)
        self._inflight.append(_Inflight(work, plan, out, replicated=self._replicate_scale is not None))
        self._replicate_reduced(keep_last=True)

    def _replicate_reduced(self, *, keep_last: bool) -> None:
        """[Note: replication after the ReduceScatter]: the replication AllReduce of every issued bucket
        but (with `keep_last`) the one just issued, each once its ReduceScatter is done."""
        scale = self._replicate_after
        if scale is None:
            return
        for item in self._inflight[: -1 if keep_last else None]:
            if item.replicated or item.out is None:
                continue
            item.work.wait()
            for unit, piece in item.plan.pieces(item.out):
                unit.fold_main_grad(piece, scale=scale)
            item.work = self.engine.all_reduce(item.out, self.replication, op=ReduceOp.AVG, async_op=True)
            item.replicated, item.retired = True, False

    def _issue_replica_pieces(self, plan: BucketPlan, bucket: torch.Tensor) -> None:
        """sdp 1, shard_optimizer_state, a boundary backward: fold each unit's [replicas, w / replicas]
        block, then ReduceScatter the bucket over the replication group (see the Note above)."""
        scale, split = self._replicate_scale, self._split
        if scale is None:
            raise AssertionError("a bucket split by replica outside a boundary backward")
        for unit, column in zip(plan.units, plan.columns, strict=True):
            block = bucket[:, column // split : (column + unit.layout.shard_numel) // split]
            unit.replicas.fold(unit, block, scale=scale)  # raises for a unit without a replica piece
        out = torch.empty(plan.width // split, dtype=self.reduce_dtype, device=self.device)
        work = self.engine.reduce_scatter(out, bucket.reshape(-1), self.replication, op=ReduceOp.AVG, async_op=True)
        self._inflight.append(_Inflight(work, plan, out, replicated=True, split=split))

    def _take_cross(self, cross: CrossInflight | None) -> None:
        """Track a two-hop bucket's cross hop (or the node sum it kept for the boundary)."""
        if cross is not None:
            plan = self.plans[cross.bucket]
            self._inflight.append(_Inflight(cross.work, plan, cross.out, replicated=False, factor=cross.factor))

    def _issue_in_place(self, b: int) -> _Inflight | None:
        """Bucket b's ReduceScatter read from the grads themselves ([Note: gradients read in place])."""
        plan, grads = self.plans[b], self._grads[b] or []
        taken = [g for g in grads if g is not None]
        if len(taken) != len(plan.units):
            raise AssertionError(f"bucket {b} is complete but not every unit's grads were taken")
        self._grads[b] = None  # the engine keeps the spans alive while it reads them
        spans: list[Span] = []
        order = range(self.sharding.size) if self.two_hop is None else self.two_hop.shard_order()
        for row in order:
            for unit, unit_grads in zip(plan.units, taken, strict=True):
                spans += unit.grad_spans(unit_grads, row)
        if self.two_hop is not None:
            self._take_cross(self.two_hop.issue(b, plan.width, spans))
            return None
        out = torch.empty(plan.width, dtype=self.reduce_dtype, device=self.device)
        work = self.engine.reduce_scatter_spans(out, spans, self.sharding, op=ReduceOp.AVG, async_op=True)
        return _Inflight(work, plan, out, replicated=False)

    def drain(self, *, scale: float = 1.0) -> None:
        """At the end of backward, once every trainable unit was added: wait for every bucket, then add
        its reduced shards, times `scale`, into the units' main grads (see [Note: micro-batch
        averaging] in model.py), or adopt them where the bucket already carried the replication."""
        if self._next != len(self.plans):
            missing = [u.name for b in range(self._next, len(self.plans)) for u in self.plans[b].units if not u.reduced]
            raise AssertionError(f"backward ended with units not added to the reducer: {missing}")
        if self.two_hop is not None:
            self._take_cross(self.two_hop.finish())
        self._replicate_reduced(keep_last=False)
        for item in self._inflight:
            item.work.wait()
            if item.out is None:
                continue  # kept for the boundary's cross hop ([Note: cross hop at the boundary])
            for unit, piece in item.plan.pieces(item.out, item.split):
                if item.split > 1:  # split only when every unit has a replica piece (begin_backward)
                    unit.replicas.take_grad(piece)  # this rank's piece ([Note: replica-sharded main])
                elif item.replicated:
                    unit.adopt_main_grad(piece)
                else:
                    unit.accumulate_main_grad(piece, scale=scale if item.factor is None else item.factor)
        self._inflight = []
