"""Cases for test_hf_trainer.py: shardpar's Trainer on the ranks of a pool, and transformers' own
Trainer in a pool of one as the reference, on the same global batch.

Recipe shared by every case: tiny GPT-NeoX, a fixed token dataset, AdamW with transformers' weight-decay
groups, a linear schedule, max_grad_norm 0.5 (it engages), and a global batch of
GLOBAL_BATCH sequences per micro-step (per-device batch = GLOBAL_BATCH / rdp), accumulated ACCUM times.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import Dataset
from transformers import GPTNeoXForCausalLM, TrainerCallback, TrainingArguments
from transformers import Trainer as HFTrainer

import shardpar as smp
from shardpar.integrations.transformers import Trainer
from tests import models

GLOBAL_BATCH = 8
ACCUM = 2
STEPS = 4
SHARD = {"sharded_data_parallel_degree": 2, "sdp_param_persistence_threshold": 0}  # every parameter sharded


class TokenDataset(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int, seq: int = 16) -> None:
        self.ids = torch.randint(0, 96, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


TRAIN = (64, 0)  # (samples, seed): 64 = 4 steps x 2 micro-steps x 8, one epoch
EVAL = (16, 1)


def fresh_accelerate_state() -> None:
    """accelerate keeps process-wide singletons; a case in a reused pool starts from none."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def training_args(out: str, rdp: int, **changes: Any) -> TrainingArguments:
    fresh_accelerate_state()
    base: dict[str, Any] = dict(
        output_dir=out,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=GLOBAL_BATCH // rdp,
        per_device_eval_batch_size=GLOBAL_BATCH // rdp,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-2,
        # As tests/multiproc/parity.py: with eps 1e-8, Adam turns summation-order noise in a near-zero
        # gradient into a step of up to lr; 1e-6 keeps the fp32 comparison at 1e-5 meaningful.
        adam_epsilon=1e-6,
        warmup_steps=0,
        weight_decay=0.1,
        max_grad_norm=0.5,  # engages: the first steps' norms are 0.8-0.9
        logging_steps=1,
        save_strategy="no",
        seed=0,
    )
    return TrainingArguments(**{**base, **changes})


def _history(trainer: Any) -> dict[str, list[float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h[key] for h in logs] for key in ("loss", "grad_norm", "learning_rate")}


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


# ---- the reference: transformers' Trainer, one process ---------------------------------------------


def reference_case(out: str) -> dict[str, Any]:
    """fp32 and bf16 runs of the plain Trainer on the whole global batch; evaluate and predict (fp32)."""
    runs: dict[str, Any] = {}
    for name, bf16 in (("fp32", False), ("bf16", True)):
        trainer = HFTrainer(
            model=models.tiny_neox(0),
            args=training_args(f"{out}/{name}", 1, bf16=bf16),
            train_dataset=TokenDataset(*TRAIN),
            eval_dataset=TokenDataset(*EVAL),
        )
        trainer.train()
        runs[name] = {**_history(trainer), "final": _full_state(trainer.model)}
        if name == "fp32":
            runs[name]["eval"] = trainer.evaluate()["eval_loss"]
            runs[name]["predictions"] = torch.as_tensor(trainer.predict(TokenDataset(*EVAL)).predictions)
    return runs


# ---- shardpar's Trainer at 4 ranks -----------------------------------------------------------------


class ReplicationCounter(TrainerCallback):
    """Replication AllReduce calls per backward (counting engine): after the first micro-step of each
    accumulation window, and in the step that closed with the second micro-step and the optimizer."""

    def __init__(self) -> None:
        self.micro: list[int] = []
        self.boundary: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        smp.comm_stats().begin_step()  # what came before (evaluation, saving) is not counted

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.micro.append(_replication_calls(smp.comm_stats().begin_step()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.boundary.append(_replication_calls(smp.comm_stats().history[-1]))


def _replication_calls(records: Any) -> int:
    return sum(1 for r in records if r.op == "all_reduce" and r.group == "replication")


class LayerCalls(TrainerCallback):
    """Forward calls of the first block's MLP: twice per micro-step under activation checkpointing
    (transformers checkpoints the block's forward, inside its hooks: the MLP is called again)."""

    def __init__(self, model: GPTNeoXForCausalLM) -> None:
        self.calls = 0
        model.gpt_neox.layers[0].mlp.register_forward_pre_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.calls += 1


TP = {**SHARD, "tensor_parallel_degree": 2, "prescaled_batch": True}


def parity_case(out: str) -> dict[str, Any]:
    """shardpar's Trainer at world 4, accumulation 2: sdp 2 in fp32 (with the collective schedule,
    evaluate and predict), bf16, fp16, and fp32 with gradient checkpointing, each configured through
    `shardpar_config=`; then tp 2 x sdp 2 configured by `smp.init` before the model is built (under
    smp.tensor_parallelism()) and wrapped by the user, with evaluate, predict and save_model."""
    runs: dict[str, Any] = {}
    world = int(os.environ["WORLD_SIZE"])
    variants: list[tuple[str, dict[str, Any]]] = [
        ("fp32", {}),
        ("bf16", {"bf16": True}),
        ("fp16", {"fp16": True}),
        ("checkpointing", {"gradient_checkpointing": True}),
        ("tp", {}),
    ]
    for name, changes in variants:
        tp = name == "tp"
        if tp:  # the user wraps the model (as delayed initialisation or TP needs); the Trainer takes it as it is
            smp.init(TP)
            with smp.tensor_parallelism():
                module = smp.DistributedModel(models.tiny_neox(0))
        else:
            module = models.tiny_neox(0)
        counter, layer = ReplicationCounter(), LayerCalls(module)
        trainer = Trainer(
            model=module,
            args=training_args(f"{out}/{name}", world // 2 if tp else world, **changes),
            train_dataset=TokenDataset(*TRAIN),
            eval_dataset=TokenDataset(*EVAL),
            callbacks=[counter, layer],
            **({} if tp else {"shardpar_config": SHARD}),
        )
        trainer.train()
        run: dict[str, Any] = {**_history(trainer), "layer_calls": layer.calls}
        run.update(micro=counter.micro, boundary=counter.boundary, sdp=smp.sdp_size(), tp=smp.tp_size())
        run.update(world=smp.size(), compute_dtype=str(trainer.model.policy.compute))
        if name in ("fp32", "tp"):
            run["eval"] = trainer.evaluate()["eval_loss"]
            run["predictions"] = torch.as_tensor(trainer.predict(TokenDataset(*EVAL)).predictions)
        if tp:  # state_dict() holds each TP rank's slices (issue 20); the export holds the full weights
            trainer.save_model(f"{out}/tp/final")
            if smp.rank() == 0:
                run["final"] = GPTNeoXForCausalLM.from_pretrained(f"{out}/tp/final").state_dict()
        else:
            run["final"] = _full_state(trainer.model)
        runs[name] = run
        smp.shutdown()
    return runs


# ---- checkpoints: stop after a save, resume ------------------------------------------------------


class StopAfterSave(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


RESUME_STEPS = 6
FIXED_BATCH = models.lm_batch(7, 4)


def save_and_stop_case(out: str) -> dict[str, Any]:
    """World 4: (a) RESUME_STEPS steps straight; (b) the same run saving every 2 steps, keeping 1
    checkpoint, stopped after the save at step 4; its HF weights' logits against the model's. Rank 0
    copies (b)'s output directory to `<out>/c` for a resume at another world size."""
    world = int(os.environ["WORLD_SIZE"])
    args = {"max_steps": RESUME_STEPS}
    straight = Trainer(
        model=models.tiny_neox(0),
        args=training_args(f"{out}/a", world, **args),
        train_dataset=TokenDataset(RESUME_STEPS * ACCUM * GLOBAL_BATCH, 0),
        shardpar_config=SHARD,
    )
    straight.train()
    result: dict[str, Any] = {"straight": _history(straight), "straight_final": _full_state(straight.model)}
    smp.shutdown()
    stopped = Trainer(
        model=models.tiny_neox(0),
        args=training_args(f"{out}/b", world, save_strategy="steps", save_steps=2, save_total_limit=1, **args),
        train_dataset=TokenDataset(RESUME_STEPS * ACCUM * GLOBAL_BATCH, 0),
        callbacks=[StopAfterSave(4)],
        shardpar_config=SHARD,
    )
    stopped.train()
    model = stopped.model
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=FIXED_BATCH["input_ids"]).logits
    result["stopped"] = _history(stopped)
    if smp.rank() == 0:
        ckpt = Path(out) / "b" / "checkpoint-4"
        result["listing"] = sorted(p.name for p in (Path(out) / "b").iterdir())
        result["files"] = sorted(p.name for p in ckpt.iterdir())
        reloaded = GPTNeoXForCausalLM.from_pretrained(ckpt)
        with torch.no_grad():
            result["logits"] = (reloaded(input_ids=FIXED_BATCH["input_ids"]).logits - logits).abs().max().item()
        shutil.copytree(Path(out) / "b", Path(out) / "c")
    smp.barrier()
    return result


def resume_case(out: str) -> dict[str, Any]:
    """Resume `out` (resume_from_checkpoint=True: its newest checkpoint) at this pool's world size,
    with the per-device batch that keeps the global batch; then save_model and reload it."""
    fresh_accelerate_state()
    world = int(os.environ["WORLD_SIZE"])
    trainer = Trainer(
        model=models.tiny_neox(0),
        args=training_args(out, world, max_steps=RESUME_STEPS, save_strategy="steps", save_steps=2),
        train_dataset=TokenDataset(RESUME_STEPS * ACCUM * GLOBAL_BATCH, 0),
        shardpar_config=SHARD,
    )
    trainer.train(resume_from_checkpoint=True)
    result: dict[str, Any] = {"resumed": _history(trainer), "final": _full_state(trainer.model), "world": smp.size()}
    trainer.save_model(f"{out}/final")
    if smp.rank() == 0:
        reloaded = GPTNeoXForCausalLM.from_pretrained(f"{out}/final")
        ours = result["final"]
        result["saved"] = max((ours[k] - v).abs().max().item() for k, v in reloaded.state_dict().items())
        result["final_files"] = sorted(p.name for p in Path(f"{out}/final").iterdir())
    return result
