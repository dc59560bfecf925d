"""What a quantized frozen shard keeps of the exact base it dropped: the CRC-32 of each exact piece (for
the adapter-only checkpoint's fingerprint), and the one-time warning of a read of its values.

[Note: quantized base keeps no exact shard]
Under `sdp_frozen_base_mode` "int8" / "nf4" a unit's frozen shard is quantized at wrap time (its codes
and scales, frozen_quant.py) and its exact values are then dropped: the storage of `FrozenShard.shard`
is resized to 0 (the tensor object and its views stay, as a gathered buffer's do), so a rank keeps 1.06
(int8) or 0.56 (nf4) bytes a frozen value instead of 2 (bf16) + the codes -- QLoRA's and MixZ++'s point.
What still needs the exact base is handled here:

  * the fingerprint of an adapter-only checkpoint (checkpoint/fingerprint.py) is of the base the user
    LOADED: before dropping, each rank hashes its exact pieces (`piece_crc`: float32 bytes, CRC-32,
    exactly as fingerprint.py hashes a held piece) and keeps the checksums (4 bytes a tensor piece).
    A save records them; a resume compares them with the checkpoint's. A resume that loads the same
    base and wraps with int8 / nf4 again hashes the same exact values (so it verifies) and quantizes
    them to the same codes (so it computes exactly as the saving run); a base saved under "gather"
    and resumed under "int8" (or the other way) verifies too: the checksums are of exact values in
    every mode;
  * the values of the frozen base seen from outside -- `state_dict()`, a full checkpoint
    (partial=False) or export, `local_state_dict()`, reading a frozen user parameter -- can only be
    the dequantized ones: they are what the forward computes with, so the saved model is the one that
    was trained (the adapters fit the quantized base), and quantizing them again gives the same codes
    (absmax scaling: a block's absmax is one of its dequantized values, each code rounds back to
    itself), so a full checkpoint of an int8 / nf4 run resumes bit for bit under the same mode. We
    return them rather than raise -- generic callers (HF Trainer's save, accelerate's get_state_dict,
    torch DCP) have no knob to pass -- with a WARNING, once a model, naming the knob and the way to
    the exact base (QLoRA with bitsandbytes does the same: its state dict holds the quantized base).
    Adapter-only saves (partial checkpoints, PEFT's save_pretrained) read no base value and say nothing;
  * reading gives the shard its storage back, filled with the dequantized values, until the next
    optimizer step or load (`FrozenShard.refresh_compute`), which drops it again. A load writes exact
    values into it: at that refresh each piece that differs from its dequantized values gets its
    checksum taken again, and the shard is quantized again (pieces equal to their dequantized values,
    as a full checkpoint of this run gives back, keep their checksum and codes: the model is the same).

The small frozen 1-D tensors (under sdp_param_persistence_threshold: biases, layer norms) are not in
the frozen shard under int8 / nf4: they persist whole and unquantized, as in QLoRA (model_build.py's
split_persistent), so their values, state dict entries and checksums are exact as in every mode. A small
frozen matrix goes into the quantized shard like a large one.
"""

from __future__ import annotations

import logging
import zlib

import torch

_LOG = logging.getLogger("shardpar")
_CHUNK = 1 << 22  # elements converted to float32 at a time: 16 MiB of temporary, not a shard's worth


def piece_crc(values: torch.Tensor) -> int:
    """CRC-32 (zlib's, from 0) of the values as float32 bytes in element order (integers as they are):
    what checkpoint/fingerprint.py records for a frozen piece ([Note: adapter-only checkpoints])."""
    flat, value = values.detach().reshape(-1), 0
    for lo in range(0, flat.numel(), _CHUNK):
        part = flat[lo : lo + _CHUNK]
        # Always a copy: .numpy() of the live storage would make it non-resizable for good (torch
        # 2.13), and a quantized base's shard (fp32 too) is resized to 0 once hashed.
        part = part.to("cpu", torch.float32 if part.is_floating_point() else part.dtype, copy=True)
        value = zlib.crc32(part.view(torch.uint8).numpy().data, value)
    return value


def warn_dequantized_read(mode: str, warned: set[str]) -> None:
    """Once a model (`warned` is the model's): the frozen base's values read from outside are dequantized."""
    if mode in warned:
        return
    warned.add(mode)
    _LOG.warning(
        "sdp_frozen_base_mode=%r stores the frozen base quantized, without its exact values: this state dict, "
        "full checkpoint or parameter read gives the %s-dequantized base (what the model computes with), not "
        "the base you loaded. To save a fine-tune, save the adapters only (smp.save_checkpoint with "
        "partial=True, PEFT's save_pretrained), which record the loaded base by its checksums; to keep and "
        "save the exact base, set sdp_frozen_base_mode='gather'",
        mode,
        mode,
    )
