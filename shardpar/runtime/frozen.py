"""A unit's parameters frozen at wrap time (`requires_grad=False`, PEFT's base weights): issue 33.

[Note: frozen shards]
A frozen parameter never gets a gradient and is never stepped, so it needs none of what a trained one
keeps: no fp32 main copy, no main grad, no column in a reduce bucket, no optimizer state, no replica
AllReduce. Its unit keeps it in a `FrozenShard` beside the trainable layout: one flat shard of the
frozen parameters end to end (their own `FlatLayout`), in their own dtype -- a bf16 base costs 2 bytes
per parameter / sdp -- which the unit AllGathers with its trainable shard and frees with it. Where the
compute dtype differs from the parameters' (an fp32 base under bf16), a compute-dtype copy of the shard
is kept too and gathered instead: the forward computes in the compute dtype, as for every parameter.
The trainable layout, the reducer, the replica pieces and the optimizer never see a frozen parameter;
ShardedState's pieces do (checkpoints and state dicts hold every parameter), with `main` viewing the
frozen shard and no grad.

The frozen parameters of one unit share one dtype (the flat shard has one): a unit whose frozen
parameters come in several dtypes is refused at wrap time. Freezing or unfreezing a parameter after
wrapping is refused too (at the unit's next forward, user_params.py): its storage, its gradient path and the optimizer's
view of it were chosen when it was wrapped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardpar.collectives import Work
from shardpar.runtime.unit_comm import UnitComm
from shardpar.sharding.layout import FlatLayout, ParamSlice


class FrozenShard:
    """One unit's frozen parameters: their flat shard in their dtype, and its gathered buffer."""

    def __init__(
        self,
        name: str,
        params: list[nn.Parameter],
        layout: FlatLayout,
        comm: UnitComm,
        *,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"unit {name}: its frozen parameters come in several dtypes ({sorted(map(str, dtypes))}); "
                "shardpar keeps one flat shard of them per unit. Cast them to one dtype before wrapping"
            )
        self.params = params
        self.layout = layout
        self.comm = comm
        self.dtype = dtypes.pop()
        self.compute_dtype = compute_dtype
        self.device = device
        self.slices: tuple[ParamSlice, ...] = layout.slices(comm.shard_index)
        self.shard = torch.zeros(layout.shard_numel, dtype=self.dtype, device=device)
        self._compute: torch.Tensor | None = None  # only where the compute dtype differs
        self._gathered: torch.Tensor | None = None  # one storage for the unit's life, as the unit's own
        self._full: torch.Tensor | None = None
        self._work: Work | None = None

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    def take_shards(
        self, materialize: Callable[[nn.Parameter], torch.Tensor], empty: Callable[[], torch.Tensor]
    ) -> None:
        with torch.no_grad():
            for p, sl in zip(self.params, self.slices, strict=True):
                if sl.length:
                    full = materialize(p)
                    self.shard[sl.local].copy_(full.reshape(-1)[sl.param])
                    del full
                _set_data(p, empty())
        self.refresh_compute()

    def refresh_compute(self) -> None:
        """After the shard was written (a checkpoint or state-dict load)."""
        if self.compute_dtype == self.dtype:
            return
        if self._compute is None:
            self._compute = self.shard.to(self.compute_dtype)
        else:
            self._compute.copy_(self.shard)

    def compute_shard(self) -> torch.Tensor:
        return self.shard if self._compute is None else self._compute

    # ---- gather / free (driven by the unit: unit.py's unshard / wait_for_unshard / reshard) -------

    def start_gather(self) -> None:
        if self.layout.numel == 0:
            return
        if self.comm.sharding.size == 1:
            self._full = self.compute_shard()  # sdp 1: compute on views of the shard, as the unit does
            return
        buf = self._gathered
        nbytes = self.layout.padded_numel * torch.empty(0, dtype=self.compute_dtype).element_size()
        if buf is None:
            buf = self.comm.engine.alloc_buffer(self.layout.padded_numel, self.compute_dtype, self.device)
            self._gathered = buf
        elif buf.untyped_storage().nbytes() != nbytes:
            buf.untyped_storage().resize_(nbytes)
        self._work = self.comm.gather(buf, self.compute_shard(), async_op=True)
        self._full = buf

    def finish_gather(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._full is not None:
            for p, spec in zip(self.params, self.layout.specs, strict=True):
                p.data = self._full[spec.offset : spec.offset + spec.numel].view(spec.shape)

    def free(self, empty: Callable[[], torch.Tensor]) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        for p in self.params:
            p.data = empty()
        if self._full is not None and self._full is self._gathered:
            self._gathered.untyped_storage().resize_(0)  # [Note: gathered storage] in unit.py
        self._full = None

    # ---- full values (checkpoints, state dicts) ---------------------------------------------------

    def gather_values(self) -> torch.Tensor:
        """The full flat values, padded, in the parameters' dtype (one AllGather)."""
        full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.comm.engine.all_gather(full, self.shard, self.comm.sharding)
        return full

    def load_full(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for sl in self.slices:
                if sl.length and sl.spec.fqn in values:
                    self.shard[sl.local].copy_(values[sl.spec.fqn].reshape(-1)[sl.param])
            self.refresh_compute()
            if self._full is not None:
                self.finish_gather()
                for p, spec in zip(self.params, self.layout.specs, strict=True):
                    if spec.fqn in values:
                        p.data.copy_(values[spec.fqn].view(spec.shape))


def _set_data(p: nn.Parameter, data: torch.Tensor) -> None:
    if p.is_meta and not data.is_meta:
        torch.utils.swap_tensors(p, nn.Parameter(data, requires_grad=p.requires_grad))
    else:
        p.data = data
