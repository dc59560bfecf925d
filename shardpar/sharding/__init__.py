"""Pure layout math and planning, no torch.distributed: the flat layout of a unit (layout.py), which
modules become units and who owns a parameter (plan.py), and deferred initialisation (record on the
meta device, materialise shard by shard: deferred_record.py, deferred_init.py)."""
