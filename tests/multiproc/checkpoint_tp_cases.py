"""Cases for test_checkpoint_tp.py: checkpoints of tensor-parallel models (run on every rank of a pool).

Recipe: tiny GPT-NeoX and tiny Llama (GQA, biases) from tp_cases, AdamW with two param groups, a
LambdaLR schedule, clipping, and a fixed *global* batch of 4 rows per step that every TP group cuts
by its rdp rank (prescaled batch) -- so every (world, tp, sdp) trains the same model. Persistence
threshold 40 makes the column-parallel biases persistent under tp 2 (22-24 local elements) but
sharded under tp 1 (44-48), so a resume across tp also crosses persistent <-> sharded.

Values are compared in the Hugging Face layout: parameters through `gather_full_state_dict`, Adam
moments assembled from every rank's pieces (sharding group, flat local coordinates) and then
gathered over TP the same way -- independently of the checkpoint's placement arithmetic.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

import shardpar as smp
from shardpar import checkpoint as ckpt
from shardpar.api.data import rdp_slice
from shardpar.checkpoint.pieces import slots
from shardpar.tensor_parallel import TPComm, gather_full_state_dict, tp_split_table
from tests import models
from tests.multiproc.parity import ADAM, _param_groups
from tests.multiproc.tp_cases import BUILDERS, VOCAB

GLOBAL_BATCH = 4
SAVE_AT = 3
STEPS = 6
NAMES = ("neox", "llama")


def _knobs(tp: int, sdp: int) -> dict[str, Any]:
    knobs: dict[str, Any] = {
        "tensor_parallel_degree": tp,
        "sharded_data_parallel_degree": sdp,
        "sdp_param_persistence_threshold": 40,
        "sdp_gradient_clipping": 0.05,
    }
    return {**knobs, "prescaled_batch": True} if tp > 1 else knobs


def _build(name: str, tp: int, sdp: int, seed: int) -> tuple[Any, Any, Any]:
    smp.init(_knobs(tp, sdp))
    model = smp.DistributedModel(BUILDERS[name](seed), tensor_parallelism=tp > 1)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(name: str, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = models.lm_batch(1000 + step, GLOBAL_BATCH, vocab=VOCAB[name])
        loss = model(**rdp_slice(batch)).loss
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(sum(smp.allgather(loss.item(), smp.CommGroup.RDP_GROUP)) / smp.rdp_size())
    return losses


def _save(root: str, tag: str, model: Any, opt: Any, **kw: Any) -> Path:
    return ckpt.save_checkpoint(
        root, tag, model=model, optimizer=opt, topology=smp.get_topology(), engine=smp.get_engine(), **kw
    )


def _resume(root: str, tag: str | None, model: Any, opt: Any, **kw: Any) -> Any:
    return ckpt.resume_from_checkpoint(
        root, tag, model=model, optimizer=opt, topology=smp.get_topology(), engine=smp.get_engine(), **kw
    )


def _to_hf(model: Any, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This TP rank's tensors (full over the sharding group) -> the Hugging Face layout (a TP collective)."""
    if smp.tp_size() == 1:
        return dict(local)
    comm = TPComm(smp.get_engine(), smp.get_topology().tp, smp.tp_rank())
    return gather_full_state_dict(dict(sorted(local.items())), tp_split_table(model.module), comm)


def hf_params(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}  # full, in the HF layout at any tp


def hf_moments(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """exp_avg / exp_avg_sq of every parameter in the Hugging Face layout (keys `<fqn>:<name>`)."""
    mine = []
    for s in slots(model):
        state = opt.optimizer.state.get(opt.main_piece(s.param), {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in state and s.length:
                mine.append((smp.tp_rank(), s.fqn, k, s.start, state[k].reshape(-1).clone(), s.param_shape))
    local: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for pieces in smp.allgather(mine):
        for tp_rank, fqn, k, start, values, shape in pieces:
            if tp_rank == smp.tp_rank():  # this TP rank's local tensors, from its sharding group's pieces
                full = local[k].setdefault(fqn, torch.full(shape, float("nan")))
                full.view(-1)[start : start + len(values)] = values
    out = {}
    for k, part in local.items():
        out.update({f"{fqn}:{k}": v for fqn, v in _to_hf(model, part).items()})
    return out


def _stats_of(model: Any, opt: Any) -> dict[str, Any]:
    return {"params": hf_params(model), "moments": hf_moments(model, opt)}


# ---- straight run, partial save, HF export ------------------------------------------------------


def straight_case(root: str, name: str) -> dict[str, Any]:
    """World 4 (tp 2 x sdp 2): 3 steps, save `<name>-step3`, 3 more steps, then a full export."""
    try:
        model, opt, sched = _build(name, tp=2, sdp=2, seed=0)
        first = _train(name, model, opt, sched, range(SAVE_AT))
        at_save = _stats_of(model, opt)
        out = _save(root, f"{name}-step3", model, opt, user_content={"step": SAVE_AT, "scheduler": sched.state_dict()})
        rest = _train(name, model, opt, sched, range(SAVE_AT, STEPS))
        result = {"first": first, "losses": rest, "at_save": at_save, "final": _stats_of(model, opt)}
        result["files"] = sorted(p.name for p in out.iterdir())
        result["index"] = json.loads((out / "index.json").read_text()) if smp.rank() == 0 else None
        result["export"] = _export(root, name, model)
        return result
    finally:
        smp.shutdown()


def _export(root: str, name: str, model: Any) -> dict[str, Any]:
    """Full export (streamed), loaded by from_pretrained on rank 0 and back into a TP model."""
    from transformers import AutoModelForCausalLM

    stats = smp.comm_stats()
    stats.begin_step()
    out = _save(root, f"{name}-hf", model, None, partial=False)
    gathers = [(r.op, r.group, r.bytes) for r in stats.begin_step()]
    units = [u.layout.padded_numel * 4 for u in model.units if u.layout.numel]
    persistent = model.persistent.main.numel() * 4
    prompt = models.lm_batch(7, 2, vocab=VOCAB[name])["input_ids"]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=prompt).logits
    model.train()
    result: dict[str, Any] = {"gathers": gathers, "units": units, "persistent": persistent}
    if smp.rank() == 0:
        hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        with torch.no_grad():
            result["logits"] = (hf.eval()(input_ids=prompt).logits - logits).abs().max().item()
        result["info"] = {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()}
        result["files"] = sorted(p.name for p in out.iterdir())
    trained = hf_params(model)
    fresh = smp.DistributedModel(BUILDERS[name](123), tensor_parallelism=True)
    _resume(root, f"{name}-hf", fresh, None, partial=False)
    again = hf_params(fresh)
    result["reload"] = max((again[k] - trained[k]).abs().max().item() for k in trained)
    return result


# ---- resumes under other topologies -------------------------------------------------------------


def resume_case(root: str, name: str, tp: int, sdp: int, tag: str, save_as: str | None) -> dict[str, Any]:
    """Build from another seed at (tp, sdp), resume `tag`, (save it again as `save_as`), train steps 3..5."""
    try:
        model, opt, sched = _build(name, tp=tp, sdp=sdp, seed=123)
        content = _resume(root, tag, model, opt)
        sched.load_state_dict(content["scheduler"])
        resumed = _stats_of(model, opt)
        if save_as is not None:
            _save(root, save_as, model, opt, user_content=content)
        losses = _train(name, model, opt, sched, range(SAVE_AT, STEPS))
        return {"step": content["step"], "resumed": resumed, "losses": losses, "final": _stats_of(model, opt)}
    finally:
        smp.shutdown()


def run_many(calls: list[tuple[str, tuple[Any, ...]]]) -> list[dict[str, Any]]:
    """Several cases in one pool call: (function name, arguments)."""
    return [globals()[fn](*args) for fn, args in calls]


# ---- errors -------------------------------------------------------------------------------------


def _drop_tp_rank_1(d: Path, fqn: str) -> None:
    index = json.loads((d / "index.json").read_text())
    index["params"][fqn]["pieces"] = [p for p in index["params"][fqn]["pieces"] if p[3] != 1]
    (d / "index.json").write_text(json.dumps(index))


def _wider_neox() -> Any:
    """tiny_neox with intermediate_size 64 instead of 48: the same FQNs, other MLP shapes."""
    from transformers import GPTNeoXForCausalLM

    cfg = models.tiny_neox().config
    cfg.intermediate_size = 64
    return GPTNeoXForCausalLM(cfg)


def errors_case(root_s: str, fqn: str) -> dict[str, Any]:
    """World 2 (tp 2): a checkpoint missing TP rank 1's pieces of `fqn`, and a model of another shape,
    raise CheckpointError on every rank and load nothing."""
    root = Path(root_s)
    try:
        model, opt, _ = _build("neox", tp=2, sdp=1, seed=5)
        if smp.rank() == 0:
            shutil.copytree(root / "neox-step3_partial", root / "holed_partial")
            _drop_tp_rank_1(root / "holed_partial", fqn)
        smp.barrier()
        before = _stats_of(model, opt)
        errors = {}
        try:
            _resume(root_s, "holed", model, opt)
            errors["holed"] = "no error"
        except ckpt.CheckpointError as e:
            errors["holed"] = str(e)
        after = _stats_of(model, opt)
        smp.shutdown()
        smp.init(_knobs(tp=2, sdp=1))
        other = smp.DistributedModel(_wider_neox(), tensor_parallelism=True)
        try:
            _resume(root_s, "neox-step3", other, None, strict=False)
            errors["misfit"] = "no error"
        except ckpt.CheckpointError as e:
            errors["misfit"] = str(e)
        unchanged = max((after["params"][k] - before["params"][k]).abs().max().item() for k in before["params"])
        return {"errors": errors, "unchanged": unchanged}
    finally:
        smp.shutdown()
