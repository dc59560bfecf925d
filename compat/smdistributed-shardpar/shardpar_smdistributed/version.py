"""The SMP v1 version `smdistributed.modelparallel.__version__` reports.

1.13.0 is the first v1 release with the sharded data parallelism shardpar implements (reference 003:
"available in the SageMaker model parallelism library v1.13.0 and later"). transformers compares it with
1.10 to decide that `save_pretrained` applies `smp.state.module_manager.translate_functions` (modules.py
supplies an empty list: shardpar keeps Hugging Face parameter names).
"""

SMP_API_VERSION = "1.13.0"
