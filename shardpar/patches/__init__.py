"""SMP v1's `smdistributed.modelparallel.torch.patches`: `shardpar.patches.checkpoint` holds its
functional activation checkpoints."""
