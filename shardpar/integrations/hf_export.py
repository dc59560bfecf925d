"""The full Hugging Face weights of a DistributedModel, written into a directory as `save_pretrained`
lays them out, through shardpar's own full export (`smp.save_checkpoint(partial=False)`): one unit
gathered at a time, rank 0 writes. `save_pretrained` on a sharded model would write the parameters as
they are outside forward (issue 20).

The export publishes `<directory>/<tag>/` atomically and points `<directory>/newest_full` at it; here
it is staged under a private tag and its files are then moved up into `<directory>` itself, so that
`from_pretrained(directory)` loads them and a directory that holds other things (a Trainer's
`output_dir` with its checkpoints) keeps them.

    <directory>/
        config.json, generation_config.json
        model.safetensors  (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
        shardpar_full.json  shardpar's manifest: sizes and checksums of the files above
"""

from __future__ import annotations

import os
from pathlib import Path

import shardpar as smp
from shardpar.runtime.model import DistributedModel

STAGING_TAG = "shardpar-hf-export"
_WEIGHT_FILES = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")


def save_full_weights(
    model: DistributedModel, directory: str | os.PathLike[str], *, max_shard_size: int | None = None
) -> Path:
    """Write `model`'s full weights (fp32) and HF config into `directory` (created if missing).

    A collective: every rank calls it; rank 0 writes. Weight files of an earlier save in the same
    directory are replaced, as `save_pretrained` replaces them."""
    root = Path(directory)
    smp.save_checkpoint(root, tag=STAGING_TAG, partial=False, model=model, max_shard_size=max_shard_size)
    if smp.rank() == 0:
        staged = root / STAGING_TAG
        for pattern in _WEIGHT_FILES:  # a previous save with more shards would leave files the index omits
            for old in root.glob(pattern):
                old.unlink()
        for item in staged.iterdir():
            os.replace(item, root / item.name)
        staged.rmdir()
        pointer = root / "newest_full"
        if pointer.is_file() and pointer.read_text().strip() == STAGING_TAG:
            pointer.unlink()
    smp.barrier()  # the files are in place before any rank reads or removes the directory
    return root
