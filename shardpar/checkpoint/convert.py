"""`shardpar convert`: one process, no torch.distributed, no pickled code run. Between shardpar's partial
checkpoints, torch.distributed.checkpoint directories (dcp_files.py) and Hugging Face directories.

Every format goes through `State`: full tensors by FQN (the model) and, where the source has it, the
optimizer in torch's FQN-keyed form -- {"state": {fqn: {name: tensor}}, "param_groups": [{...,
"params": [fqn, ...]}]}, what torch.distributed.checkpoint.state_dict's get_optimizer_state_dict
gives. What each format holds:

    shardpar   <root>/<tag>_partial (index.json + safetensors) and <root>/newest: model, optimizer
               (its class name included), buffers; written as one rank's file (world 1), which any
               topology resumes
    dcp        {"model": ..., "optim": ...} as torch's get_state_dict gives them (FSDP2's recipe);
               a directory saved without those keys is all model
    hf         model.safetensors (or HF's sharded index): the model only

DCP and Hugging Face do not record which tensors are buffers, nor the optimizer's class: written as
shardpar, every model tensor is a parameter, and the class comes from `--optimizer-class`."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardpar.checkpoint import atomic, dcp_files, reshard
from shardpar.checkpoint import index as ix
from shardpar.checkpoint.placement import Cut
from shardpar.checkpoint.safetensors_io import CheckpointError, dtype_name, dtype_of, write_tensors

FORMATS = ("shardpar", "dcp", "hf")
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
STATE, GROUPS, PARAMS = "state", "param_groups", "params"


@dataclass
class State:
    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None = None
    optimizer_class: str | None = None
    buffers: set[str] = field(default_factory=set)  # model names that are buffers, where the source says


def detect(src: Path) -> str:
    if dcp_files.is_dcp(src):
        return "dcp"
    if (src / ix.INDEX_NAME).is_file() or (src / "newest").is_file():
        return "shardpar"
    if (src / HF_WEIGHTS).is_file() or (src / HF_INDEX).is_file():
        return "hf"
    raise ValueError(
        f"{src}: not a checkpoint convert knows -- a shardpar checkpoint directory (with `newest` or "
        f"index.json), a torch.distributed.checkpoint directory (with .metadata), or a Hugging Face directory "
        f"(with {HF_WEIGHTS} or {HF_INDEX})"
    )


def read(src: Path) -> State:
    kind = detect(src)
    return {"shardpar": read_shardpar, "dcp": read_dcp, "hf": read_hf}[kind](src)


# ---- shardpar ------------------------------------------------------------------------------------


def _partial_dir(src: Path) -> Path:
    if (src / ix.INDEX_NAME).is_file():
        return src
    return src / f"{atomic.read_pointer(src, 'newest')}{ix.PARTIAL_SUFFIX}"


def read_shardpar(src: Path) -> State:
    from shardpar.checkpoint import load_consolidated

    directory = _partial_dir(src)
    frozen = list(ix.read_index(directory).get("frozen", {}))
    if frozen:  # [Note: adapter-only checkpoints]: converted, it would be a model without its base
        raise CheckpointError(
            f"{directory}: an adapter-only partial checkpoint holds no values of its {len(frozen)} frozen "
            f"parameters (e.g. {frozen[0]!r}), only their checksums; convert a full checkpoint "
            "(smp.save_checkpoint(partial=False)) instead, or load the base from its own files"
        )
    model = dict(load_consolidated(directory.parent, directory.name[: -len(ix.PARTIAL_SUFFIX)]))
    index = ix.read_index(directory)
    out = State(model, buffers=set(index["buffers"]))
    saved = index.get("optimizer")
    if saved is None:
        return out
    reader = reshard.Reader(directory, index)
    try:
        state: dict[str, Any] = {}
        for fqn, meta in saved["state"].items():
            shape = tuple(int(d) for d in index["params"][fqn]["shape"])
            entry = {k: ix.decode(v) for k, v in meta["scalars"].items()}
            for name, dtype in meta["tensors"].items():
                flat = reader.read(f"optim/{name}", fqn, Cut(shape), 0, 0, math.prod(shape), dtype_of(dtype))
                entry[name] = flat.view(shape)
            state[fqn] = entry
    finally:
        reader.close()
    groups = [{**ix.decode(g["options"]), PARAMS: list(g["params"])} for g in saved["param_groups"]]
    out.optim, out.optimizer_class = {STATE: state, GROUPS: groups}, saved["class"]
    return out


def write_shardpar(state: State, dst: Path, tag: str) -> Path:
    """One rank's partial checkpoint (world 1, sdp 1) under `dst`, published as partial.py does."""
    atomic.check_tag(tag)
    if state.optim is not None and not state.optimizer_class:
        raise ValueError(
            "the source holds optimizer state but not the optimizer's class, which shardpar's checkpoint "
            "records (a resume checks it): pass --optimizer-class with the torch.optim class the job uses, "
            "e.g. --optimizer-class AdamW"
        )
    tmp = atomic.make_tmp_dir(dst, tag)
    checkpoint_id = tmp.checkpoint_id
    try:
        tensors: dict[str, torch.Tensor] = {}
        params: dict[str, Any] = {}
        buffers: dict[str, Any] = {}
        file = ix.shard_file(0)
        opt_state = (state.optim or {}).get(STATE, {})
        meta: dict[str, Any] = {}
        for name, value in state.model.items():
            value = value.detach().contiguous()
            if name in state.buffers:
                tensors[ix.buffer_key(name)] = value
                buffers[name] = {"file": file, "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
                continue
            tensors[ix.param_key(name)] = value.reshape(-1)
            params[name] = {
                "shape": list(value.shape),
                "dtype": dtype_name(value.dtype),
                "pieces": [[file, 0, value.numel(), 0]],
            }
            entry = opt_state.get(name)
            if entry is None:
                continue
            per_element = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and v.shape == value.shape}
            scalars = {
                k: ix.encode(v, where=f"optimizer state {k!r} of {name!r}")
                for k, v in entry.items()
                if k not in per_element
            }
            for k, v in per_element.items():
                tensors[ix.state_key(k, name)] = v.detach().contiguous().reshape(-1)
            meta[name] = {"tensors": {k: dtype_name(v.dtype) for k, v in per_element.items()}, "scalars": scalars}
        unknown = sorted(set(opt_state) - set(params))
        if unknown:
            raise ValueError(f"optimizer state for {unknown[:3]}, which are not model parameters in the source")
        written = write_tensors(tmp.path / file, tensors, {"checkpoint_id": checkpoint_id, "format": "pt"})
        optimizer = None
        if state.optim is not None:
            groups = [
                {
                    PARAMS: list(g[PARAMS]),
                    "options": ix.encode({k: v for k, v in g.items() if k != PARAMS}, where="optimizer param group"),
                }
                for g in state.optim[GROUPS]
            ]
            optimizer = {"class": state.optimizer_class, "param_groups": groups, "state": meta}
        steps = [float(e["step"]) for e in opt_state.values() if isinstance(e.get("step"), (int, float, torch.Tensor))]
        index = {
            "format": ix.FORMAT,
            "version": ix.VERSION,
            "tag": tag,
            "checkpoint_id": checkpoint_id,
            "saved_at_ns": 0,
            "step": int(max(steps)) if steps else None,
            "num_backward": 0,
            "topology": {"world": 1, "tp": 1, "sdp": 1, "ranks_per_node": 1},
            "files": {
                file: {
                    "bytes": written.bytes,
                    "tensors": {k: [dtype_name(t.dtype), list(t.shape)] for k, t in tensors.items()},
                    "checksums": written.checksums,
                }
            },
            "params": params,
            "buffers": buffers,
            "optimizer": optimizer,
            "loss_scaler": None,
            "rng": None,  # no RNG state to restore: a converted checkpoint leaves each rank's RNG as it is
            "user_content": None,
        }
        ix.check_index(index, f"{dst}/{tag}{ix.PARTIAL_SUFFIX}")
        atomic.write_json(tmp.path / ix.INDEX_NAME, index)
        final = dst / f"{tag}{ix.PARTIAL_SUFFIX}"
        atomic.publish_dir(tmp.path, final)
        atomic.write_text_atomic(dst / "newest", tag)
        return final
    except BaseException:
        if tmp.path.exists():
            atomic.remove_dir(tmp.path)
        raise
    finally:
        tmp.release()


# ---- torch.distributed.checkpoint ----------------------------------------------------------------


def read_dcp(src: Path, model_key: str = "model", optim_keys: tuple[str, ...] = ("optim", "optimizer")) -> State:
    nested = dcp_files.read(src)
    if model_key not in nested:  # saved as a bare model state dict
        return State({k: v for k, v in nested.items() if isinstance(v, torch.Tensor)})
    optim = next((nested[k] for k in optim_keys if k in nested), None)
    if optim is not None and (STATE not in optim or GROUPS not in optim):
        raise ValueError(
            f"{src}: the optimizer entry has keys {sorted(optim)[:4]}, not torch's {STATE!r} and {GROUPS!r}; "
            "save it with get_optimizer_state_dict (flatten_optimizer_state_dict=False)"
        )
    return State(dict(nested[model_key]), optim)


def write_dcp(state: State, dst: Path) -> Path:
    sd: dict[str, Any] = {"model": dict(state.model)}
    if state.optim is not None:
        sd["optim"] = state.optim
    dcp_files.write(dst, sd)
    return dst


# ---- Hugging Face --------------------------------------------------------------------------------


def read_hf(src: Path) -> State:
    from safetensors.torch import load_file

    if (src / HF_INDEX).is_file():
        files = sorted(set(json.loads((src / HF_INDEX).read_text())["weight_map"].values()))
    else:
        files = [HF_WEIGHTS]
    model: dict[str, torch.Tensor] = {}
    for name in files:
        model.update(load_file(str(src / name)))
    return State(model)


def write_hf(state: State, dst: Path) -> Path:
    """model.safetensors with the model's tensors (HF has no place for optimizer state)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / f".tmp-{uuid.uuid4().hex[:8]}-{HF_WEIGHTS}"
    save_file({k: v.detach().contiguous() for k, v in state.model.items()}, str(tmp), metadata={"format": "pt"})
    tmp.rename(dst / HF_WEIGHTS)
    return dst
