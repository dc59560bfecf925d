"""Issue 29 item 4: shardpar's Trainer on a PEFT LoRA model checkpoints and `save_model`s what PEFT saves
(the adapter, loadable by `PeftModel.from_pretrained`, the files of PEFT's own `save_pretrained`), never a
config that loads as a random model; resume_from_checkpoint continues exactly."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.multiproc import trainer_peft_cases as cases

TOL = 1e-5


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_trainer_saves_and_resumes_a_peft_adapter(ranks, tmp_path: Path) -> None:
    res = ranks.run(2, cases.save_and_resume_case, str(tmp_path), timeout=600)[0]
    peft_files = set(res["plain_files"])
    assert {"adapter_model.safetensors", "adapter_config.json"} <= peft_files, peft_files
    for name in ("checkpoint", "final"):
        found = res[name]
        files = set(found["files"])
        # the model files are exactly PEFT's; the base model's weights and config are not written
        assert peft_files <= files and not {"config.json", "model.safetensors"} & files, (name, files)
        assert found["peft_logits"] <= TOL, f"{name}: PeftModel.from_pretrained logits differ by {found['peft_logits']}"
        assert found["auto"] != "loaded", f"{name}: AutoModelForCausalLM.from_pretrained loaded the adapter folder"
    assert "shardpar" in set(res["checkpoint"]["files"]), "the checkpoint keeps the reshardable partial checkpoint"
    # resumed at step 2 (the log history of steps 1-2 comes back with it): the same losses and adapter
    tail, want = res["resumed_loss"][2:], res["straight_loss"][2:]
    assert len(tail) == 2 and max(abs(a - b) for a, b in zip(tail, want, strict=True)) <= TOL, (tail, want)
    assert _max_diff(res["resumed"], res["straight"]) <= TOL
    # a checkpoint of weights only (no shardpar/) resumes by loading the adapter PEFT saved
    assert _max_diff(res["adapter_loaded"], res["resumed"]) == 0.0
