"""A SageMaker model-parallel v1 training script run on shardpar with only its import changed
(`train_gpt_simple.py`), and the helper modules such a script ships with."""
