"""Hugging Face front ends on shardpar: `shardpar.integrations.transformers.Trainer` (a drop-in
`transformers.Trainer`) and `shardpar.integrations.accelerate.Accelerator` (a drop-in
`accelerate.Accelerator`). Import the one you use; `import shardpar` imports neither.

This layer sits above the facade: it uses `smp.*` and the public surface of the model and optimizer
classes; nothing in shardpar imports it (tests/unit/test_layers.py).
"""
