"""save_checkpoint / resume_from_checkpoint (SageMaker model-parallel v1 semantics), resharding on load,
atomic writes, Hugging Face export. See docs/checkpoints.md.

    <path>/
        newest              tag of the newest partial checkpoint (moved last, atomically)
        newest_full         tag of the newest full checkpoint
        <tag>_partial/      partial=True: index.json + safetensors pieces (index.py)
        <tag>/              partial=False: a Hugging Face model directory (full.py)
        .tmp-<tag>-<id>/    a save in progress (locked), or one that crashed (removed by the next save or
                            resume: [Note: stale temporary entries] in atomic.py)

The facade (`smp.save_checkpoint`, `smp.resume_from_checkpoint`) passes the model, optimizer,
topology and engine of `smp.init()`; these functions take them explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import async_save as _async
from shardpar.checkpoint import atomic
from shardpar.checkpoint import full as _full
from shardpar.checkpoint import full_load as _full_load
from shardpar.checkpoint import index as ix
from shardpar.checkpoint import partial as _partial
from shardpar.checkpoint import reshard as _reshard
from shardpar.checkpoint import snapshot_load as _snapshot_load
from shardpar.checkpoint.atomic import Coordinator
from shardpar.checkpoint.safetensors_io import CheckpointError, check_file, verify_share
from shardpar.collectives import Engine
from shardpar.optim.optimizer import DistributedOptimizer
from shardpar.runtime.model import DistributedModel
from shardpar.tensor_parallel.comm import TPComm
from shardpar.topology import Topology

__all__ = ["CheckpointError", "load_consolidated", "resume_from_checkpoint", "save_checkpoint"]

PathLike = str | os.PathLike[str]


def save_checkpoint(
    path: PathLike,
    tag: str,
    *,
    model: DistributedModel,
    optimizer: DistributedOptimizer | None = None,
    topology: Topology,
    engine: Engine,
    partial: bool = True,
    user_content: Any = None,
    translate_if_full: bool = True,
    num_kept_partial_checkpoints: int | None = None,
    max_shard_size: int | None = None,
    full_dtype: torch.dtype | None = None,
    async_save: bool = False,
) -> Path:
    """Save under `path` (a collective: every rank calls it); the finished checkpoint directory.

    partial=True: every shard once (replica 0 writes; with shard_optimizer_state each rank its own
    piece), optimizer state, loss scaler, RNG and
    `user_content` (JSON, tuples, tensors; rank 0's value), resumable under any topology; keeps the
    `num_kept_partial_checkpoints` newest partial checkpoints when set; TP-split parameters are stored
    in full-parameter coordinates, so any tensor-parallel degree resumes them. partial=False: the
    consolidated model as a Hugging Face directory, in the original layout under tensor parallelism
    (config.json when `translate_if_full` and the model is a PreTrainedModel); `max_shard_size`
    (bytes) splits it into HF's sharded layout and `full_dtype` casts it (default fp32). Nothing is
    visible under the final name until every rank finished; a crash leaves the previous checkpoint
    and the `newest` pointer untouched.

    async_save=True (partial only): stage this rank's tensors in host memory and return while a
    background thread writes; the commit (index, rename, `newest`, pruning) happens at the next save,
    resume, `async_save.poll()` or `async_save.finish()` ([Note: async checkpoint commit]). Any save
    first commits the previous async one.
    """
    atomic.check_tag(tag)
    if async_save and not partial:
        raise ValueError(
            "save_checkpoint(partial=False, async_save=True): the Hugging Face export is written synchronously; "
            "pass async_save=False with partial=False (async_save applies to partial checkpoints)"
        )
    if partial:
        model.window.check_save(
            "save_checkpoint(partial=True)", "are not saved (a resume would step on the rest alone); save"
        )
    if full_dtype is not None and not (isinstance(full_dtype, torch.dtype) and full_dtype.is_floating_point):
        raise ValueError(
            f"full_dtype={full_dtype!r} must be a floating-point torch.dtype (e.g. torch.bfloat16, "
            "torch.float16 or None for float32): the export would cast the weights to it"
        )
    if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
        raise ValueError(
            f"num_kept_partial_checkpoints={num_kept_partial_checkpoints} must be >= 1 (or None: keep all)"
        )
    if max_shard_size is not None and max_shard_size < 1:
        raise ValueError(f"max_shard_size={max_shard_size} must be a positive number of bytes (or None: one file)")
    _async.finish()  # the previous async save's write and commit, on every rank at this same call
    root, coord = Path(path), Coordinator(topology, engine)
    held: list[atomic.TmpDir] = []  # rank 0: the temporary directory, locked while this save is in flight

    def prepare() -> tuple[str, str, Any]:
        content = ix.encode(user_content, where="user_content")  # before any file exists
        held.append(atomic.make_tmp_dir(root, tag))
        return str(held[0].path), held[0].checkpoint_id, content

    try:
        tmp, checkpoint_id, content = coord.on_root("save_checkpoint: preparing", prepare)
        try:
            if async_save:
                job = _partial.SaveJob(
                    root, tag, Path(tmp), checkpoint_id, content, model, optimizer, num_kept_partial_checkpoints
                )
                final = _async.start(coord, job, list(held))
                held.clear()  # the pending save releases the lock after its commit
                return final
            if partial:
                return _save_partial(
                    coord, root, tag, Path(tmp), checkpoint_id, content, model, optimizer, num_kept_partial_checkpoints
                )
            export = (translate_if_full, max_shard_size, full_dtype)
            return _save_full(coord, root, tag, Path(tmp), checkpoint_id, content, model, *export)
        except BaseException:
            if coord.is_root and Path(tmp).exists():
                atomic.remove_dir(Path(tmp))
            raise
    finally:
        for t in held:  # after the directory was published or removed: never swept while in flight
            t.release()


def _save_partial(
    coord: Coordinator,
    root: Path,
    tag: str,
    tmp: Path,
    checkpoint_id: str,
    content: Any,
    model: DistributedModel,
    optimizer: DistributedOptimizer | None,
    num_kept: int | None,
) -> Path:
    job = _partial.SaveJob(root, tag, tmp, checkpoint_id, content, model, optimizer, num_kept)
    job.reports = coord.gather(
        "save_checkpoint: writing shards", lambda: _partial.write_rank_file(tmp, checkpoint_id, model, optimizer)
    )
    return Path(coord.on_root("save_checkpoint: committing", job.commit))


def _save_full(
    coord: Coordinator,
    root: Path,
    tag: str,
    tmp: Path,
    checkpoint_id: str,
    content: Any,
    model: DistributedModel,
    translate: bool,
    max_shard_size: int | None,
    dtype: torch.dtype | None,
) -> Path:
    items = _full.plan_items(model, dtype)
    files = _full.split_files(items, max_shard_size)
    sink = _full.Sink(tmp, files, {"format": "pt", "checkpoint_id": checkpoint_id}) if coord.is_root else None

    coords = model.topology.coords
    # The TP group of rank 0 (rdp rank 0) rebuilds the TP-split parameters for rank 0 to write.
    tp = (
        TPComm(model.engine, model.topology.tp, coords.tp_rank)
        if model.topology.plan.tp > 1 and coords.rdp_rank == 0
        else None
    )

    # Replica 0 holds the full values, except when only the replicas together do (shard_optimizer_state
    # under bf16/fp16: [Note: replica-sharded main]); every replica then joins the gathers.
    every_replica = model.sharded_state.gathers_over_replicas

    def stream() -> None:
        if coords.replica == 0 or every_replica:
            _full.stream_units(model, items, sink, tp)
        if sink is not None:
            sink.finish()

    coord.gather("save_checkpoint(partial=False): writing", stream)

    def commit() -> str:
        if sink is None:
            raise AssertionError("commit runs on rank 0")
        sink.finish()
        if len(files) > 1:
            atomic.write_json(tmp / _full.HF_INDEX, _full.hf_index(files))
        if translate:
            _full.write_hf_config(model.module, tmp, dtype or torch.float32)
        atomic.write_json(tmp / _full.MANIFEST, _full.manifest(tag, checkpoint_id, sink, content, model))
        final = root / tag
        atomic.publish_dir(tmp, final)
        atomic.write_text_atomic(root / "newest_full", tag)
        return str(final)

    return Path(coord.on_root("save_checkpoint(partial=False): committing", commit))


def resume_from_checkpoint(
    path: PathLike,
    tag: str | None = None,
    *,
    model: DistributedModel,
    optimizer: DistributedOptimizer | None = None,
    topology: Topology,
    engine: Engine,
    partial: bool = True,
    strict: bool = True,
    load_optimizer: bool = True,
    snapshot_dir: Path | None = None,
    missing_ok: bool = False,
) -> Any:
    """Load a checkpoint into the (already built) model and optimizer; returns its user_content.

    `snapshot_dir` (partial, tag None, strict, with the optimizer): the node's in-memory snapshots of this
    job are considered too, and the newest complete state wins ([Note: choosing a snapshot]). `missing_ok`
    (partial, tag None): None when there is nothing to resume (no complete snapshot, no `newest`).

    tag None reads the `newest` pointer (`newest_full` with partial=False). Every file this rank
    needs is checked against the index first (present, complete, same checkpoint, same tensors) and
    the ranks agree before anything is loaded: a bad checkpoint raises CheckpointError naming the
    file and the problem on every rank, leaving model and optimizer untouched. Any (world, tp, sdp)
    resumes any partial checkpoint (see placement.py). The RNG state is restored when the world size
    and the tensor-parallel degree are unchanged. A full checkpoint restores the model only.
    """
    # The resumed run then starts a window of its own (backward_passes_per_step and micro-batches may
    # differ from the saving run's): a partial save is taken at a window's end and a full one saves no
    # gradients, so the saved backward count is not restored.
    if tag is not None:
        atomic.check_tag(tag)  # as save does: "../x" would read outside `path`
    _async.finish()  # an async save in flight is committed (or fails) before anything is read
    model.window.check_save("resume_from_checkpoint", "would be added to the loaded model's first step; resume")
    root, coord = Path(path), Coordinator(topology, engine)
    # A re-save that crashed between its two renames is undone first ([Note: re-saving a tag]), and
    # what crashed saves left is removed ([Note: stale temporary entries]).
    coord.on_root("resume_from_checkpoint: recovering", lambda: atomic.sweep(root))
    if partial and tag is None and snapshot_dir is not None and strict and load_optimizer:
        loaded, content = _snapshot_load.try_resume(root, snapshot_dir, model, optimizer, coord)
        if loaded:
            return content
    newest = partial and tag is None and missing_ok
    if newest and not coord.on_root("resume_from_checkpoint: newest", lambda: (root / "newest").is_file()):
        _snapshot_load.last.clear()
        _snapshot_load.last.update(source=None, description=f"nothing to resume under {root}")
        return None
    if partial:
        job: _reshard.LoadJob | None = None

        def check() -> Any:
            nonlocal job
            name = tag if tag is not None else atomic.read_pointer(root, "newest")
            job = _reshard.LoadJob(
                root / f"{name}{ix.PARTIAL_SUFFIX}", model, optimizer, strict, load_optimizer, world=topology.plan.world
            )
            return job.check()

        hashes = coord.gather("resume_from_checkpoint", check)
        if job is None:
            raise AssertionError("checked load job missing")
        job.verify_base(hashes)  # the same reports on every rank: all refuse a different base, or none
        content = job.apply()
        _snapshot_load.last.clear()
        _snapshot_load.last.update(
            source="disk", tag=job.directory.name, description=f"disk checkpoint {job.directory}"
        )
        return content
    load: _full_load.FullLoad | None = None

    def check_full() -> None:
        nonlocal load
        name = tag if tag is not None else atomic.read_pointer(root, "newest_full")
        load = _full_load.FullLoad.check(root / name, model, strict)

    coord.gather("resume_from_checkpoint(partial=False)", check_full)
    if load is None:
        raise AssertionError("checked full load missing")
    return load.apply()


def load_consolidated(path: PathLike, tag: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Offline, one process: (name, full tensor) of every parameter and buffer of a partial checkpoint.

    The conversion ZeRO-3 users run by hand, needed here only to leave shardpar: `dict(...)` of it
    is the unwrapped model's state_dict (tied parameters under their first name) -- without the frozen
    parameters of an adapter-only checkpoint, which it records by checksum only; TP-split
    parameters come back in the original (Hugging Face) layout, whatever tensor parallelism saved them.
    """
    if tag is not None:
        atomic.check_tag(tag)
    root = Path(path)
    atomic.recover(root)
    name = tag if tag is not None else atomic.read_pointer(root, "newest")
    directory = root / f"{name}{ix.PARTIAL_SUFFIX}"
    index = ix.read_index(directory)
    for file in sorted(index["files"]):
        check_file(
            directory / file,
            label=f"{directory}/{file}",
            expect_bytes=int(index["files"][file]["bytes"]),
            expect_tensors=ix.file_expectations(index, file),
            expect_metadata={"checkpoint_id": index["checkpoint_id"]},
        )
    consolidated = ix.recorded_checksums(index, lambda key: key.startswith(("param/", "buffer/")))
    verify_share(directory, consolidated, rank=0, world=1)
    return _reshard.consolidated(directory)
