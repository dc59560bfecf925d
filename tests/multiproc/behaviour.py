"""Cases for test_behaviour.py, run on every rank of a pool (importable for spawn)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

import shardpar as smp
from tests import memory, models
from tests.multiproc.parity import ADAM

SHARD = {"sdp_param_persistence_threshold": 10}


def schedule_case() -> dict[str, Any]:
    """MLP, world 4, sdp 2, accumulation 2, one unit per reduce bucket: the exact collective schedule
    of one optimizer step, prefetch included."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_reduce_bucket_size": 1})
    model = smp.DistributedModel(models.UnevenMLP(), backward_passes_per_step=2)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    stats = smp.comm_stats()
    micro_records = []
    for micro in range(2):
        stats.begin_step()
        batch = models.mlp_batch(micro, 4)
        model.backward(model(**batch) / 2)
        micro_records.append([(r.op, r.group, r.bytes) for r in stats.begin_step()])
    stats.begin_step()
    opt.step()  # closes its own step in the records
    step_records = [(r.op, r.group, r.bytes) for r in stats.history[-1]]
    unit_bytes = {u.name: u.layout.padded_numel * 4 for u in model.units}
    # the rdp AllReduce carries the persistent grads and one usage flag per parameter
    num_params = sum(len(u.params) for u in model.units) + len(model.persistent.params)
    persistent = (model.persistent.main.numel() + num_params) * 4
    return {"micro": micro_records, "step": step_records, "unit_bytes": unit_bytes, "persistent": persistent}


def _model_state_tensors(model: Any, opt: Any) -> list[torch.Tensor | None]:
    """Every tensor the model and optimizer are meant to keep: original params (data and grad),
    buffers, unit shards, main grads and gathered buffers, optimizer params, grads and state."""
    out: list[torch.Tensor | None] = []
    for p in model.module.parameters():
        out += [p.data, p.grad]
    out += list(model.module.buffers())
    for u in model.units:
        out += [u.main_shard, u.main_grad, u._full, u._compute_shard]
    out += [model.persistent.main, model.persistent.compute, model.persistent.main_grad]
    for group in opt.param_groups:
        for p in group["params"]:
            out += [p, p.grad]
    for state in opt.state.values():
        out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _allowed_extras(model: Any, opt: Any) -> dict[str, int]:
    """What a rank keeps besides model state, by name: the module's buffers (replicated, never sharded:
    GPT-NeoX's rotary inv_freq and original_inv_freq) and the optimizer's last pre-clip grad norm (a
    scalar kept for the user). The engine keeps no tensor between steps (its shared memory is not a
    tensor), so it has no entry; anything else alive counts against the bound."""
    extras = {f"buffer {n}": memory.storages_of([b]) for n, b in model.module.named_buffers()}
    extras["opt.last_grad_norm"] = memory.storages_of([opt.last_grad_norm])
    return {name: memory.total_bytes(s) for name, s in extras.items()}


def _live_report(live: dict[int, memory.Storage], model: Any, opt: Any) -> dict[str, Any]:
    """Bytes of every storage alive since the snapshot, and the unlisted ones by size (for messages)."""
    listed = memory.storages_of(_model_state_tensors(model, opt))
    extras = memory.storages_of([*model.module.buffers(), opt.last_grad_norm])
    unlisted = {ptr: s for ptr, s in live.items() if ptr not in listed and ptr not in extras}
    return {
        "bytes": float(memory.total_bytes(live)),
        "unlisted": memory.largest(unlisted),
        # only when a bound may be broken: the walk is slow on a big heap
        "holders": memory.holders(sorted(unlisted, key=lambda p: -unlisted[p].nbytes)) if len(unlisted) > 4 else [],
        "listed_unseen": [s.example for ptr, s in listed.items() if ptr not in live],
    }


def memory_case(sdp: int) -> dict[str, Any]:
    """Model-state bytes alive per rank after training steps, two ways: the hand-listed tensors the
    model and optimizer keep (`alive`), and every tensor storage alive in the process that was not
    alive before `smp.init` (`live_step` after the second optimizer step, `live_zero` after its
    zero_grad): a reducer bucket, a gathered buffer or a hook's tensor that outlives its step shows up
    there. No reference model is built here: it would be live too."""
    snapshot = memory.LiveTensors()  # whatever earlier cases on this pool left alive is not ours
    smp.init({**SHARD, "sharded_data_parallel_degree": sdp})
    module = models.tiny_neox()
    numel = sum(p.numel() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    model = smp.DistributedModel(module)
    persistent = model.persistent.main.numel()
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    batch = models.lm_batch(0, 2)
    for step in range(2):  # a leak that grows per step shows twice
        model.backward(model(**batch).loss)
        opt.step()
        if step == 0:
            opt.zero_grad()
    alive = _storage_bytes(_model_state_tensors(model, opt))
    live_step = _live_report(snapshot.since(exclude=batch.values()), model, opt)
    opt.zero_grad()
    live_zero = _live_report(snapshot.since(exclude=batch.values()), model, opt)
    # full single-process model state: params + grads + Adam exp_avg + exp_avg_sq, fp32
    total = numel * 4 * 4
    return {
        "alive": float(alive),
        "live_step": live_step,
        "live_zero": live_zero,
        "extras": _allowed_extras(model, opt),
        "total": float(total),
        "persistent": float(persistent * 4 * 4),
        "buffers": float(buffers),
    }


def _storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    return memory.total_bytes(memory.storages_of(tensors))


class Layer1(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight)


class Layer2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.proj(x @ w.T)


class Registered(nn.Module):
    """Reference 003's register_parameter example: layer2's forward uses layer1.weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = Layer1()
        self.layer2 = Layer2()
        smp.register_parameter(self, self.layer1.weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.layer1(x)
        return nn.functional.cross_entropy(self.layer2(h, self.layer1.weight), y)


class TiedLayer2(nn.Module):
    """Holds layer1's weight as its own attribute (tied, like an LM head tied to an embedding), and
    uses the weight itself in a matmul, so autograd saves the parameter, not a view of it."""

    def __init__(self, w: nn.Parameter) -> None:
        super().__init__()
        self.w = w
        self.proj = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x @ self.w)


class TiedPair(nn.Module):
    """Two non-root units sharing a weight: before, layer2's backward released layer1 (the owner) as
    soon as layer2's own gradients arrived, while `x @ w`'s backward still needed w."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = Layer1()
        self.layer2 = TiedLayer2(self.layer1.weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.layer2(self.layer1(x)), y)


REGISTER_CLIP = 0.05  # below every step's gradient norm, so clipping engages on both sides


def register_parameter_case(kind: str = "registered") -> dict[str, Any]:
    smp.init(
        {
            "sharded_data_parallel_degree": smp_world(),
            "sdp_param_persistence_threshold": 4,
            "sdp_gradient_clipping": REGISTER_CLIP,
        }
    )
    build, layer2 = {"registered": (Registered, Layer2), "tied": (TiedPair, TiedLayer2)}[kind]
    model = smp.DistributedModel(build(), wrap=[Layer1, layer2])
    ref = build()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ref_norms, our_norms = [], []
    for _ in range(3):
        x, y = torch.randn(4 * smp.size(), 6, generator=g), torch.randint(0, 3, (4 * smp.size(),), generator=g)
        r = smp.rank()
        model.backward(model(x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4]))
        opt.step()
        our_norms.append(float(opt.last_grad_norm))
        opt.zero_grad()
        ref(x, y).backward()
        ref_norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), REGISTER_CLIP)))  # pre-clip norm
        ref_opt.step()
        ref_opt.zero_grad()
    return {
        "param": models.max_param_diff(model, ref),
        "ref_norms": ref_norms,
        "our_norms": our_norms,
        "clip": REGISTER_CLIP,
    }


def smp_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss per sample (the HF loss is their mean when every sample has the same length)."""
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    tokens = nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels, reduction="none")
    return tokens.mean(dim=1)


def step_microbatches_case(microbatches: int, *, plain_backward: bool = False) -> dict[str, Any]:
    """@smp.step over microbatches vs a single-process step on the whole batch; `plain_backward` runs
    `loss.backward()` instead of `model.backward(loss)` and returns per-sample losses (so the
    StepOutput reductions concat and reduce_sum have something to check)."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "microbatches": microbatches, "sdp_gradient_clipping": 0.0})
    model = smp.DistributedModel(models.tiny_neox())
    # SGD: linear in the gradient, so the check is about micro-batch averaging, not Adam's
    # conditioning (see [Note: Adam eps in parity tests]).
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    ref = models.tiny_neox()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)

    @smp.step
    def train_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if plain_backward:
            per_sample = _per_sample_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            per_sample.mean().backward()
            return per_sample
        loss = model(**batch).loss
        model.backward(loss)
        return loss

    rank, world = smp.rank(), smp.size()
    losses, reductions = [], []
    for step in range(2):
        batch = models.lm_batch(step, 4 * world)
        out = train_step(model, {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()})
        opt.step()
        opt.zero_grad()
        ref_out = ref(**batch)
        ref_out.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = sum(smp.allgather(out.reduce_mean().mean().item())) / world
        losses.append((mean, ref_out.loss.item(), len(out), tuple(out.stack().shape)))
        if plain_backward:
            ref_per_sample = _per_sample_loss(ref_out.logits, batch["labels"]).detach()
            mine = ref_per_sample[4 * rank : 4 * rank + 4]
            reductions.append(
                {
                    "concat": (out.concat() - mine).abs().max().item(),
                    "reduce_sum": (out.reduce_sum() - mine.view(microbatches, -1).sum(0)).abs().max().item(),
                }
            )
    return {
        "losses": losses,
        "reductions": reductions,
        "param": models.max_param_diff(model, ref),
    }


def _zero_grads_kept(model: Any) -> bool:
    """Every trainable unit and the persistent set hold a main grad, and it is all zeros."""
    grads = [u.main_grad for u in model.units if u.num_trainable] + [model.persistent.main_grad]
    return all(g is not None and not g.any() for g in grads)


def zero_grad_keep_case() -> dict[str, Any]:
    """`zero_grad(set_to_none=False)` leaves zero grads that the next accumulation window adds into,
    and -- as in torch -- a parameter that then gets no gradient is still stepped (momentum, weight
    decay) with its zero grad; parity with a reference that zeroes the same way."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.BranchyMLP(), backward_passes_per_step=2)
    torch.manual_seed(0)
    ref = models.BranchyMLP()
    sgd = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), **sgd))
    ref_opt = torch.optim.SGD(ref.parameters(), **sgd)
    rank, world = smp.rank(), smp.size()
    kept, block1 = [], []
    for step, mode in enumerate([0, 1, 0]):  # mode 1 skips blocks.1: no gradient for it that step
        before = ref.blocks[1].up.weight.detach().clone()
        for micro in range(2):
            batch = models.mlp_batch(10 * step + micro, 4 * world)
            local = {k: v[4 * rank : 4 * rank + 4] for k, v in batch.items()}
            model.backward(model(**local, mode=mode) / 2)
            (ref(**batch, mode=mode) / 2).backward()
        opt.step()
        ref_opt.step()
        block1.append(not torch.equal(before, ref.blocks[1].up.weight))
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        kept.append(_zero_grads_kept(model) and all(p.grad is not None and not p.grad.any() for p in ref.parameters()))
    return {
        "kept": kept,
        "block1_stepped": block1,
        "param": models.max_param_diff(model, ref),
    }


def checkpointing_and_eval_case(use_reentrant: bool) -> dict[str, Any]:
    """HF gradient checkpointing (recompute re-gathers), then eval forward and generate()."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    module = models.tiny_neox()
    module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref = models.tiny_neox()
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model.train()
    ref.train()
    train_diff = models.train_lm_side_by_side(  # plain loss.backward(), no model.backward
        model, opt, ref, ref_opt, rank=smp.rank(), world=smp.size(), plain_backward=True
    )
    model.eval()
    ref.eval()
    prompt = models.lm_batch(7, 2)["input_ids"][:, :5]
    with torch.no_grad():
        logits_diff = (model(input_ids=prompt).logits - ref(input_ids=prompt).logits).abs().max().item()
    sharded_after_eval = model.all_sharded()
    gen = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref_gen = ref.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return {
        "train": train_diff,
        "logits": logits_diff,
        "sharded": sharded_after_eval,
        "generate_equal": bool(torch.equal(gen, ref_gen)),
        "all_sharded_end": model.all_sharded(),
    }


def state_dict_case() -> dict[str, Any]:
    """local_state_dict holds this rank's slices; load_state_dict round-trips; optimizer state is local."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2})
    model = smp.DistributedModel(models.UnevenMLP())
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), **ADAM))
    model.backward(model(**models.mlp_batch(0, 4)))
    opt.step()
    full = model.state_dict()
    local = model.local_state_dict()
    ref = models.UnevenMLP()
    fresh = smp.DistributedModel(ref)
    fresh.load_state_dict(full)
    again = fresh.state_dict()
    # A sharded weight grown along dim 0, and a persistent (whole on every rank) tensor cut to one element.
    in_units = {spec.fqn for unit in fresh.units for spec in unit.layout.specs}
    first = next(k for k, v in full.items() if k in in_units and v.dim() == 2)
    last = next(k for k, v in full.items() if k not in in_units and v.numel() > 1)
    bad = {**full, first: torch.cat([full[first], full[first]]), last: full[last].reshape(-1)[:1].clone()}
    try:
        fresh.load_state_dict(bad)
        bad_error = ""
    except ValueError as exc:
        bad_error = str(exc)
    after_bad = fresh.state_dict()
    osd = opt.state_dict()
    local_numel = sum(v.numel() for v in local.values() if isinstance(v, torch.Tensor))
    # SMP v1: a local state dict (marked partial) goes back into the same rank and topology
    partial_ok = local.get("_smp_is_partial") is True
    other = smp.DistributedModel(models.UnevenMLP())  # freshly initialised: not the stepped values
    other.load_state_dict(local)
    partial_roundtrip = max((other.state_dict()[k] - full[k]).abs().max().item() for k in full)
    state_numel = sum(s["exp_avg"].numel() for s in osd["state"].values())
    return {
        "keys_equal": list(full) == list(models.UnevenMLP().state_dict()),
        "roundtrip": max((again[k] - full[k]).abs().max().item() for k in full),
        "bad_error": bad_error,
        "bad_keys": (first, last, tuple(full[first].shape), tuple(full[last].shape)),
        "unchanged_after_bad": all(torch.equal(after_bad[k], again[k]) for k in again),
        "local_numel": local_numel,
        "partial": (partial_ok, partial_roundtrip),
        "state_numel": state_numel,
        "full_numel": sum(v.numel() for v in full.values()),
        "shapes_ok": all(tuple(full[k].shape) == tuple(v.shape) for k, v in models.UnevenMLP().state_dict().items()),
    }


def _buffered_mlp() -> nn.Module:
    torch.manual_seed(0)
    body = models.UnevenMLP()
    body.register_buffer("steps", torch.arange(2.0))
    return body


def _parent(body: nn.Module) -> nn.Module:
    """A module holding `body` between a parameter and a buffer of its own (the same on every call)."""
    torch.manual_seed(1)
    parent = nn.Module()
    parent.extra = nn.Linear(2, 3)
    parent.body = body
    parent.register_buffer("tag", torch.arange(3.0))
    return parent


def nested_state_dict_case() -> dict[str, Any]:
    """A parent holding a DistributedModel gives the state dict it gives holding the plain model:
    nn.Module.state_dict hands the child a prefix and its destination and ignores what it returns."""
    smp.init({"sdp_param_persistence_threshold": 0, "sharded_data_parallel_degree": 2})
    plain = _parent(_buffered_mlp())
    model = smp.DistributedModel(_buffered_mlp())
    wrapped = _parent(model)
    pieces = model.sharded_state.pieces
    ref, got = plain.state_dict(), wrapped.state_dict()
    ref_vars, got_vars = plain.state_dict(keep_vars=True), wrapped.state_dict(keep_vars=True)
    into: dict[str, Any] = {}
    returned = model.state_dict(destination=into, prefix="x.")
    return {
        "sharded": all(p.sharded for p in pieces) and any(0 < p.length < math.prod(p.shape) for p in pieces),
        "keys": list(got),
        "ref_keys": list(ref),
        "values_equal": list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref),
        "metadata_equal": dict(got._metadata) == dict(ref._metadata),  # type: ignore[attr-defined]
        "keep_vars_keys": list(got_vars) == list(ref_vars),
        "keep_vars_buffer_is_the_module_one": got_vars["body.steps"] is model.module.steps,
        "keep_vars_values_equal": all(torch.equal(got_vars[k].detach(), ref_vars[k].detach()) for k in ref_vars),
        "destination": returned is into and list(into) == ["x." + k for k in _buffered_mlp().state_dict()],
        "top_level_keys": list(model.state_dict()) == list(_buffered_mlp().state_dict()),
    }


class _RecurrentMLP(models.UnevenMLP):
    """blocks[0] runs twice per forward, each use under its own activation checkpoint."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for b in (self.blocks[0], self.blocks[0], *self.blocks[1:]):
            h = checkpoint(b, h, use_reentrant=self.use_reentrant)
        return nn.functional.cross_entropy(self.head(h) * self.temperature, y)


def recurrent_unit_under_checkpoint_case(use_reentrant: bool) -> dict[str, Any]:
    """Reentrant checkpointing delivers each use's gradients in its own nested backward: the unit was
    reduced after the first and the second stayed on .grad, added into the next step (silently
    wrong). That is now an error naming the parameter and the fix; use_reentrant=False trains, and
    matches a plain run."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    torch.manual_seed(0)
    model = smp.DistributedModel(_RecurrentMLP(use_reentrant))
    torch.manual_seed(0)
    ref = _RecurrentMLP(use_reentrant)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = smp.rank(), smp.size()
    try:
        for step in range(3):
            batch = models.mlp_batch(step, 2 * world)
            model.backward(model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}))
            opt.step()
            opt.zero_grad()
            ref(**batch).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": "", "diff": models.max_param_diff(model, ref)}


def forward_without_backward_before_step_case() -> dict[str, Any]:
    """Each step also computes a metric with a forward that records a graph but gets no backward (no
    torch.no_grad). The root unit keeps its gathered parameters after such a forward, for the
    backward; after opt.step() they were stale and the next forward used them. Losses and weights
    must match a plain run."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    torch.manual_seed(0)
    model = smp.DistributedModel(models.UnevenMLP())
    torch.manual_seed(0)
    ref = models.UnevenMLP()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = smp.rank(), smp.size()
    worst = 0.0
    for step in range(3):
        batch = models.mlp_batch(step, 2 * world)
        mine = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
        loss = model(**mine)
        want = ref(**mine)
        worst = max(worst, abs(loss.item() - want.item()))
        model.backward(loss)
        model(**mine)  # the metric forward: a graph, never backpropagated
        opt.step()
        opt.zero_grad()
        ref(**batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"loss": worst, "param": models.max_param_diff(model, ref)}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(32, 32) * 0.2)
        self.w2 = nn.Parameter(torch.randn(32, 32) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w1) @ self.w2


class _TiedHead(nn.Module):
    """A BERT-MLM-like head: its own dense layer, then a decoder tied to the owner's weight."""

    def __init__(self, A: nn.Parameter) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.A = A

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ self.A.T


class _TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = Layer1(32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = _TiedHead(self.inp.weight)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.head(h), y)


def tied_head_live_cap_case() -> dict[str, Any]:
    """The head borrows the owner's weight and runs first in backward. Its hold on the owner ends with
    the head's backward, so the owner is not kept gathered through every block's backward: with a cap
    of 2100 elements (owner 1024 + head 1056 = 2080; a block is 2048) nothing exceeds it."""
    import warnings

    cap = 2100
    smp.init({"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 4,
              "sdp_max_live_parameters": cap, "sdp_gradient_clipping": 0.0})  # fmt: skip
    model = smp.DistributedModel(_TiedLM(), wrap=[Layer1, _Block, _TiedHead])
    ref = _TiedLM()
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = smp.rank(), smp.size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(2 * world, 32, generator=g), torch.randint(0, 32, (2 * world,), generator=g)
            loss = model(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
            model.live.peak = model.live.live
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            nn.functional.cross_entropy(ref.head(_ref_trunk(ref, x)), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    return {
        "backward_peak": model.live.peak,
        "cap": cap,
        "warnings": [str(w.message) for w in caught if "sdp_max_live_parameters" in str(w.message)],
        "param": models.max_param_diff(model, ref),
    }


def _ref_trunk(ref: _TiedLM, x: torch.Tensor) -> torch.Tensor:
    h = ref.inp(x)
    for b in ref.blocks:
        h = b(h)
    return h


def different_models_case() -> dict[str, str]:
    """Models that differ between ranks are refused on every rank with the same error, naming the
    first difference: another shape (gloo aborted the process), another depth (a timeout), a parameter
    on meta on one rank only (rank 0's values could not reach it alike). Another seed passes: wrapping
    takes rank 0's values, with no warning."""
    smp.init({**SHARD, "sharded_data_parallel_degree": 2})
    rank = smp.rank()
    builds = {
        "width": lambda: models.UnevenMLP(width=15 if rank == 1 else 13),
        "depth": lambda: models.UnevenMLP(depth=4 if rank == 1 else 3),
        "seed": lambda: (torch.manual_seed(rank), models.UnevenMLP())[1],
        # rank 1 differs in values only, rank 2 in structure: the structure decides
        "mixed": lambda: (torch.manual_seed(int(rank == 1)), models.UnevenMLP(width=15 if rank == 2 else 13))[1],
        "same_seed": lambda: (torch.manual_seed(0), models.UnevenMLP())[1],
        "meta_on_one_rank": lambda: models.UnevenMLP().to_empty(device="meta") if rank == 1 else models.UnevenMLP(),
    }
    out: dict[str, str] = {}
    for name, build in builds.items():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                smp.DistributedModel(build())
            said = [str(w.message) for w in caught if "differs between ranks" in str(w.message)]
            out[name] = "warned: " + said[0] if said else "ok"
        except ValueError as e:
            out[name] = str(e)
    with smp.delay_param_initialization():
        torch.manual_seed(rank)  # other records on each rank: rank 0's values are broadcast
        deferred = models.UnevenMLP()
    try:
        smp.DistributedModel(deferred)
        out["deferred"] = "ok"
    except ValueError as e:
        out["deferred"] = str(e)
    return out
