"""Cases for test_checkpoint.py, run on every rank of a pool (importable for spawn).

Training recipe shared by every case: UnevenMLP, AdamW with two param groups, a LambdaLR schedule,
clipping, and a fixed *global* batch of 4 per step that each rank slices by its rdp rank -- so any
world / sdp trains the same model and a resumed run can be compared with a straight one.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar import checkpoint as ckpt
from tests import models
from tests.multiproc.parity import ADAM, _param_groups

SHARD = {"sdp_param_persistence_threshold": 10, "sdp_gradient_clipping": 0.05}
GLOBAL_BATCH = 4


# ---- training ------------------------------------------------------------------------------------


def _build(sdp: int, seed: int = 0, **knobs: Any) -> tuple[Any, Any, Any]:
    smp.init({**SHARD, "sharded_data_parallel_degree": sdp, **knobs})
    return _make(seed)


def _make(seed: int, scaler: dict[str, Any] | None = None, **mlp: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    module = models.UnevenMLP(**mlp)
    module.register_buffer("marker", torch.arange(3.0) + seed)  # a persistent buffer, seed-dependent
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(_adamw(_param_groups(model)), **(scaler or {}))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _adamw(params: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=ADAM["lr"], eps=ADAM["eps"])


def _train(model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    """Steps of the global batch; the loss of each step averaged over the rdp group."""
    r, n = smp.rdp_rank(), smp.rdp_size()
    per = GLOBAL_BATCH // n
    losses = []
    for step in steps:
        batch = models.mlp_batch(1000 + step, GLOBAL_BATCH)
        batch["x"] = batch["x"].to(model.policy.compute)  # a no-op in fp32
        loss = model(**{k: v[r * per : (r + 1) * per] for k, v in batch.items()})
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(sum(smp.allgather(loss.item(), smp.CommGroup.RDP_GROUP)) / n)
    return losses


def _save(root: str, tag: str, model: Any, opt: Any, **kw: Any) -> Path:
    return ckpt.save_checkpoint(
        root, tag, model=model, optimizer=opt, topology=smp.get_topology(), engine=smp.get_engine(), **kw
    )


def _resume(root: str, tag: str | None, model: Any, opt: Any, **kw: Any) -> Any:
    return ckpt.resume_from_checkpoint(
        root, tag, model=model, optimizer=opt, topology=smp.get_topology(), engine=smp.get_engine(), **kw
    )


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _adam_moments(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Full exp_avg / exp_avg_sq of every parameter, assembled from every rank's pieces (test-side)."""
    from shardpar.checkpoint.pieces import slots

    mine = []
    for s in slots(model):
        state = opt.optimizer.state.get(opt._main_piece[id(s.param)], {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state and s.length:
                mine.append((f"{s.fqn}:{k}", s.start, state[k].reshape(-1).clone(), s.param_shape))
    full: dict[str, torch.Tensor] = {}
    for pieces in smp.allgather(mine):
        for key, start, values, shape in pieces:
            t = full.setdefault(key, torch.zeros(shape).reshape(-1))
            t[start : start + values.numel()] = values
    return full


# ---- resharding ----------------------------------------------------------------------------------


def save_midway_case(root: str) -> dict[str, Any]:
    """World 4 / sdp 2: 3 steps, save, 3 more steps (the straight run)."""
    model, opt, sched = _build(sdp=2)
    first = _train(model, opt, sched, range(3))
    at_save = _full_state(model)
    moments = _adam_moments(model, opt)
    out = _save(root, "step3", model, opt, user_content={"step": 3, "scheduler": sched.state_dict()})
    rest = _train(model, opt, sched, range(3, 6))
    final = _full_state(model)
    if smp.rank() != 0:
        return {}
    files = {p.name: p.stat().st_size for p in out.iterdir()}
    return {
        "first": first,
        "losses": rest,
        "final": final,
        "at_save": at_save,
        "moments": moments,
        "files": files,
        "dir": str(out),
    }


def resume_case(root: str, sdp: int) -> dict[str, Any]:
    """Build from another seed, resume the newest checkpoint, train steps 3..5."""
    model, opt, sched = _build(sdp=sdp, seed=123)
    content = _resume(root, None, model, opt)
    sched.load_state_dict(content["scheduler"])
    moments = _adam_moments(model, opt)
    resumed = _full_state(model)
    losses = _train(model, opt, sched, range(3, 6))
    return {
        "step": content["step"],
        "losses": losses,
        "final": _full_state(model),
        "resumed": resumed,
        "moments": moments,
        "sdp_size": smp.sdp_size(),
    }


# ---- Hugging Face export -------------------------------------------------------------------------


def _train_lm(model: Any, opt: Any, steps: int) -> None:
    r, n = smp.rdp_rank(), smp.rdp_size()
    for step in range(steps):
        batch = models.lm_batch(step, 2 * n)
        model.backward(model(**{k: v[2 * r : 2 * r + 2] for k, v in batch.items()}).loss)
        opt.step()
        opt.zero_grad()


def hf_export_case(root: str, name: str, max_shard_size: int | None) -> dict[str, Any]:
    """Train a tiny HF model (world 2 / sdp 2), export it, load it with from_pretrained on rank 0."""
    from transformers import AutoModelForCausalLM

    build = {"gpt2_tied": models.tiny_gpt2_tied, "neox": models.tiny_neox}[name]
    smp.init({**SHARD, "sharded_data_parallel_degree": 2})
    model = smp.DistributedModel(build())
    opt = smp.DistributedOptimizer(_adamw(model.parameters()))
    _train_lm(model, opt, 2)
    stats = smp.comm_stats()
    stats.begin_step()
    smp.save_checkpoint(
        root, name, partial=False, model=model, optimizer=opt, user_content={"m": name}, max_shard_size=max_shard_size
    )
    out = Path(root) / name
    gathers = [(r.op, r.group, r.bytes) for r in stats.begin_step()]
    unit_bytes = [u.layout.padded_numel * 4 for u in model.units if u.layout.numel]
    model.eval()
    prompt = models.lm_batch(7, 2)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    trained = _full_state(model)
    result: dict[str, Any] = {"gathers": gathers, "unit_bytes": unit_bytes}
    if smp.rank() == 0:
        loaded: Any = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        hf, info = loaded
        with torch.no_grad():
            result["logits"] = (hf.eval()(input_ids=prompt).logits - logits).abs().max().item()
        result["info"] = {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()}
        result["files"] = sorted(p.name for p in out.iterdir())
        hf.save_pretrained(Path(root) / "plain")  # a directory shardpar did not write (no manifest)
    result.update(_load_by_alias(build, trained))
    # ... and back into a differently initialised shardpar model (partial=False resume).
    fresh_model = smp.DistributedModel(_reseeded(build))
    content = _resume(root, None, fresh_model, None, partial=False)
    again = _full_state(fresh_model)
    result["reload"] = max((again[k] - trained[k]).abs().max().item() for k in trained)
    result["content"] = content
    plain_model = smp.DistributedModel(_reseeded(build))
    _resume(root, "plain", plain_model, None, partial=False)
    again = _full_state(plain_model)
    result["plain_reload"] = max((again[k] - trained[k]).abs().max().item() for k in trained)
    # partial round trip of the same model (tied weights keyed by their first name)
    _save(root, name, model, opt)
    fresh_model = smp.DistributedModel(_reseeded(build))
    fresh_opt = smp.DistributedOptimizer(_adamw(fresh_model.parameters()))
    _resume(root, name, fresh_model, fresh_opt)
    again = _full_state(fresh_model)
    result["partial_reload"] = max((again[k] - trained[k]).abs().max().item() for k in trained)
    result["moments"] = _max_moment_diff(_adam_moments(model, opt), _adam_moments(fresh_model, fresh_opt))
    # the facade passes full_dtype through (last: this export becomes `newest_full`)
    smp.save_checkpoint(root, f"{name}_bf16", partial=False, model=model, full_dtype=torch.bfloat16)
    result["bf16_dtypes"] = _export_dtypes(Path(root) / f"{name}_bf16") if smp.rank() == 0 else None
    return result


def _load_by_alias(build: Any, trained: dict[str, torch.Tensor]) -> dict[str, Any]:
    """load_state_dict of a dict naming each tied weight by its last name only (strict), then one with
    a typo'd key: torch calls that unexpected, so strict refuses it on every rank."""
    model = smp.DistributedModel(_reseeded(build))
    names: dict[int, list[str]] = {}
    for name, p in model.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    dropped = sorted(n for aliases in names.values() if len(aliases) > 1 for n in aliases[:-1])
    model.load_state_dict({k: v for k, v in trained.items() if k not in dropped}, strict=True)
    again = _full_state(model)
    try:
        model.load_state_dict({**trained, "transformer.h.0.mlp.c_fcc.weight": torch.zeros(3)}, strict=True)
        typo = "no error"
    except ValueError as e:
        typo = str(e)
    return {
        "alias_dropped": dropped,
        "alias_load": max((again[k] - trained[k]).abs().max().item() for k in trained),
        "typo": typo,
    }


def _export_dtypes(directory: Path) -> list[str]:
    """The distinct tensor dtypes of a Hugging Face export's safetensors files."""
    from safetensors.torch import load_file

    return sorted({str(t.dtype) for f in directory.glob("*.safetensors") for t in load_file(f).values()})


def _max_moment_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _reseeded(build: Any) -> nn.Module:
    module = build()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
    return module


# ---- validation errors ---------------------------------------------------------------------------


def _damage(root: Path, source: str, tag: str, how: Any) -> None:
    """Rank 0 copies checkpoint `source` to `tag` and damages the copy; everyone waits for it."""
    if smp.rank() == 0:
        shutil.copytree(root / f"{source}_partial", root / f"{tag}_partial")
        how(root / f"{tag}_partial")
    smp.barrier()


def _truncate(d: Path) -> None:
    f = d / "shard-00001.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def _flip_payload(path: Path, prefix: str) -> None:
    """Invert 64 bytes inside the largest tensor named `prefix...` of `path`; the header stays as it was."""
    import json
    import struct

    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    sizes = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k.startswith(prefix)}
    key = max(sizes, key=lambda k: sizes[k])
    begin, end = header[key]["data_offsets"]
    at = 8 + n + (begin + end) // 2 - 32
    data[at : at + 64] = bytes(b ^ 0xFF for b in data[at : at + 64])
    path.write_bytes(data)


def _drop_piece(d: Path) -> None:
    import json

    index = json.loads((d / "index.json").read_text())
    fqn = next(f for f, e in index["params"].items() if len(e["pieces"]) == 2)
    index["params"][fqn]["pieces"].pop()
    (d / "index.json").write_text(json.dumps(index))


def errors_case(root_s: str) -> dict[str, Any]:
    """World 2 / sdp 2: every damaged copy raises CheckpointError on every rank and loads nothing."""
    root = Path(root_s)
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(1))
    _save(root_s, "good", model, opt)
    good = _full_state(model)
    _train(model, opt, sched, range(1, 2))
    _save(root_s, "other", model, opt)
    damages = {
        "truncated": _truncate,
        "missing": lambda d: (d / "shard-00001.safetensors").unlink(),
        "foreign": lambda d: shutil.copy(root / "other_partial" / "shard-00001.safetensors", d),
        "piece": _drop_piece,
        "index": lambda d: (d / "index.json").write_text('{"format": "shardpar.partial", "vers'),
        "corrupt": lambda d: _flip_payload(d / "shard-00001.safetensors", "param/"),
    }
    for tag, how in damages.items():
        _damage(root, "good", tag, how)
    before = _full_state(model)
    moments_before = _adam_moments(model, opt)
    errors: dict[str, str] = {}
    for tag in [*damages, "nonexistent"]:
        try:
            _resume(root_s, tag, model, opt)
            errors[tag] = "no error"
        except ckpt.CheckpointError as e:
            errors[tag] = str(e)
    # A model that does not match (one block fewer): clear error, strict=False loads what fits.
    model2, opt2, _ = _make(0, depth=2)
    try:
        _resume(root_s, "good", model2, opt2)
        errors["misfit"] = "no error"
    except ckpt.CheckpointError as e:
        errors["misfit"] = str(e)
    # A persistent buffer of another shape (the checkpoint's marker has 3 elements): refused before
    # anything is written, under strict=False too (copy_ broadcast a smaller buffer, or failed
    # after the parameters were written).
    model3, opt3, _ = _make(7)
    model3.module.marker = torch.zeros(4)
    before3 = _full_state(model3)
    try:
        _resume(root_s, "good", model3, opt3, strict=False)
        errors["buffer"] = "no error"
    except ckpt.CheckpointError as e:
        errors["buffer"] = str(e)
    smp.save_checkpoint(root_s, "goodfull", partial=False, model=model)  # the same, from a full export
    try:
        _resume(root_s, "goodfull", model3, None, partial=False, strict=False)
        errors["buffer_full"] = "no error"
    except ckpt.CheckpointError as e:
        errors["buffer_full"] = str(e)
    buffer_unchanged = all(torch.equal(v, before3[k]) for k, v in _full_state(model3).items())
    # The full export with 64 bytes of one tensor's data flipped: refused on every rank, `model` untouched.
    if smp.rank() == 0:
        shutil.copytree(root / "goodfull", root / "badfull")
        _flip_payload(root / "badfull" / "model.safetensors", "blocks.")
    smp.barrier()
    try:
        _resume(root_s, "badfull", model, None, partial=False)
        errors["corrupt_full"] = "no error"
    except ckpt.CheckpointError as e:
        errors["corrupt_full"] = str(e)
    # The checkpoint's persistent buffer `marker` is not in this model: strict refuses, like a parameter.
    torch.manual_seed(7)
    model4 = smp.DistributedModel(models.UnevenMLP())
    opt4 = smp.DistributedOptimizer(_adamw(_param_groups(model4)))
    before4 = _full_state(model4)
    try:
        _resume(root_s, "good", model4, opt4)
        errors["extra_buffer"] = "no error"
    except ckpt.CheckpointError as e:
        errors["extra_buffer"] = str(e)
    buffer_unchanged = buffer_unchanged and all(torch.equal(v, before4[k]) for k, v in _full_state(model4).items())
    fresh = _full_state(model2)
    loose = _resume(root_s, "good", model2, opt2, strict=False, load_optimizer=False)
    # What fits (same name, same shape) now holds the saved values, the rest kept its own.
    fit = {k: v for k, v in _full_state(model2).items() if k in good and good[k].shape == v.shape}
    loose_fit = max((v - good[k]).abs().max().item() for k, v in fit.items())
    loose_changed = sorted(k for k in fit if not torch.equal(fresh[k], good[k]))
    loose_optimizer_empty = not _adam_moments(model2, opt2)
    after = _full_state(model)
    unchanged = max((after[k] - before[k]).abs().max().item() for k in before)
    moments_after = _adam_moments(model, opt)
    moments_unchanged = max((moments_after[k] - moments_before[k]).abs().max().item() for k in moments_before)
    return {
        "errors": errors,
        "unchanged": unchanged,
        "moments_unchanged": moments_unchanged,
        "loose": loose,
        "loose_fit": loose_fit,
        "loose_loaded": loose_changed,
        "loose_skipped": sorted(k for k in fresh if k not in fit),
        "loose_optimizer_empty": loose_optimizer_empty,
        "buffer_unchanged": buffer_unchanged,
    }


# ---- pointers and pruning ------------------------------------------------------------------------


def keep_and_newest_case(root: str) -> dict[str, Any]:
    from shardpar.optim.loss_scaling import DynamicLossScaler

    model, opt, _sched = _build(sdp=2, fp16=True)  # a dynamic scaler's state resumes only into fp16
    saved_scaler = DynamicLossScaler(init_scale=1024.0, scale_window=5)
    saved_scaler.update(True)  # an overflow: scale 512, cur_iter 1
    opt.loss_scaler = saved_scaler
    for i in range(1, 5):
        _save(
            root, f"t{i}", model, opt, user_content={"tag": f"t{i}", "pair": (i, 2.5)}, num_kept_partial_checkpoints=2
        )
    _save(root, "t4", model, opt, user_content={"tag": "t4-again", "pair": (4, 2.5)}, num_kept_partial_checkpoints=2)
    listing = sorted(p.name for p in Path(root).iterdir())
    opt.loss_scaler = DynamicLossScaler(init_scale=1024.0, scale_window=5)
    content = _resume(root, None, model, opt)
    scaler = {"restored": opt.loss_scaler.state_dict(), "saved": saved_scaler.state_dict(), "model": model.loss_scale}
    errors = {}
    for bad in ("", "a/b", ".hidden", "newest"):
        try:
            _save(root, bad, model, opt)
        except ValueError as e:
            errors[bad] = str(e)
    try:
        _save(root, "t5", model, opt, user_content={"f": lambda: 0})
    except TypeError as e:
        errors["content"] = str(e)
    model.backward_passes_per_step = 2  # one backward of a window of two: its gradients exist nowhere on disk
    batch = models.mlp_batch(5, 2)
    model.backward(model(x=batch["x"].to(model.policy.compute), y=batch["y"]))
    try:
        _save(root, "t6", model, opt)
    except ValueError as e:
        errors["mid_window"] = str(e)
    listing_after = sorted(p.name for p in Path(root).iterdir())
    return {
        "listing": listing,
        "content": content,
        "errors": errors,
        "listing_after": listing_after,
        "scaler": scaler,
        "newest": (Path(root) / "newest").read_text(),
    }


def window_change_case(root: str) -> dict[str, Any]:
    """Saved after 3 one-backward steps, resumed with backward_passes_per_step=2 (the usual way to keep
    the global batch on fewer ranks): the resumed run starts a window of its own."""
    model, opt, sched = _build(sdp=1)  # world 2: two replicas
    _train(model, opt, sched, range(3))
    _save(root, "w", model, opt)
    errors: dict[str, str] = {}
    try:
        _save(root, "w_full", model, opt, partial=False, full_dtype=torch.int8)
    except ValueError as e:
        errors["full_dtype"] = str(e)
    model.backward_passes_per_step = 2
    _resume(root, "w", model, opt)
    r, n = smp.rdp_rank(), smp.rdp_size()
    batch = models.mlp_batch(2000, 2 * n)
    for half in (0, 1):
        rows = slice(half * n + r, half * n + r + 1)
        model.backward(model(**{k: v[rows] for k, v in batch.items()}))
        if half == 0:
            try:
                _resume(root, "w", model, opt)
            except ValueError as e:
                errors["resume_mid_window"] = str(e)
    opt.step()  # raised "after 1 of the 2 backward passes" when the saved backward count (3) was restored
    flat = torch.cat([v.reshape(-1) for v in model.state_dict().values()])
    replicas = smp.allgather(flat)
    return {"errors": errors, "replicas_differ": max((t - replicas[0]).abs().max().item() for t in replicas)}


# ---- crash during a save -------------------------------------------------------------------------


def crash_good_case(root: str) -> dict[str, Any]:
    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(2))
    _save(root, "good", model, opt, user_content={"tag": "good"})
    rng = torch.rand(3)  # what a run continuing from the save draws (RNG restored: same world)
    state = _full_state(model)
    state.update({f"moment:{k}": v for k, v in _adam_moments(model, opt).items()})
    return {"state": state, "rng": rng}


def crash_during_save_case(root: str) -> None:
    """Rank 1 dies (SIGKILL) half-way through writing its file of tag 'bad'."""
    import shardpar.checkpoint.partial as partial_mod

    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(3))
    real = partial_mod.write_tensors

    def write_then_die(path: Path, tensors: Any, metadata: Any) -> Any:
        written = real(path, tensors, metadata)
        if smp.rank() == 1:
            with open(path, "r+b") as f:
                f.truncate(written.bytes // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    partial_mod.write_tensors = write_then_die
    _save(root, "bad", model, opt, user_content={"tag": "bad"})


def crash_between_renames_case(root: str) -> None:
    """Rank 0 dies (SIGKILL) while re-saving tag 'good': after moving the old directory aside, before
    renaming the new one into place ([Note: re-saving a tag] in shardpar/checkpoint/atomic.py)."""
    from shardpar.checkpoint import atomic

    model, opt, sched = _build(sdp=2)
    _train(model, opt, sched, range(3))
    real = atomic.os.rename

    def rename_then_die(src: Any, dst: Any) -> None:
        real(src, dst)
        if Path(src).name == "good_partial":
            os.kill(os.getpid(), signal.SIGKILL)

    atomic.os.rename = rename_then_die  # type: ignore[assignment]  # this process dies in it
    _save(root, "good", model, opt, user_content={"tag": "good, re-saved"})


def resume_after_crash_case(root: str, facade: bool = False) -> dict[str, Any]:
    model, opt, _sched = _build(sdp=2, seed=7)
    content = smp.resume_from_checkpoint(root) if facade else _resume(root, None, model, opt)
    rng = torch.rand(3)
    state = _full_state(model)
    state.update({f"moment:{k}": v for k, v in _adam_moments(model, opt).items()})
    before = sorted(p.name for p in Path(root).iterdir())
    smp.barrier()  # every rank has listed before rank 0 starts the next save's temporary directory
    _save(root, "after", model, opt)
    after = sorted(p.name for p in Path(root).iterdir())
    return {"content": content, "state": state, "rng": rng, "listing_before": before, "listing_after": after}


# ---- loss scaler across precisions ---------------------------------------------------------------

FP16_SAVED = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**12}}
FP16_DYNAMIC = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2.0**10, "scale_window": 1000}}


def _resume_in(root: str, tag: str, precision: dict[str, Any], scaler: dict[str, Any]) -> dict[str, Any]:
    """Build a fresh model (another seed) under `precision`, resume `tag`, train one step."""
    import warnings

    smp.init({**SHARD, "sharded_data_parallel_degree": 2, **precision})
    try:
        model, opt, sched = _make(123, scaler)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _resume(root, tag, model, opt)
        out = {
            "state": _full_state(model),
            "scale": opt.loss_scaler.loss_scale,
            "model_scale": model.loss_scale,  # what model.backward multiplies the loss by
            "scaler": opt.loss_scaler.state_dict(),
            "warnings": [str(w.message) for w in caught if "loss-scaler" in str(w.message)],
        }
        out["losses"] = _train(model, opt, sched, range(2, 3))
        return out
    finally:
        smp.shutdown()


def _saved_in(root: str, tag: str, precision: dict[str, Any], scaler: dict[str, Any]) -> dict[str, Any]:
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, **precision})
    try:
        model, opt, sched = _make(0, scaler)
        _train(model, opt, sched, range(2))
        _save(root, tag, model, opt)
        return {"state": _full_state(model), "scaler": opt.loss_scaler.state_dict()}
    finally:
        smp.shutdown()


def _drop_cur_iter(d: Path) -> None:
    import json

    index = json.loads((d / "index.json").read_text())
    del index["loss_scaler"]["cur_iter"]
    (d / "index.json").write_text(json.dumps(index))


def scaler_across_precisions_case(root_s: str) -> dict[str, Any]:
    """Save in fp32 and in fp16 (dynamic), resume each under another precision; a malformed scaler
    state fails the resume check and loads nothing."""
    saved = {
        "fp32": _saved_in(root_s, "fp32", {}, {}),
        "fp16": _saved_in(root_s, "fp16", {"fp16": True}, FP16_SAVED),
    }
    resumed = {
        "fp32_to_fp16": _resume_in(root_s, "fp32", {"fp16": True}, FP16_DYNAMIC),
        "fp16_to_bf16": _resume_in(root_s, "fp16", {"bf16": True}, {}),
        "fp16_to_fp16": _resume_in(root_s, "fp16", {"fp16": True}, FP16_DYNAMIC),
    }
    smp.init({**SHARD, "sharded_data_parallel_degree": 2})  # for _damage's barrier
    _damage(Path(root_s), "fp16", "bad_scaler", _drop_cur_iter)
    smp.shutdown()
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "fp16": True})
    model, opt, _ = _make(123, FP16_DYNAMIC)
    before, error = _full_state(model), "no error"
    try:
        _resume(root_s, "bad_scaler", model, opt)
    except ckpt.CheckpointError as e:
        error = str(e)
    after = _full_state(model)
    return {
        "saved": saved,
        "resumed": resumed,
        "malformed": error,
        "malformed_unchanged": max((after[k] - before[k]).abs().max().item() for k in before),
    }


def export_fails_on_rank_0_case(root: str) -> dict[str, Any]:
    """Rank 0's cast of the second exported tensor raises, in the middle of the unit AllGathers. Before,
    rank 0 left them for the error agreement while rank 1 waited in the next unit's AllGather until
    the timeout, and the real error was lost. The collective timeout is an hour, far past the test's
    bound on the case: a rank that waited for it is reported hung, with no clock read here."""
    import shardpar.checkpoint.full as full_mod

    model, _, _ = _build(2, collective_timeout_s=3600)
    real = full_mod._original
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("test: the cast failed")
        return real(*args, **kwargs)

    if smp.rank() == 0:
        full_mod._original = failing  # type: ignore[assignment]
    try:
        smp.save_checkpoint(root, "export", partial=False, model=model)
        error = "no error"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        full_mod._original = real  # type: ignore[assignment]
    return {"error": error, "published": (Path(root) / "export").exists()}
