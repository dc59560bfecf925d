"""Causal language-model training with shardpar: GPT-NeoX, Llama and GPT-2 from `transformers` configs.

options.py   every flag, a JSON/TOML config file, command-line overrides
models.py    named sizes per family -> transformers configs
data.py      the default corpus (Python's own stdlib source), byte-level or locally trained BPE
train.py     the training loop (used by recipes/train_causal_lm.py and `shardpar demo`)
report.py    progress line, metrics JSONL, per-rank memory
plot.py      a dependency-free PNG loss curve
ckpt.py      checkpoints every N steps, --resume, the Hugging Face export
"""
