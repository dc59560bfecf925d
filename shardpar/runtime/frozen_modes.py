"""What `sdp_frozen_base_mode` decides at wrap time (issue 33 item 2): whether "keep_gathered" fits,
the quantization error "int8" / "nf4" gives, and the refusal of bitsandbytes-quantized parameters.

[Note: keep_gathered fits]
Keeping every frozen unit gathered for a step costs, on every rank of the sharding group, the full
frozen base in the compute dtype for the whole step -- what sharding saves. It is used only where

    kept elements + the largest unit's gathered elements <= sdp_max_live_parameters
        (the user's cap on unsharded elements still holds with the kept units and one unit at work), and
    kept bytes <= half the memory available at wrap (CUDA: free device memory; CPU: MemAvailable)
        (the other half for activations, gradients and optimizer states, which the base does not know);

every rank must agree -- a rank that kept while another gathered would call a different number of
AllGathers and hang -- so the second rule is one AllReduce over the world. Otherwise the run falls
back to "gather", with a rank-0 warning naming the bytes and the rule. The kept memory stays in the
live count from a unit's first gather of a step to the step boundary (Unit._count_live), so prefetch
under the cap sees it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from shardpar.collectives import Engine, Group, ReduceOp
from shardpar.config import Config
from shardpar.runtime import frozen_quant
from shardpar.runtime.unit import Unit
from shardpar.topology import Topology

_LOG = logging.getLogger("shardpar")
_BNB_CLASSES = ("Params4bit", "Int8Params")


def refuse_bitsandbytes(module: nn.Module) -> None:
    """bitsandbytes' quantized parameters (`load_in_4bit` / `load_in_8bit`) hold their values in a
    quant_state that a flat shard and an AllGather of `.data` would lose (axolotl #2992): refused,
    naming the way to a quantized base that trains under sharding. Found by class name and module, so
    bitsandbytes need not be installed."""
    for name, p in module.named_parameters():
        cls = type(p)
        if cls.__name__ in _BNB_CLASSES or cls.__module__.split(".")[0] == "bitsandbytes":
            raise ValueError(
                f"parameter {name} is a bitsandbytes {cls.__name__} (a model loaded with load_in_4bit / "
                "load_in_8bit or a BitsAndBytesConfig): its quantization state does not survive sharding. "
                "Load the base unquantized (e.g. torch_dtype=torch.bfloat16) and set "
                "sdp_frozen_base_mode='nf4' (4-bit NormalFloat, QLoRA's code book) or 'int8': shardpar then "
                "stores and AllGathers the frozen base block-quantized itself"
            )


def settle_frozen_mode(
    units: list[Unit], config: Config, topology: Topology, engine: Engine, device: torch.device
) -> None:
    """At wrap, once the units hold their shards: keep_gathered only where it fits; the quantization
    error of int8 / nf4 in rank 0's log."""
    mode, rank = config.sdp_frozen_base_mode, topology.rank
    if mode == "keep_gathered":
        cap = config.sdp_max_live_parameters
        settle_keep_gathered(units, cap=cap, engine=engine, world=topology.group("world"), device=device, rank=rank)
    elif mode in frozen_quant.QUANTIZED and rank == 0:
        _LOG.info(quantization_summary(units, mode))


def settle_keep_gathered(
    units: list[Unit], *, cap: int, engine: Engine, world: Group, device: torch.device, rank: int
) -> bool:
    """Whether "keep_gathered" is used ([Note: keep_gathered fits]); on False every frozen shard is set
    back to "gather" and rank 0 says why."""
    shards = [u.frozen for u in units if u.frozen is not None]
    kept_bytes = sum(f.kept_bytes for f in shards)
    if kept_bytes == 0:
        return False  # sdp 1 or no frozen shard: nothing is gathered to keep
    kept_numel = sum(f.padded_numel for f in shards if f.keeps_gathered)
    largest = max(u.gathered_numel for u in units)
    available = _available_bytes(device)
    reason = ""
    if kept_numel + largest > cap:
        reason = (
            f"the frozen base kept gathered ({kept_numel:,} elements) plus the largest unit ({largest:,}) "
            f"exceed sdp_max_live_parameters={cap:,}"
        )
    too_big = torch.tensor([float(available is not None and kept_bytes > available / 2)], device=device)
    engine.all_reduce(too_big, world, op=ReduceOp.SUM)
    if not reason and too_big.item() > 0:
        where = f"{available / 2**20:,.0f} MiB here" if available is not None else "on another rank"
        reason = f"it needs {kept_bytes / 2**20:,.1f} MiB a rank, over half the memory available ({where})"
    if not reason:
        if rank == 0:
            _LOG.info(
                "sdp_frozen_base_mode='keep_gathered': %d frozen units stay gathered from their first use in a "
                "step to the optimizer step (%.1f MiB a rank)",
                len(shards),
                kept_bytes / 2**20,
            )
        return True
    for f in shards:
        f.mode = "gather"
    if rank == 0:
        _LOG.warning(
            "sdp_frozen_base_mode='keep_gathered' does not fit: %s; the frozen base is gathered per use "
            "('gather') instead. Raise sdp_max_live_parameters, use more memory, or set "
            "sdp_frozen_base_mode='int8' / 'nf4' to move fewer bytes",
            reason,
        )
    return False


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # unknown: only the live-cap rule applies


def quantization_summary(units: Iterable[Unit], mode: str) -> str:
    """The rank-0 log line of "int8" / "nf4": the relative error per tensor on this rank's shard."""
    errors = [e for u in units if u.frozen is not None for e in u.frozen.quantization_errors()]
    if not errors:
        return f"sdp_frozen_base_mode={mode!r}: no frozen parameter is sharded here; nothing is quantized"
    worst = max(errors, key=lambda e: e[1])
    means = [e[2] for e in errors]
    per_value = frozen_quant.packed_bytes(mode, frozen_quant.QBLOCK) / frozen_quant.QBLOCK
    return (
        f"sdp_frozen_base_mode={mode!r}: the frozen base is stored and AllGathered as {mode} in blocks of "
        f"{frozen_quant.QBLOCK} values with an fp32 absmax scale each ({per_value:.4g} bytes a value), "
        f"dequantized per use; relative error per tensor ({len(errors)} tensors, this rank's shard): "
        f"max |err|/max|w| up to {worst[1]:.2%} ({worst[0]}), mean |err|/mean|w| {sum(means) / len(means):.2%} "
        f"on average, up to {max(means):.2%}"
    )
