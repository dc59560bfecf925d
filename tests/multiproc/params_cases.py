"""Cases for test_params.py (issue 20): what ordinary PyTorch / Hugging Face idioms give on a wrapped
model with every parameter sharded (threshold 0, sdp 2 at world 4), against one process on the
global batch. Run on every rank of a pool (importable for spawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardpar as smp
from tests import models

SHARD = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
BUILD = {"neox": models.tiny_neox, "gpt2": models.tiny_gpt2_tied}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if set(a) != set(b):
        raise AssertionError(f"different keys: {sorted(set(a) ^ set(b))[:5]}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _mine(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}


def _decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """nanoGPT / minGPT: weight decay for the matrices (p.dim() >= 2), none for biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _plain_steps(
    model: Any,
    opt: Any,
    mine: dict[str, torch.Tensor],
    ref: nn.Module,
    ref_opt: Any,
    full: dict[str, torch.Tensor],
    *,
    clip: float,
    seen: set[str] | None = None,
) -> tuple[float, float, float, float]:
    """One plain-PyTorch step (backward, clip_grad_norm_, step, zero_grad) of the wrapped model on this
    rank's batch and of the reference on the whole batch: (loss, norm, reference loss, reference norm).
    `seen` collects the types of the wrapped model's .grad after backward."""
    losses, norms = [], []
    for m, o, batch in ((model, opt, mine), (ref, ref_opt, full)):
        loss = m(**batch).loss
        loss.backward()
        if seen is not None and m is model:
            seen.update(type(p.grad).__name__ for p in m.parameters())
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), clip).item())
        o.step()
        o.zero_grad()
        losses.append(loss.item())
    return losses[0], norms[0], losses[1], norms[1]


def surface_case(name: str) -> dict[str, Any]:
    """Shapes, counts, dtype, config, state dicts and a nested wrap, before any training."""
    smp.init(dict(SHARD))
    try:
        ref = BUILD[name]()
        model = smp.DistributedModel(BUILD[name]())
        out: dict[str, Any] = {
            "meta": [(n, tuple(p.shape), p.dim(), p.numel(), str(p.dtype)) for n, p in model.named_parameters()],
            "ref_meta": [(n, tuple(p.shape), p.dim(), p.numel(), str(p.dtype)) for n, p in ref.named_parameters()],
            "num_parameters": (model.num_parameters(), model.num_parameters(only_trainable=True)),
            "ref_num_parameters": (ref.num_parameters(), ref.num_parameters(only_trainable=True)),
            "local_numel": sum(p.local_piece.numel() for p in model.parameters()),
            "config_is_hf": model.config is model.module.config,
            "decay_groups": [len(g["params"]) for g in _decay_groups(model)],
            "ref_decay_groups": [len(g["params"]) for g in _decay_groups(ref)],
            "state_dict": _max_diff(model.state_dict(), ref.state_dict()),
            "module_state_dict": _max_diff(model.module.state_dict(), ref.state_dict()),
        }
        for what, convert in (("wrapper", model.half), ("module", model.module.half)):
            try:
                convert()
                out[f"half_{what}"] = "no error"
            except ValueError as e:
                out[f"half_{what}"] = str(e)
        out["dtype_after_half"] = sorted({str(p.dtype) for p in model.parameters()})
        model.config.use_cache = False  # transformers' Trainer does this at construction
        out["use_cache"] = model.module.config.use_cache
        try:
            smp.DistributedModel(model.module)
            out["nested"] = "no error"
        except ValueError as e:
            out["nested"] = str(e)
        return out
    finally:
        smp.shutdown()


def plain_optimizer_case(name: str, steps: int = 3, **knobs: Any) -> dict[str, Any]:
    """torch.optim.AdamW on model.parameters() (no DistributedOptimizer), p.dim() decay groups,
    torch.nn.utils.clip_grad_norm_, zero_grad: against the same script on one process."""
    smp.init({**SHARD, **knobs})
    try:
        rank, world = smp.rank(), smp.size()
        model = smp.DistributedModel(BUILD[name]())
        ref = BUILD[name]()
        opt = torch.optim.AdamW(_decay_groups(model), lr=3e-3)
        ref_opt = torch.optim.AdamW(_decay_groups(ref), lr=3e-3)
        losses, norms, grad_types = [], [], set()
        for step in range(steps):
            batch = models.lm_batch(step, 2 * world)
            loss, norm, ref_loss, ref_norm = _plain_steps(
                model, opt, _mine(batch, rank), ref, ref_opt, batch, clip=0.5, seen=grad_types
            )
            losses.append(abs(sum(smp.allgather(loss)) / world - ref_loss))
            norms.append(abs(norm - ref_norm))
        return {
            "loss": max(losses),
            "norm": max(norms),
            "param": _max_diff(model.state_dict(), ref.state_dict()),
            "grad_types": sorted(grad_types),
            "grads_after_zero_grad": [p.grad for p in model.parameters() if p.grad is not None],
        }
    finally:
        smp.shutdown()


class TrustRatioSGD(torch.optim.Optimizer):
    """LAMB's layer-wise trust ratio on SGD: needs each whole parameter's and gradient's norm."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                ratio = p.norm() / (p.grad.norm() + 1e-6)
                p.add_(p.grad * ratio, alpha=-group["lr"])


def optimizer_kinds_case() -> dict[str, Any]:
    """A norm-based optimizer through DistributedOptimizer trains exactly; Adafactor is stepped whole on
    owners by DistributedOptimizer (issue 31; its parity: test_owner_compute.py), LBFGS is refused, and
    Adafactor raises at its first op on the plain parameters, leaving them unchanged."""
    from transformers.optimization import Adafactor

    smp.init(dict(SHARD))
    try:
        rank, world = smp.rank(), smp.size()
        model = smp.DistributedModel(models.tiny_neox())
        ref = models.tiny_neox()
        opt = smp.DistributedOptimizer(TrustRatioSGD(model.parameters(), lr=0.05))
        ref_opt = TrustRatioSGD(ref.parameters(), lr=0.05)
        for step in range(2):
            batch = models.lm_batch(step, 2 * world)
            model.backward(model(**_mine(batch, rank)).loss)
            opt.step()
            opt.zero_grad()
            ref(**batch).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        out: dict[str, Any] = {"trust_ratio_param": _max_diff(model.state_dict(), ref.state_dict())}
        wrapped = smp.DistributedOptimizer(Adafactor(model.parameters(), lr=1e-3, relative_step=False))
        out["adafactor_owned"] = sum(len(oc.plan.owned) for oc in wrapped.owners)  # stepped whole on owners
        try:
            smp.DistributedOptimizer(torch.optim.LBFGS(model.parameters()))
            out["lbfgs_wrapped"] = "no error"
        except ValueError as e:
            out["lbfgs_wrapped"] = str(e)
        before = model.state_dict()
        model(**_mine(models.lm_batch(5, 2 * world), rank)).loss.backward()
        plain = Adafactor(model.parameters(), lr=1e-3, relative_step=False)
        try:
            plain.step()
            out["adafactor_plain"] = "no error"
        except TypeError as e:
            out["adafactor_plain"] = str(e)
        out["adafactor_changed"] = _max_diff(model.state_dict(), before)
        return out
    finally:
        smp.shutdown()


def save_pretrained_case(name: str, shared_dir: str) -> dict[str, Any]:
    """save_pretrained on the wrapper and on model.module after a step writes full weights once;
    from_pretrained reloads them and gives the wrapped model's logits."""
    from transformers import AutoModelForCausalLM

    smp.init(dict(SHARD))
    try:
        rank, world = smp.rank(), smp.size()
        model = smp.DistributedModel(BUILD[name]())
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
        model.backward(model(**_mine(models.lm_batch(0, 2 * world), rank)).loss)
        opt.step()
        opt.zero_grad()
        probe = models.lm_batch(9, 2)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        out: dict[str, Any] = {}
        for how, save in (("wrapper", model.save_pretrained), ("module", model.module.save_pretrained)):
            target = Path(shared_dir) / f"{name}-{how}"
            save(target)  # every rank calls it; rank 0 writes; all return once it is written
            files = sorted(p.name for p in target.iterdir())
            reloaded = AutoModelForCausalLM.from_pretrained(target)
            with torch.no_grad():
                diff = (reloaded(input_ids=probe).logits - logits).abs().max().item()
            out[how] = {"files": files, "logits": diff}
        return out
    finally:
        smp.shutdown()


def peft_case(shared_dir: str) -> dict[str, Any]:
    """A PEFT LoRA model wrapped: print_trainable_parameters' counts, one step, and the adapter saved
    by PeftModel.save_pretrained reloads into a fresh PeftModel with the same logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    def build() -> Any:
        torch.manual_seed(0)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value"], lora_dropout=0.0)
        return get_peft_model(models.tiny_neox(), lora)

    smp.init(dict(SHARD))
    try:
        rank, world = smp.rank(), smp.size()
        ref = build()
        model = smp.DistributedModel(build())
        out: dict[str, Any] = {
            "counts": model.module.get_nb_trainable_parameters(),
            "ref_counts": ref.get_nb_trainable_parameters(),
        }
        opt = smp.DistributedOptimizer(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
        model.backward(model(**_mine(models.lm_batch(0, 2 * world), rank)).loss)
        opt.step()
        probe = models.lm_batch(9, 2)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        target = Path(shared_dir) / "lora"
        model.module.save_pretrained(target)
        fresh = PeftModel.from_pretrained(models.tiny_neox(), target)
        with torch.no_grad():
            out["logits"] = (fresh(input_ids=probe).logits - logits).abs().max().item()
        out["files"] = sorted(p.name for p in target.iterdir())
        return out
    finally:
        smp.shutdown()


class BNNet(nn.Module):
    """A small CNN with BatchNorm (running statistics updated by every training forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c_in, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()) for c_in in (3, 6)
        )
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


def batchnorm_case(steps: int = 3) -> dict[str, Any]:
    """Buffers follow DDP's broadcast_buffers: before every forward the first rank's buffers reach all
    ranks. The reference: one process running each rank's sub-batch in turn (BatchNorm normalises per
    batch, as each rank does), gradients averaged, buffers as the first sub-batch left them."""
    smp.init(dict(SHARD))
    try:
        rank, world = smp.rank(), smp.size()
        torch.manual_seed(0)
        model = smp.DistributedModel(BNNet())
        torch.manual_seed(0)
        ref = BNNet()
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        # each rank's data differs in scale, so unsynchronised statistics would drift apart
        data = [
            (torch.randn(2 * world, 3, 5, 5, generator=g) * (1 + torch.arange(2 * world).view(-1, 1, 1, 1)))
            for _ in range(steps)
        ]
        targets = [torch.randint(0, 4, (2 * world,), generator=g) for _ in range(steps)]
        loss_diff = 0.0
        for x, y in zip(data, targets, strict=True):
            loss = nn.functional.cross_entropy(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            start = {k: v.clone() for k, v in ref.named_buffers()}
            after_first: dict[str, torch.Tensor] = {}
            ref_losses = []
            for r in range(world):
                ref.load_state_dict({**ref.state_dict(), **start})
                ref_loss = nn.functional.cross_entropy(ref(x[2 * r : 2 * r + 2]), y[2 * r : 2 * r + 2])
                (ref_loss / world).backward()
                ref_losses.append(ref_loss.item())
                if r == 0:
                    after_first = {k: v.clone() for k, v in ref.named_buffers()}
            ref.load_state_dict({**ref.state_dict(), **after_first})
            ref_opt.step()
            ref_opt.zero_grad()
            loss_diff = max(loss_diff, abs(sum(smp.allgather(loss.item())) / world - sum(ref_losses) / world))
        model.eval()
        ref.eval()
        probe = torch.randn(2, 3, 5, 5, generator=g)
        with torch.no_grad():
            out = model(probe)
            ref_out = ref(probe)
        outs = smp.allgather(out)
        return {
            "loss": loss_diff,
            "param": _max_diff(model.state_dict(), ref.state_dict()),
            "eval_vs_ref": (out - ref_out).abs().max().item(),
            "eval_spread": max((o - outs[0]).abs().max().item() for o in outs),
        }
    finally:
        smp.shutdown()


def run_surface_cases() -> dict[str, Any]:
    return {name: surface_case(name) for name in BUILD}


def run_training_cases() -> dict[str, Any]:
    return {
        **{f"plain_{name}": plain_optimizer_case(name) for name in BUILD},
        # the optimizer state and main values split over the 2 replicas too (issue 23): a plain step
        # writes this rank's piece, which the replicas' AllGather spreads before the next forward
        "plain_neox_owned": plain_optimizer_case("neox", shard_optimizer_state=True),
        "kinds": optimizer_kinds_case(),
        "batchnorm": batchnorm_case(),
    }


def run_saving_cases(directory: str) -> dict[str, Any]:
    return {**{f"save_{name}": save_pretrained_case(name, directory) for name in BUILD}, "peft": peft_case(directory)}


def compile_case(how: str, steps: int = 4) -> dict[str, Any]:
    """torch.compile (inductor) on the wrapped model, on the model before wrapping, or per block before
    wrapping: the same losses and parameters as the eager wrapped run, and no compile after the
    first two steps (graph breaks fall at the unit hooks; nothing recompiles per step). lr 1e-3: Adam
    divides by sqrt(v), which turns inductor's other rounding of near-zero gradients into update
    differences of order lr x 1e-3 per step; with 3e-3 four steps reach 2e-5 without any sharding."""
    from torch._dynamo.utils import counters

    smp.init(dict(SHARD))
    try:
        rank, world = smp.rank(), smp.size()
        eager = smp.DistributedModel(models.tiny_neox())
        eager_opt = smp.DistributedOptimizer(torch.optim.AdamW(eager.parameters(), lr=1e-3))
        module = models.tiny_neox()
        if how == "blocks":
            for block in module.gpt_neox.layers:
                block.compile()
        inner = torch.compile(module) if how == "inner" else module
        wrapped = smp.DistributedModel(inner)
        model = torch.compile(wrapped) if how == "whole" else wrapped
        opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        torch._dynamo.reset()
        counters.clear()
        loss_diff, graphs = 0.0, []
        for step in range(steps):
            batch = _mine(models.lm_batch(step, 2 * world), rank)
            losses = []
            for m, o in ((model, opt), (eager, eager_opt)):
                loss = m(**batch).loss
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            loss_diff = max(loss_diff, abs(losses[0] - losses[1]))
            graphs.append(counters["stats"]["unique_graphs"])
        full = {k.replace("_orig_mod.", ""): v for k, v in wrapped.state_dict().items()}
        return {"loss": loss_diff, "param": _max_diff(full, eager.state_dict()), "graphs": graphs}
    finally:
        smp.shutdown()


def run_compile_cases() -> dict[str, Any]:
    return {how: compile_case(how) for how in ("whole", "inner", "blocks")}


def tensor_parallel_case(name: str, steps: int = 3) -> dict[str, Any]:
    """World 4, tp 2, sdp 2: the parameters have the Hugging Face shapes, and a plain AdamW with
    clip_grad_norm_ (TP-split parameters summed over the TP group, TP-replicated ones once) trains like
    one process."""
    from shardpar.api.data import rdp_slice
    from tests.multiproc import tp_cases

    smp.init({**SHARD, **tp_cases.TP_KNOBS})
    try:
        model = smp.DistributedModel(tp_cases.BUILDERS[name](), tensor_parallelism=True)
        ref = tp_cases.BUILDERS[name]()
        opt = torch.optim.AdamW(_decay_groups(model), lr=3e-3)
        ref_opt = torch.optim.AdamW(_decay_groups(ref), lr=3e-3)
        out: dict[str, Any] = {
            "meta": [(n, tuple(p.shape), p.numel()) for n, p in model.named_parameters()],
            "ref_meta": [(n, tuple(p.shape), p.numel()) for n, p in ref.named_parameters()],
            "loss": 0.0,
            "norm": 0.0,
        }
        for step in range(steps):
            batch = models.lm_batch(step, 2 * smp.rdp_size(), vocab=tp_cases.VOCAB[name])
            loss, norm, ref_loss, ref_norm = _plain_steps(model, opt, rdp_slice(batch), ref, ref_opt, batch, clip=0.05)
            mine = sum(smp.allgather(loss, smp.CommGroup.RDP_GROUP)) / smp.rdp_size()
            out["loss"] = max(out["loss"], abs(mine - ref_loss))
            out["norm"] = max(out["norm"], abs(norm - ref_norm))
        out["param"] = _max_diff(model.state_dict(), ref.state_dict())
        return out
    finally:
        smp.shutdown()


def run_tensor_parallel_cases() -> dict[str, Any]:
    return {name: tensor_parallel_case(name) for name in ("neox", "gpt2_tied")}
