"""What train_gpt_simple.py records in each checkpoint's `user_content` so that a full model can be
rebuilt from the shards offline: the names of the persistent buffers and each parameter's shape, per
optimizer param group, in the optimizer's order."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn


def get_buffer_names(model: Any) -> list[str]:
    """Every persistent buffer of the wrapped module, under its state_dict name."""
    names: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                names.append(prefix + name)
        for name, child in module.named_children():
            walk(child, prefix + name + ".")

    walk(model.module, "")
    return names


def get_param_shapes(model: Any, optimizer: Any) -> list[OrderedDict[str, torch.Size]]:
    """Per param group of the optimizer (`optimizer.fp16_groups`), each parameter's name and shape."""
    names = {param: name for name, param in model.module.named_parameters()}
    groups = []
    for group in optimizer.fp16_groups:
        shapes: OrderedDict[str, torch.Size] = OrderedDict()
        for param in group:
            if param not in names:
                raise ValueError("an optimizer parameter is not among the model's named parameters")
            shapes[names[param]] = param.ds_shape if hasattr(param, "ds_shape") else param.shape
        groups.append(shapes)
    return groups
