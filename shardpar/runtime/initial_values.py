"""Every rank starts from rank 0's initial values, as DDP does (issue 29).

[Note: rank 0's initial values]
A script that builds its model before seeding (PEFT's `get_peft_model` is the usual case), or seeds
each rank apart, gives each rank other initial weights. DDP broadcasts rank 0's parameters when it
wraps the model; SageMaker v1 started every rank from the same weights too. Here the values are taken
from rank 0 while wrapping, before the shards are cut, so every replica trains one model and an export
(replica 0's) is the model every rank evaluated:

* Real parameters (a model built normally): unit by unit, the source packs the unit's parameters into
  one flat tensor per dtype and broadcasts it; every other rank copies it into its own parameters in
  place, so the shards, the persistent parameters and the module itself (as with DDP) hold rank 0's
  values. One unit extra on a rank, never the whole model twice.
* Delayed-initialised parameters (`smp.delay_param_initialization()`, or on meta with no record): each
  rank replays its own record of how a parameter was built. Records that agree on every rank (one
  all_gather of a digest, `record_digest`) replay to the same bits, so nothing is sent and each rank
  still materialises only what its shards need. Records that differ (ranks seeded apart) give way to
  values: the source materialises each parameter and broadcasts it, one parameter at a time, so a rank
  holds at most its shards plus one full parameter, and the values are those one process seeded as
  rank 0 would build.
* The source: a parameter every TP rank holds whole comes from global rank 0 over the world; a TP-split
  one (each TP rank holds its own slice) from the first rank of this rank's rdp group, which has the
  same TP position. The TP conversion took each split parameter's full value from TP rank 0 before
  slicing (tensor_parallel/hf.py), so the first TP group's slices are rank 0's model, split -- what one
  process seeded as rank 0 would build and split.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import torch
from torch import nn

from shardpar.collectives import Engine, Group
from shardpar.collectives.native import all_gather_object
from shardpar.sharding.deferred_record import record_digest
from shardpar.sharding.plan import UnitPlan
from shardpar.sharding.tp_split import TPSplit
from shardpar.topology import Topology


class InitialValues:
    """Rank 0's values for the parameters being sharded; see [Note: rank 0's initial values].

    `take_real(params)` (a collective) overwrites one unit's real parameters with the source's, in
    place. Called on a parameter, it returns the parameter's full value, as the `materialize` it wraps
    does: that one's own for a real parameter (taken already) or where every rank's records agree,
    else the source's, broadcast -- then every rank must ask for every parameter in the same order
    (`collective` says so; `Unit.take_shards_from_params(every_param=...)`).
    """

    def __init__(
        self,
        materialize: Callable[[nn.Parameter], torch.Tensor],
        params: Iterable[nn.Parameter],
        *,
        engine: Engine,
        world: Group,
        rdp: Group,
        tp_split: Collection[int],  # ids of the parameters each TP rank holds its own slice of
        rank: int,
        device: torch.device,
    ) -> None:
        self._materialize = materialize
        self._engine = engine
        self._world = world
        self._rdp = rdp
        self._split = set(tp_split)
        self._rank = rank
        self._device = device
        unreal = [p for p in params if p.is_meta]
        # One collective, always (every rank must take part): do the ranks' records replay alike?
        digests = all_gather_object(record_digest(unreal), world) if world.size > 1 else [b""]
        self.collective = any(d != digests[0] for d in digests)

    @classmethod
    def for_model(
        cls,
        module: nn.Module,
        plans: list[UnitPlan],
        materialize: Callable[[nn.Parameter], torch.Tensor],
        topology: Topology,
        engine: Engine,
        tp_splits: Mapping[str, TPSplit] | None,
        device: torch.device,
    ) -> InitialValues:
        """For the parameters of `plans` (all of `module`'s); `tp_splits` names the TP-split ones."""
        splits = tp_splits or {}
        split = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in splits}
        params = [p for up in plans for _, p in up.params]
        return cls(
            materialize,
            params,
            engine=engine,
            world=topology.group("world"),
            rdp=topology.rdp,
            tp_split=split,
            rank=topology.rank,
            device=device,
        )

    def _source(self, p: nn.Parameter) -> tuple[Group, int]:
        group = self._rdp if id(p) in self._split else self._world
        return group, group.ranks[0]

    def take_real(self, params: Iterable[nn.Parameter]) -> None:
        """One unit's real parameters become the source's, in place: one broadcast per (source, dtype)."""
        buckets: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            if not p.is_meta:
                buckets.setdefault((id(p) in self._split, p.dtype), []).append(p)
        with torch.no_grad():
            for (_, dtype), ps in buckets.items():
                group, src = self._source(ps[0])
                if group.size == 1:
                    continue
                if self._rank == src:
                    flat = torch.cat([p.detach().reshape(-1).to(self._device) for p in ps])
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=self._device)
                self._engine.broadcast(flat, src, group)
                if self._rank != src:
                    offset = 0
                    for p in ps:
                        p.copy_(flat[offset : offset + p.numel()].view(p.shape))
                        offset += p.numel()
                del flat

    def __call__(self, p: nn.Parameter) -> torch.Tensor:
        if not (self.collective and p.is_meta):
            return self._materialize(p)
        group, src = self._source(p)
        if self._rank == src:
            full = self._materialize(p).to(self._device).contiguous()
        else:
            full = torch.empty(p.shape, dtype=p.dtype, device=self._device)
        self._engine.broadcast(full, src, group)
        return full
