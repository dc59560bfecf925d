"""Checkpoints of tensor-parallel models: partial checkpoints in full-parameter coordinates resume
under any (world, tp, sdp); full checkpoints are the original Hugging Face layout."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardpar.checkpoint.placement import Cut, assemble, plan_fetch
from shardpar.tensor_parallel import TPSplit
from tests.multiproc import checkpoint_tp_cases as cases

pytest.importorskip("transformers")

TOL = 1e-6


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:6]
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ---- placement arithmetic (pure) -----------------------------------------------------------------

# (full shape, dim, num_parts): column-parallel, row-parallel, GPT-2's fused c_attn (Conv1D, 3 parts),
# a 3-D tensor cut in the middle, a fused bias
SHAPES = [((24, 10), 0, 1), ((6, 24), 1, 1), ((10, 36), 1, 3), ((4, 12, 3), 1, 1), ((36,), 0, 3)]


def _locals(full: torch.Tensor, dim: int, parts: int, tp: int) -> tuple[Cut, list[torch.Tensor]]:
    if tp == 1:
        return Cut.of(full.shape, None), [full.reshape(-1)]
    split = TPSplit(dim, tp, parts)
    local = [split.local_of(full, r) for r in range(tp)]
    return Cut.of(local[0].shape, split), [t.reshape(-1) for t in local]


def _recording_reader(stored: list[torch.Tensor], reads: list[int]) -> Any:
    def read(t: int, lo: int, k: int) -> torch.Tensor:
        reads.append(k)
        return stored[t][lo : lo + k]

    return read


@pytest.mark.parametrize(("shape", "dim", "parts"), SHAPES)
def test_any_tp_reads_exactly_its_elements_from_any_other(shape: tuple[int, ...], dim: int, parts: int) -> None:
    """Every (saved tp, read tp, TP rank, flat range): the values of TPSplit.local_of, with exactly the
    wanted number of elements read; the same tp reads one range, tp 1 one range per writer."""
    full = torch.randn(shape)
    layouts = {tp: _locals(full, dim, parts, tp) for tp in (1, 2, 3, 6) if shape[dim] % (tp * parts) == 0}
    assert len(layouts) >= 3
    for (saved_tp, (saved, stored)), (tp, (cut, wanted)) in itertools.product(layouts.items(), layouts.items()):
        assert cut.full_shape == tuple(shape) and cut.local_numel == wanted[0].numel()
        n = cut.local_numel
        for rank, (start, length) in itertools.product(range(tp), [(0, n), (1, n - 3), (n // 2, n - n // 2), (5, 1)]):
            reads: list[int] = []
            segments = plan_fetch(saved, cut, rank, start, length)
            got = assemble(segments, _recording_reader(stored, reads), length, torch.float32)
            label = f"{shape} tp {saved_tp} -> {tp}, rank {rank}, [{start}, {start + length})"
            assert torch.equal(got, wanted[rank][start : start + length]), label
            assert sum(reads) == length, f"{label}: read {sum(reads)} elements for {length}"
            if saved_tp == tp:
                assert len(reads) == 1, label
            if tp == 1:  # consolidation: one contiguous range of each writer
                assert len(reads) <= saved_tp, f"{label}: {len(reads)} reads"


# ---- training: save under tp 2, resume under other topologies ------------------------------------


def _check_resume(label: str, res: dict[str, Any], straight: dict[str, Any]) -> dict[str, float]:
    resumed_params = _max_diff(res["resumed"]["params"], straight["at_save"]["params"])
    resumed_moments = _max_diff(res["resumed"]["moments"], straight["at_save"]["moments"])
    assert resumed_params == 0.0, f"{label}: resumed params differ by {resumed_params:.2e}"
    assert resumed_moments == 0.0, f"{label}: resumed Adam moments differ by {resumed_moments:.2e}"
    assert res["step"] == cases.SAVE_AT
    diffs = {
        "losses": max(abs(a - b) for a, b in zip(res["losses"], straight["losses"], strict=True)),
        "params": _max_diff(res["final"]["params"], straight["final"]["params"]),
        "moments": _max_diff(res["final"]["moments"], straight["final"]["moments"]),
    }
    for what, d in diffs.items():
        assert d <= TOL, f"{label}: final {what} differ by {d:.2e}"
    return diffs


@pytest.fixture(scope="module")
def trained(ranks, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    """World 4 (tp 2 x sdp 2), every model: 6 steps straight, a partial save after 3, an export after 6.
    (checkpoint root, per rank {model name: result})."""
    root = str(tmp_path_factory.mktemp("tp_ckpt"))
    names = (*cases.NAMES, "gpt2_tied")
    per_rank = ranks.run(4, cases.run_many, [("straight_case", (root, n)) for n in names], timeout=300)
    return root, [dict(zip(names, results, strict=True)) for results in per_rank]


def test_partial_tp_checkpoint_writes_every_element_once(trained: tuple[str, Any]) -> None:
    _, per_rank = trained
    for name, r in per_rank[0].items():
        shards = [f"shard-0000{i}.safetensors" for i in range(4)]  # every rank of replica 0 writes
        assert r["files"] == sorted(["index.json", "rng.safetensors", *shards]), r["files"]
        index = r["index"]
        assert index["topology"]["tp"] == 2 and index["version"] == 2
        column = {
            "neox": ("gpt_neox.layers.0.mlp.dense_h_to_4h.weight", 0, 1),
            "llama": ("model.layers.0.mlp.up_proj.weight", 0, 1),
            "gpt2_tied": ("transformer.h.0.attn.c_attn.weight", 1, 3),  # Conv1D [in, out]; [q | k | v]
        }
        row = {
            "neox": ("gpt_neox.layers.0.mlp.dense_4h_to_h.weight", 1),
            "llama": ("model.layers.0.mlp.down_proj.weight", 1),
            "gpt2_tied": ("transformer.h.0.mlp.c_proj.weight", 0),
        }
        norm = {
            "neox": "gpt_neox.final_layer_norm.weight",
            "llama": "model.norm.weight",
            "gpt2_tied": "transformer.ln_f.weight",
        }
        params = index["params"]
        fqn, dim, parts = column[name]
        assert params[fqn]["tp"] == {"dim": dim, "size": 2, "num_parts": parts}
        assert params[row[name][0]]["tp"] == {"dim": row[name][1], "size": 2, "num_parts": 1}
        column = {k: v[0] for k, v in column.items()}
        assert params[column[name]]["shape"] == list(r["at_save"]["params"][column[name]].shape)  # HF shape
        assert {p[3] for p in params[column[name]]["pieces"]} == {0, 1}
        assert "tp" not in params[norm[name]] and {p[3] for p in params[norm[name]]["pieces"]} == {0}
        # no TP or replica duplication: param/ + 2 moments hold exactly 3x the HF model's elements
        stored = sum(
            torch.Size(shape).numel()
            for f in index["files"].values()
            for key, (_, shape) in f["tensors"].items()
            if key.startswith(("param/", "optim/"))
        )
        hf_numel = sum(
            t.numel() for k, t in r["at_save"]["params"].items() if k != "lm_head.weight" or name != "gpt2_tied"
        )
        assert stored == 3 * hf_numel, (stored, hf_numel)


def test_tp_checkpoint_resumes_under_other_tp_and_sdp(ranks, trained: tuple[str, Any]) -> None:
    """6 steps straight == 3 steps, save on (tp 2, sdp 2), resume on (tp 2, sdp 2), (tp 1, sdp 2),
    (tp 2, sdp 1), and (tp 2, sdp 2) from a re-save under tp 1; 3 more steps (GPT-NeoX, Llama; tied
    GPT-2 with its fused c_attn on (tp 1, sdp 4)). Resumed parameters and Adam moments are
    bit-identical (HF layout); losses, final parameters and moments within 1e-6."""
    root, per_rank = trained
    straight = per_rank[0]
    world2, world4 = [], []
    for n in cases.NAMES:
        world2 += [
            ("resume_case", (root, n, 1, 2, f"{n}-step3", f"{n}-tp1")),  # tp 2 -> 1, saved again under tp 1
            ("resume_case", (root, n, 2, 1, f"{n}-step3", None)),  # same tp, sdp 2 -> 1
        ]
        world4 += [
            ("resume_case", (root, n, 2, 2, f"{n}-step3", None)),  # the same topology
            ("resume_case", (root, n, 2, 2, f"{n}-tp1", None)),  # tp 1 -> 2
        ]
    world4.append(("resume_case", (root, "gpt2_tied", 1, 4, "gpt2_tied-step3", None)))  # tied, fused 3 parts
    diffs: dict[str, dict[str, float]] = {}
    for world, calls in ((2, world2), (4, world4)):
        for rank, results in enumerate(ranks.run(world, cases.run_many, calls, timeout=300)):
            for (_, (_, name, tp, sdp, tag, _)), res in zip(calls, results, strict=True):
                label = f"{name} {tag} -> world {world} tp {tp} sdp {sdp}"
                diffs[label] = _check_resume(f"{label}, rank {rank}", res, straight[name])
    print("\n".join(f"{k}: {v}" for k, v in diffs.items()))


def test_tp_export_is_the_original_hugging_face_layout(trained: tuple[str, Any]) -> None:
    """partial=False from tp 2: from_pretrained builds the unconverted model with the same logits;
    streamed: per unit one AllGather over the sharding group, then (TP group of rank 0) one over TP."""
    _, per_rank = trained
    for rank, by_name in enumerate(per_rank):
        for name, r in by_name.items():
            e = r["export"]
            expected = []
            for unit_bytes in e["units"]:
                expected.append(("all_gather", "sharding", unit_bytes))
                if rank in (0, 1):  # rdp rank 0: the TP group that feeds rank 0's writer
                    expected.append(("all_gather", "tp", 2 * unit_bytes))
            if rank in (0, 1) and e["persistent"]:
                expected.append(("all_gather", "tp", 2 * e["persistent"]))
            assert e["gathers"] == expected, f"{name} rank {rank}: {e['gathers']}"
            assert e["reload"] == 0.0, f"{name} rank {rank}: partial=False resume into tp 2 differs"
            if rank == 0:
                assert e["logits"] <= 1e-5, f"{name}: from_pretrained logits differ by {e['logits']:.2e}"
                info = e["info"]
                assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == [], info
                assert "config.json" in e["files"] and "model.safetensors" in e["files"]
                print(f"{name}: logits {e['logits']:.1e}")


def test_tp_checkpoint_errors(ranks, trained: tuple[str, Any]) -> None:
    root, _ = trained
    fqn = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    for rank, r in enumerate(ranks.run(2, cases.errors_case, root, fqn)):
        holed, misfit = r["errors"]["holed"], r["errors"]["misfit"]
        assert "holed_partial/index.json" in holed and f"{fqn!r} (TP rank 1 of 2): pieces cover 0 of 768" in holed, (
            f"rank {rank}: {holed}"
        )
        assert f"{fqn}: full shape [64, 32] in the model, [48, 32] in the checkpoint" in misfit, (
            f"rank {rank}: {misfit}"
        )
        assert r["unchanged"] == 0.0, "a failed resume changed the model"
