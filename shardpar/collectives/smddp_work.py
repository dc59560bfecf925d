"""The smddp engine's options: from the config, else the reference's SMDDP_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_AG_SCRATCH_BYTES = 16 * 1024 * 1024
DEFAULT_AG_SORT_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class SmddpOptions:
    """What the engine needs from the config; None fields are read from the environment."""

    timeout_s: float = 300.0
    ranks_per_node: int | None = None
    ag_scratch_bytes: int | None = None
    ag_sort_bytes: int | None = None
    # sdp_hierarchical_allgather: off, a gather over a group spanning nodes goes native ("hierarchical_off").
    hierarchical_allgather: bool = True

    def resolved(self, world: int) -> SmddpOptions:
        env = os.environ
        rpn = self.ranks_per_node or int(env.get("LOCAL_WORLD_SIZE", world) or world)
        scratch = self.ag_scratch_bytes or int(env.get("SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES", DEFAULT_AG_SCRATCH_BYTES))
        sort = self.ag_sort_bytes or int(env.get("SMDDP_AG_SORT_BUFFER_SIZE_BYTES", DEFAULT_AG_SORT_BYTES))
        return SmddpOptions(self.timeout_s, rpn, scratch, sort, self.hierarchical_allgather)
