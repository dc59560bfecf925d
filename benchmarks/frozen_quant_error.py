"""The quantization error of sdp_frozen_base_mode "int8" / "nf4" on a GPT-NeoX's weights (issue 33 item 2).

    PYTHONPATH=. .venv/bin/python benchmarks/frozen_quant_error.py [--hidden 768] [--layers 12] [--sdp 4]

Builds GPT-NeoX at pythia-160m's shape (hidden 768, 12 layers, vocab 50304; transformers' own
initialization: no pretrained weights are reachable from here), casts it to bf16, and quantizes each
matrix (dim 2) the way one rank of `sdp` holds it -- its flat
slice -- with frozen_quant.py, as the frozen shard is. Prints per mode the per-tensor relative errors,
max |err| / max |w| and mean |err| / mean |w|: their worst and mean over tensors, and the bytes a value.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--sdp", type=int, default=4)
    args = ap.parse_args()
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from shardpar.runtime import frozen_quant as fq

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=50304,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        tie_word_embeddings=False,
    )
    model = GPTNeoXForCausalLM(cfg).to(torch.bfloat16)
    weights = [(n, p.detach()) for n, p in model.named_parameters() if p.dim() == 2]
    print(f"GPT-NeoX hidden {args.hidden}, {args.layers} layers, bf16: {len(weights)} matrices, sdp {args.sdp}")
    for mode in fq.QUANTIZED:
        maxes, means = [], []
        for _, w in weights:
            flat = w.reshape(-1)
            n = flat.numel() // args.sdp  # rank 0's shard: its blocks start at its first value
            shard = flat[:n]
            approx = fq.dequantize(fq.quantize(shard, mode), mode, n, torch.float32)
            top, mean = fq.relative_errors(shard, approx)
            maxes.append(top)
            means.append(mean)
        per_value = fq.packed_bytes(mode, fq.QBLOCK) / fq.QBLOCK
        print(
            f"{mode}: {per_value:.4g} B/value; "
            f"max|err|/max|w| worst {max(maxes):.3%} mean {statistics.mean(maxes):.3%}; "
            f"mean|err|/mean|w| worst {max(means):.3%} mean {statistics.mean(means):.3%}"
        )


if __name__ == "__main__":
    main()
