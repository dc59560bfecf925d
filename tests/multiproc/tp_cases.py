"""Tensor-parallel cases (run on every rank by the pool): TP x sharded data parallel training vs a
single-process run of the unconverted Hugging Face model.

Every rank builds the same full model from one seed; conversion keeps each TP rank's slices. The
reference trains the plain HF model on the whole global batch; each TP group reads one combined batch
and takes its rdp slice (prescaled_batch).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar.api.data import rdp_slice
from shardpar.tensor_parallel import (
    TPComm,
    convert_hf_model,
    gather_full_state_dict,
    tp_split_table,
)
from tests import models
from tests.multiproc.parity import ADAM, _param_groups
from tests.tp_families import FAMILY_BUILDERS


def tiny_llama(seed: int = 0) -> nn.Module:
    """Grouped-query attention (4 heads, 2 KV heads), q/k/v/o biases, odd-ish sizes (40, 44, 98)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=98,
        hidden_size=40,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def tiny_neox_untied(seed: int = 0) -> nn.Module:
    return models.tiny_neox(seed)


def tiny_gpt2(seed: int = 0) -> nn.Module:
    return models.tiny_gpt2_tied(seed)


BUILDERS = {"neox": tiny_neox_untied, "llama": tiny_llama, "gpt2_tied": tiny_gpt2, **FAMILY_BUILDERS}
VOCAB = {name: 98 if name == "llama" else 96 for name in BUILDERS}
TP_KNOBS = {"tensor_parallel_degree": 2, "prescaled_batch": True}


def _batch(name: str, seed: int, rows: int) -> dict[str, torch.Tensor]:
    return models.lm_batch(seed, rows, vocab=VOCAB[name])


def _tp_comm() -> TPComm:
    return TPComm(smp.get_engine(), smp.get_topology().tp, smp.tp_rank())


def _max_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    if ours.keys() != theirs.keys():
        raise AssertionError(f"keys differ: {sorted(ours.keys() ^ theirs.keys())[:6]}")
    return max((ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs)


# ---- gradients of a converted model (no sharding) ----------------------------------------------


def grad_check(name: str, *, vocab_parallel_loss: bool = False) -> dict[str, float]:
    """One forward/backward of the converted model vs the HF model on the same rows: loss, logits,
    every gradient (gathered to the HF layout), and the spread of TP-replicated grads across TP ranks."""
    smp.init(dict(TP_KNOBS))
    try:
        comm = _tp_comm()
        model = convert_hf_model(BUILDERS[name](), comm, vocab_parallel_loss=vocab_parallel_loss)
        ref = BUILDERS[name]()
        batch = rdp_slice(_batch(name, 7, 2 * smp.rdp_size()))
        out, ref_out = model(**batch), ref(**batch)
        out.loss.backward()
        ref_out.loss.backward()
        splits = tp_split_table(model)
        logits = out.logits if not vocab_parallel_loss else comm.all_gather_last(out.logits)
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}
        full = gather_full_state_dict(grads, splits, comm)
        replicated = [g.reshape(-1) for n, g in grads.items() if n not in splits]
        stacked = comm.all_gather_stack(torch.cat(replicated))
        return {
            "loss": abs(out.loss.item() - ref_out.loss.item()),
            "logits": (logits - ref_out.logits).abs().max().item(),
            "grad": _max_diff(full, ref_grads),
            "replicated_spread": (stacked - stacked[0]).abs().max().item(),
            "num_split": float(len(splits)),
            "num_replicated": float(len(replicated)),
            "local_numel": float(sum(p.numel() for p in model.parameters())),
            "full_numel": float(sum(p.numel() for p in ref.parameters())),
        }
    finally:
        smp.shutdown()


# ---- training parity ---------------------------------------------------------------------------


def _build_distributed(name: str, how: str, vocab_parallel_loss: bool, accum: int, delayed: bool) -> Any:
    delay = smp.delay_param_initialization() if delayed else contextlib.nullcontext()
    if how == "context":
        with smp.tensor_parallelism(vocab_parallel_loss=vocab_parallel_loss), delay:
            module = BUILDERS[name]()
        return smp.DistributedModel(module, backward_passes_per_step=accum)
    if vocab_parallel_loss:
        raise AssertionError("vocab_parallel_loss is an option of smp.tensor_parallelism(); use how='context'")
    with delay:
        module = BUILDERS[name]()
    return smp.DistributedModel(module, backward_passes_per_step=accum, tensor_parallelism=True)


def tp_parity(
    name: str,
    knobs: dict[str, Any],
    *,
    how: str = "kwarg",
    vocab_parallel_loss: bool = False,
    steps: int = 5,
    accum: int = 1,
    per_rank: int = 2,
    clip: float = 0.05,
    delayed: bool = False,
) -> dict[str, float]:
    """Train both ways for `steps`; max abs differences of the losses, the pre-clip grad norms and the
    final parameters (consolidated to the HF layout), plus schedule facts."""
    smp.init({**TP_KNOBS, **knobs, "sdp_gradient_clipping": clip})
    try:
        model = _build_distributed(name, how, vocab_parallel_loss, accum, delayed)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(_param_groups(model), **ADAM))
        ref = BUILDERS[name]()
        ref_opt = torch.optim.AdamW(_param_groups(ref), **ADAM)
        diffs = {"loss": 0.0, "norm": 0.0}
        clipped = False
        for step in range(steps):
            full = [_batch(name, 1000 * step + micro, per_rank * smp.rdp_size()) for micro in range(accum)]
            mine = []
            for batch in full:
                loss = model(**rdp_slice(batch)).loss
                model.backward(loss / accum)
                mine.append(loss.item())
            opt.step()
            opt.zero_grad()
            ref_total = 0.0
            for batch in full:
                ref_loss = ref(**batch).loss
                (ref_loss / accum).backward()
                ref_total += ref_loss.item() / accum
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            clipped |= bool(ref_norm > clip)
            ref_opt.step()
            ref_opt.zero_grad()
            gathered = smp.allgather(mine, smp.CommGroup.RDP_GROUP)
            dist_loss = sum(sum(x) for x in gathered) / (accum * smp.rdp_size())
            diffs["loss"] = max(diffs["loss"], abs(dist_loss - ref_total))
            if opt.last_grad_norm is None:
                raise AssertionError("clipping is on, so the optimizer must have computed the grad norm")
            diffs["norm"] = max(diffs["norm"], abs(opt.last_grad_norm.item() - ref_norm.item()))
        tp_losses = smp.allgather(mine, smp.CommGroup.TP_GROUP)
        consolidated = model.state_dict()  # full, in the Hugging Face layout at any tp
        stats = model.comm_stats()
        return {
            **diffs,
            "param": _max_diff(consolidated, ref.state_dict()),
            "tp_loss_spread": max(abs(a - b) for x in tp_losses for a, b in zip(x, tp_losses[0], strict=True)),
            "clipped": float(clipped),
            "all_sharded": float(model.all_sharded()),
            "tp_all_reduces": float(stats.get(("all_reduce", "tp"), {}).get("calls", 0)),
            "sharding_gathers": float(stats.get(("all_gather", "sharding"), {}).get("calls", 0)),
        }
    finally:
        smp.shutdown()


def run_many(cases: list[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, float]]:
    """(kind, model, knobs, kwargs) cases in one spawn; kind is "grad" or "parity"."""
    out = []
    for kind, name, knobs, kw in cases:
        out.append(grad_check(name, **kw) if kind == "grad" else tp_parity(name, knobs, **kw))
    return out


# ---- invalid combinations ----------------------------------------------------------------------


def facade_errors() -> dict[str, str]:
    """Error messages of invalid combinations, raised on every rank before any TP collective."""
    from transformers import LlamaConfig, LlamaForCausalLM

    messages: dict[str, str] = {}
    try:
        smp.init({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 1})
    except ValueError as e:
        messages["no_prescaled"] = str(e)
    finally:
        smp.shutdown()
    smp.init(dict(TP_KNOBS))
    try:
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1,
        )  # fmt: skip
        smp.DistributedModel(LlamaForCausalLM(cfg), tensor_parallelism=True)
    except ValueError as e:
        messages["kv_heads"] = str(e)
    finally:
        smp.shutdown()
    smp.init(dict(TP_KNOBS))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            smp.DistributedModel(models.tiny_neox())  # tp 2, but nobody asked for tensor parallelism
        messages["not_converted"] = " | ".join(str(w.message) for w in caught if "tensor parallel" in str(w.message))
    finally:
        smp.shutdown()
    smp.init(dict(TP_KNOBS))
    try:  # converted by hand, then wrapped with tensor parallelism asked for: converted once, no warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted = convert_hf_model(models.tiny_neox(), _tp_comm())
            wrapped = smp.DistributedModel(converted, tensor_parallelism=True)
        # (full shape the user sees, this TP rank's shape): converted twice would halve both again
        shapes = {
            n: (tuple(p.shape), wrapped.sharded_state.piece_of(p).shape)
            for n, p in wrapped.module.named_parameters()
            if "embed_in" in n
        }
        messages["converted_first"] = f"{shapes} {[str(w.message) for w in caught]}"
    finally:
        smp.shutdown()
    return messages
