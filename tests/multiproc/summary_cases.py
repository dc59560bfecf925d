"""Cases for test_summary.py (issue 29 item 5): the wrap summary on the "shardpar" logger."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

import shardpar as smp
from tests import models


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def summary_case(knobs: dict[str, Any]) -> dict[str, Any]:
    """World 2: wrap UnevenMLP under AWS's template's warnings.simplefilter("ignore") and keep what the
    "shardpar" logger said, with what the model really holds (counted here from its tensors)."""
    logger = logging.getLogger("shardpar")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            smp.init({"sharded_data_parallel_degree": 2, **knobs})
            torch.manual_seed(0)
            model = smp.DistributedModel(models.UnevenMLP())
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for u in model.units for t in
                (u.main_shard, u._compute_shard) if t is not None and t.numel()}  # fmt: skip
        for t in (model.persistent.main, model.persistent.compute):
            if t.numel():
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return {
            "records": [(r.levelname, r.getMessage()) for r in handler.records],
            "param_mib": f"{sum(held.values()) / 2**20:.2f} MiB of parameters now",
            "sharded": sum(1 for u in model.units for _ in u.params),
            "whole": len(model.persistent.params),
            "units": len(model.units),
        }
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        smp.shutdown()
