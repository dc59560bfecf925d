"""An SMP v1 training script as written for SageMaker, with no shardpar name in it: it imports
`smdistributed.modelparallel.torch`, takes its options from `SM_HP_MP_PARAMETERS` (`smp.init()`), and then
drives transformers' own SMP helpers (trainer_pt_utils: `smp_forward_backward`, `smp_forward_only`,
`smp_nested_concat`, `smp_gather`) the way `Trainer.training_step` / `prediction_step` call them.

Run by tests/unit/test_smdistributed_compat.py (1 rank) and tests/multiproc/test_smdistributed_compat.py
(2 ranks under torchrun) with shardpar-smdistributed installed; writes its results as JSON to argv[1].
"""

import json
import sys
from pathlib import Path

import smdistributed.modelparallel.torch as smp
import torch
import transformers

smp.init()
torch.manual_seed(0)
# use_cache=False as training scripts set it: a key/value cache among the outputs is not a tensor to concat.
config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, use_cache=False)
hf_model = transformers.GPT2LMHeadModel(config)
model = smp.DistributedModel(hf_model)
optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids).loss
    model.backward(loss)
    return loss


# Each data-parallel rank reads its own 4 rows of one fixed batch (v1: dp_rank picks the data).
batch = torch.randint(0, 64, (4 * smp.dp_size(), 16), generator=torch.Generator().manual_seed(1))
rows = batch[4 * smp.dp_rank() : 4 * (smp.dp_rank() + 1)]
losses = []
for _ in range(4):
    losses.append(train_step(model, rows).reduce_mean().item())
    optimizer.step()
    optimizer.zero_grad()

# transformers' SMP helpers: importing them requires is_sagemaker_mp_enabled() and smdistributed.
from transformers import trainer_pt_utils as tpu  # noqa: E402

inputs = {"input_ids": rows, "labels": rows}
hf_loss = tpu.smp_forward_backward(model, inputs, 2).reduce_mean().item()  # Trainer.training_step
optimizer.zero_grad()
gathered_rows = tpu.smp_gather(rows)  # Trainer's nested_gather: every data-parallel rank's rows, in rank order
# Every rank holds the same model after the steps (a rank-local checksum of the full state dict).
checksum = sum(float(t.double().sum()) for t in model.state_dict().values() if t.is_floating_point())


def evaluate():
    """Trainer.prediction_step's SMP branch, verbatim in substance."""
    with torch.no_grad():
        raw = tpu.smp_forward_only(model, inputs)
    ignore_keys = [*getattr(config, "keys_to_ignore_at_inference", ["cache"]), "loss"]  # Trainer's default
    loss_mb = raw["loss"] if isinstance(raw, dict) else raw[0]
    logits_mb = tuple(v for k, v in raw.items() if k not in ignore_keys) if isinstance(raw, dict) else raw[1:]
    logits = tpu.smp_nested_concat(logits_mb)
    gathered = tpu.smp_gather(logits[0].argmax(-1))
    loss = loss_mb.reduce_mean().item()
    return {"loss": loss, "logits_shape": list(logits[0].shape), "gathered": list(gathered.shape)}


# Recorded rather than raised: the training results above stand on their own (the test reads both).
try:
    evaluation = evaluate()
except Exception as err:
    evaluation = {"error": f"{type(err).__name__}: {err}"}


def save_model(directory):
    """Trainer.save_model's SMP branch: the state dict gathered on every rank, then Trainer._save on the
    process that should save: the plain model's save_pretrained, on rank 0 alone."""
    state_dict = model.state_dict()
    if smp.rank() == 0:
        hf_model.save_pretrained(directory, state_dict=state_dict)
    smp.barrier()
    return sorted(p.name for p in Path(directory).iterdir())


try:
    saved = save_model(sys.argv[1] + ".saved")
except Exception as err:
    saved = [f"{type(err).__name__}: {err}"]

result = {
    "rank": smp.rank(),
    "saved": saved,
    "is_sagemaker_mp_enabled": transformers.utils.is_sagemaker_mp_enabled(),
    "smp_is_shardpar": smp.init.__module__.startswith("shardpar"),
    "sdp": smp.state.cfg.sharded_data_parallel_degree,
    "losses": losses,
    "hf_loss": hf_loss,
    "gathered_rows_are_the_batch": torch.equal(gathered_rows, batch),
    "checksum": checksum,
    "evaluation": evaluation,
}
with open(sys.argv[1] + f".{smp.rank()}", "w") as f:
    json.dump(result, f)
smp.shutdown()
