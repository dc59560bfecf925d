"""Fine-tune a Hugging Face causal LM with `transformers.Trainer` on shardpar (train.py)."""
