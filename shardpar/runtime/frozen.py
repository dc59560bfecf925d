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

How the frozen shard is gathered is `sdp_frozen_base_mode` (issue 33 item 2):
    "gather"         (default) AllGathered per use, freed with the unit, as above;
    "keep_gathered"  the first gather of a step stays for the step: `free` keeps the buffer's memory
                     and the next `start_gather` points the parameters at it again, with no
                     collective; `release_kept` (the optimizer step, a load) frees it. At sdp > 1 only
                     (at sdp 1 nothing is gathered), and only where frozen_modes.py found it fits;
    "int8" / "nf4"   the shard is kept block-quantized (frozen_quant.py, [Note: quantized frozen
                     base]) and its exact values dropped ([Note: quantized base keeps no exact shard],
                     frozen_exact.py); what is AllGathered is the quantized bytes, dequantized into the
                     gathered compute-dtype buffer at each use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from shardpar.collectives import Work
from shardpar.runtime import frozen_exact, frozen_quant
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
        mode: str = "gather",
        warned: set[str] | None = None,
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
        # Each parameter's piece of the shard, made now: a view of a storage resized to 0 (int8 / nf4
        # drop the values) stays valid, but a new one cannot be made then.
        self.piece_views = {sl.spec.fqn: self.shard[sl.local] for sl in self.slices}
        self._compute: torch.Tensor | None = None  # only where the compute dtype differs
        self._gathered: torch.Tensor | None = None  # one storage for the unit's life, as the unit's own
        self._full: torch.Tensor | None = None
        self._work: Work | None = None
        self.mode = mode
        self.quantized = mode in frozen_quant.QUANTIZED
        # sdp > 1: whether a gather lands in the compute-dtype buffer itself ([Note: dequantizing in place])
        self._gathers_in_place = self.quantized and frozen_quant.fits_in_place(mode, layout.shard_numel, compute_dtype)
        self._packed: torch.Tensor | None = None  # int8 / nf4: this rank's shard, quantized
        self._packed_rows: torch.Tensor | None = None  # what the running gather brings (or the own shard)
        self._qgathered: torch.Tensor | None = None  # sdp > 1, a shard of a few blocks: its gathered bytes
        self._kept = False  # keep_gathered: `_gathered` holds this step's gathered values
        # int8 / nf4 ([Note: quantized base keeps no exact shard]): whether `shard` has storage (the exact
        # values until quantized, or values given back by `hold_values`), its version counter when it
        # was given back, each piece's CRC-32 of the exact values, and the quantization error per piece
        self._held = True
        self._held_version = -1
        self.exact_crcs: dict[str, int] = {}
        self._errors: list[tuple[str, float, float]] = []
        self._warned = set() if warned is None else warned  # shared by a model's shards: one warning
        self.counted_live = False  # in the live count (the unit's _count_live)

    @property
    def keeps_gathered(self) -> bool:
        return self.mode == "keep_gathered" and self.comm.sharding.size > 1

    @property
    def viewed_by_params(self) -> bool:
        """Whether the module's parameters view `shard` itself while gathered (sdp 1, computing in the
        shard's dtype): a write through their `.data` then reaches the shard unseen by its version counter.
        Otherwise they view a gathered or compute copy and only code holding `shard` writes it (with
        `copy_`, which the version counter sees): [Note: fingerprint cache] in checkpoint/fingerprint.py."""
        return self.comm.sharding.size == 1 and not self.quantized and self.compute_dtype == self.dtype

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
        """After an optimizer step or after the shard was written (a checkpoint or state-dict load)."""
        self.release_kept()  # the step boundary ends a kept gather; a load changes the values
        if self.quantized:
            self._settle_quantized()
            return
        if self.compute_dtype == self.dtype:
            return
        if self._compute is None:
            self._compute = self.shard.to(self.compute_dtype)
        else:
            self._compute.copy_(self.shard)

    def _settle_quantized(self) -> None:
        """int8 / nf4: quantize what the shard holds where it is new (wrap) or was written (a load), then
        drop its values ([Note: quantized base keeps no exact shard]). A frozen shard does not change at
        a step, and quantizing costs a pass over it, so a shard read since changes nothing."""
        if not self._held:
            return
        pieces = [sl for sl in self.slices if sl.length]
        if self._packed is None:  # wrap: the exact base the user loaded
            self.exact_crcs = {sl.spec.fqn: frozen_exact.piece_crc(self.shard[sl.local]) for sl in pieces}
            self._quantize()
        elif self.shard._version != self._held_version:  # written since its values were given back
            approx = frozen_quant.dequantize(self._packed, self.mode, self.layout.shard_numel, self.dtype)
            changed = [sl for sl in pieces if not torch.equal(self.shard[sl.local], approx[sl.local])]
            for sl in changed:
                self.exact_crcs[sl.spec.fqn] = frozen_exact.piece_crc(self.shard[sl.local])
            if changed:
                self._quantize()
        self.shard.untyped_storage().resize_(0)
        self._held = False

    def _quantize(self) -> None:
        self._packed = frozen_quant.quantize(self.shard, self.mode)
        approx = frozen_quant.dequantize(self._packed, self.mode, self.layout.shard_numel, torch.float32)
        self._errors = [
            (sl.spec.fqn, *frozen_quant.relative_errors(self.shard[sl.local], approx[sl.local]))
            for sl in self.slices
            if sl.length
        ]

    def hold_values(self) -> None:
        """int8 / nf4: give `shard` its storage back, filled with the dequantized values, for a reader or a
        load, until the next refresh_compute; nothing in the other modes, whose shard is always there."""
        if self._held:
            return
        if self._packed is None:
            raise AssertionError("a quantized frozen shard dropped its values before it was quantized")
        self.shard.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
        with torch.no_grad():
            frozen_quant.dequantize_into(self.shard, self._packed.view(1, -1), self.mode, self.layout.shard_numel)
        self._held = True
        self._held_version = self.shard._version

    def read_values(self) -> None:
        """`hold_values` for a reader outside training (a state dict, a full checkpoint, a parameter
        read): under int8 / nf4 it gets the dequantized base, and is told so once (a model, rank 0)."""
        if not self._held:
            frozen_exact.warn_dequantized_read(self.mode, self._warned)
        self.hold_values()

    def release_read(self) -> None:
        """int8 / nf4: drop values `read_values` gave back, where nothing wrote them (nothing to quantize)."""
        if self.quantized and self._held and self._packed is not None and self.shard._version == self._held_version:
            self.shard.untyped_storage().resize_(0)
            self._held = False

    @contextlib.contextmanager
    def values_read(self) -> Iterator[None]:
        """`read_values` for the block: values given back for it are dropped again after it (on an
        exception too); a shard that already held its values keeps them."""
        given = not self._held
        self.read_values()
        try:
            yield
        finally:
            if given:
                self.release_read()

    @property
    def holds_values(self) -> bool:
        """Whether `shard` has its values now (always, but under int8 / nf4 between a read and a refresh)."""
        return self._held

    @property
    def stored_bytes(self) -> int:
        """Bytes this rank keeps for the shard between uses: its values (not under int8 / nf4, once
        quantized), a compute-dtype copy, the codes."""
        held = [self.shard if self._held else None, self._compute, self._packed]
        return sum(t.untyped_storage().nbytes() for t in held if t is not None)

    def compute_shard(self) -> torch.Tensor:
        return self.shard if self._compute is None else self._compute

    # ---- gather / free (driven by the unit: unit.py's unshard / wait_for_unshard / reshard) -------

    def start_gather(self) -> None:
        if self.layout.numel == 0:
            return
        if self._kept:  # keep_gathered: this step's gathered values are still there
            self._full = self._gathered
            return
        if self.quantized:
            self._start_quantized_gather()
            return
        if self.comm.sharding.size == 1:
            self._full = self.compute_shard()  # sdp 1: compute on views of the shard, as the unit does
            return
        buf = self._fill_gathered()
        self._work = self.comm.gather(buf, self.compute_shard(), async_op=True)
        self._full = buf

    def _fill_gathered(self) -> torch.Tensor:
        """The compute-dtype gathered buffer with its storage allocated ([Note: gathered storage], unit.py)."""
        buf = self._gathered
        nbytes = self.layout.padded_numel * torch.empty(0, dtype=self.compute_dtype).element_size()
        if buf is None:
            buf = self.comm.engine.alloc_buffer(self.layout.padded_numel, self.compute_dtype, self.device)
            self._gathered = buf
        elif buf.untyped_storage().nbytes() != nbytes:
            buf.untyped_storage().resize_(nbytes)
        return buf

    def _start_quantized_gather(self) -> None:
        """AllGather the quantized shards (a flat gather over the sharding group, uint8: the codes and
        the scales in one call); finish_gather dequantizes them into the compute-dtype buffer."""
        if self._packed is None:
            raise AssertionError("a quantized frozen shard is gathered before it was quantized")
        size = self.comm.sharding.size
        full = self._fill_gathered()
        if size == 1:
            self._packed_rows = self._packed.view(1, -1)
        elif self._gathers_in_place:
            rows = full.view(torch.uint8)[: size * self._packed.numel()]
            self._work = self.comm.engine.all_gather(rows, self._packed, self.comm.sharding, async_op=True)
            self._packed_rows = rows.view(size, -1)
        else:  # a shard of a few blocks: its packed bytes outgrow its values
            numel = size * self._packed.numel()
            buf = self._qgathered
            if buf is None:
                buf = self.comm.engine.alloc_buffer(numel, torch.uint8, self.device)
                self._qgathered = buf
            elif buf.untyped_storage().nbytes() != numel:
                buf.untyped_storage().resize_(numel)
            self._work = self.comm.engine.all_gather(buf, self._packed, self.comm.sharding, async_op=True)
            self._packed_rows = buf.view(size, -1)
        self._full = full

    def finish_gather(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._packed_rows is not None and self._full is not None:
            frozen_quant.dequantize_into(self._full, self._packed_rows, self.mode, self.layout.shard_numel)
            self._packed_rows = None
            if self._qgathered is not None:
                self._qgathered.untyped_storage().resize_(0)  # only the dequantized values stay
        if self.keeps_gathered and self._full is not None:
            self._kept = True
        if self._full is not None:
            for p, spec in zip(self.params, self.layout.specs, strict=True):
                p.data = self._full[spec.offset : spec.offset + spec.numel].view(spec.shape)

    def free(self, empty: Callable[[], torch.Tensor]) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        for p in self.params:
            p.data = empty()
        if self._full is not None and self._full is self._gathered and not self._kept:
            self._gathered.untyped_storage().resize_(0)  # [Note: gathered storage] in unit.py
        if self._qgathered is not None:
            self._qgathered.untyped_storage().resize_(0)  # a gather freed before finish_gather dequantized it
        self._full = None
        self._packed_rows = None

    def release_kept(self) -> None:
        """keep_gathered: end the step's kept gather; its memory goes now, or when the unit is freed."""
        if not self._kept:
            return
        self._kept = False
        if self._full is None and self._gathered is not None:
            self._gathered.untyped_storage().resize_(0)

    @property
    def holds_memory(self) -> bool:
        """Whether the gathered values are alive: in use, or kept for the step."""
        return self._full is not None or self._kept

    @property
    def kept_bytes(self) -> int:
        """Bytes keep_gathered holds for this shard between its uses in a step."""
        if not self.keeps_gathered:
            return 0
        return self.layout.padded_numel * torch.empty(0, dtype=self.compute_dtype).element_size()

    def quantization_errors(self) -> list[tuple[str, float, float]]:
        """(name, max, mean relative error) of each frozen tensor's piece in this rank's shard, as
        compute sees it after dequantization ([Note: quantized frozen base]): measured when the exact
        values were quantized (at wrap, or at a load), as they are dropped then."""
        return list(self._errors)

    # ---- full values (checkpoints, state dicts) ---------------------------------------------------

    def gather_values(self) -> torch.Tensor:
        """The full flat values, padded, in the parameters' dtype (one AllGather); under int8 / nf4 the
        dequantized ones, given back for the gather only (a warning, once)."""
        full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with self.values_read():
            self.comm.engine.all_gather(full, self.shard, self.comm.sharding)
        return full

    def load_full(self, values: dict[str, torch.Tensor]) -> None:
        self.hold_values()  # int8 / nf4: pieces not in `values` keep their (dequantized) values
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
