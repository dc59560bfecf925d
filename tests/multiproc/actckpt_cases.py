"""Cases for test_actckpt.py: smp.set_activation_checkpointing on a sharded HF GPT-NeoX (run on every rank)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import shardpar as smp
from shardpar.api import context as smp_context
from tests import models

SHARDED = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0, "sdp_gradient_clipping": 0.0}
STEPS = 3


def _neox(dropout: float, layers: int = 2) -> nn.Module:
    module = models.tiny_neox(layers=layers)
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = dropout
    return module


def _checkpoint(module: nn.Module, target: str, strategy: str, preserve_rng_state: bool) -> None:
    layers = module.gpt_neox.layers
    smp.set_activation_checkpointing(
        layers[0] if target == "layer0" else layers, preserve_rng_state=preserve_rng_state, strategy=strategy
    )


def _count_calls(module: nn.Module) -> list[dict[str, int]]:
    """Per layer, calls of the layer module in forward and inside backward (recomputations): a forward
    pre-hook, which fires only when the layer is called, as the unit's own hook does."""
    counts = [{"forward": 0, "backward": 0} for _ in module.gpt_neox.layers]
    for i, layer in enumerate(module.gpt_neox.layers):

        def hook(mod: nn.Module, args: Any, i: int = i) -> None:
            in_backward = torch._C._current_graph_task_id() != -1
            counts[i]["backward" if in_backward else "forward"] += 1

        layer.register_forward_pre_hook(hook)
    return counts


def train_case(
    strategy: str | None,
    *,
    target: str = "layers",
    when: str = "before_wrap",
    dropout: float = 0.0,
    preserve_rng_state: bool = True,
    layers: int = 2,
    offload_horizon: int | None = None,
) -> dict[str, Any]:
    """STEPS SGD steps of tiny GPT-NeoX at sdp 2 with every parameter sharded, each rank on its 2 sequences;
    `strategy` None trains without checkpointing. Dropout masks come from a per-rank, per-step seed, so a
    checkpointed run and a plain one draw the same masks in forward. `offload_horizon` turns on
    offload_activations with that activation_loading_horizon; the offloader's events come back with the
    layers named by index."""
    offload = (
        {} if offload_horizon is None else {"offload_activations": True, "activation_loading_horizon": offload_horizon}
    )
    smp.init({**SHARDED, **offload})
    offloader = smp_context.activation_offloader()
    if offloader is not None:
        offloader.stats.events = []
    module = _neox(dropout, layers)
    if strategy is not None and when == "before_wrap":
        _checkpoint(module, target, strategy, preserve_rng_state)
    counts = _count_calls(module)
    model = smp.DistributedModel(module)
    if strategy is not None and when == "after_wrap":
        _checkpoint(model.module, target, strategy, preserve_rng_state)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rank, world = smp.rank(), smp.size()
    model.train()
    losses = []
    for step in range(STEPS):
        batch = models.lm_batch(step, 2 * world)
        torch.manual_seed(1000 * step + rank)
        loss = model(**{k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "counts": counts,
        "units": [u.name for u in model.units],
        "layer_class": type(module.gpt_neox.layers[0]).__name__,
        "all_sharded": model.all_sharded(),
    }
    if offloader is not None:
        index = {id(layer): i for i, layer in enumerate(module.gpt_neox.layers)}
        result["offload_events"] = [(kind, index[id(m)]) for kind, m in offloader.stats.events or []]
        result["offload_counts"] = (offloader.stats.num_offloaded, offloader.stats.num_reloaded)
        result["offload_bytes"] = offloader.stats.bytes_offloaded
    if dropout == 0.0:  # the single-process reference on the whole batch
        ref = _neox(0.0, layers)
        ref.train()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(STEPS):
            ref(**models.lm_batch(step, 2 * world)).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        result["ref_diff"] = models.max_param_diff(model, ref)
    return result
