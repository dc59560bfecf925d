"""Issue 29 item 6: FSDP2 users' idioms on a wrapped model -- `p.full_tensor()`, `model.unshard()` /
`reshard()`, and torch.distributed.checkpoint.state_dict's get/set functions -- give what they give on
one process (bit for bit in fp32; the cases say why that is exact), at world 2, sdp 2."""

from __future__ import annotations

from tests.multiproc import fsdp2_cases as cases


def test_state_dict_functions_and_full_tensor_match_one_process(ranks) -> None:
    for rank, res in enumerate(ranks.run(2, cases.state_dict_functions_case, timeout=300)):
        assert res["sharded"] == ["ShardedTensor"], res["sharded"]
        assert res["full_tensor"] == [] and res["full_tensor_type"] == ["Tensor"], res["full_tensor"]
        for name in ("default", "full", "full_cpu", "flat", "frozen", "model_only", "optim_only", "plain_optimizer"):
            assert res[name] == [], f"rank {rank} {name}: {res[name][:3]}"
        # FSDP2's default is sharded (DTensors there, ShardedTensors here); full_state_dict gives plain tensors
        for name in ("default", "flat", "frozen"):
            assert res[f"{name}_types"] == ["ShardedTensor"], (name, res[f"{name}_types"])
        assert res["full_types"] == ["Tensor"] and res["full_cpu_types"] == (["Tensor"] if rank == 0 else [])
        # state for every parameter in both groups, and cpu_offload with full_state_dict leaves rank 0 alone
        assert res["default_sizes"][0] > 0 and res["default_sizes"][1] == 2
        assert res["full_cpu_sizes"] == (res["default_sizes"] if rank == 0 else (0, 0)), res["full_cpu_sizes"]
        for name in ("loaded", "loaded_flat", "stepped_after_load"):
            assert res[name] == [], f"rank {rank} {name}: {res[name][:3]}"
        assert "broadcast_from_rank0" in res["broadcast"] and "smp.resume_from_checkpoint" in res["broadcast"]


def test_unshard_and_reshard_as_fsdp2(ranks) -> None:
    for res in ranks.run(2, cases.unshard_case, timeout=120):
        assert res["before"] == (["sharded"], True)
        assert res["unsharded"] == (["whole"], False) and res["values"] == [], res
        assert res["logits"] == 0.0
        assert res["after_forward"] == (["sharded"], True), res["after_forward"]
        assert res["async"] == (["whole"], False)
        assert res["resharded"] == (["sharded"], True)
        assert res["train_loss"] == 0.0 and res["after_backward"] == (["sharded"], True, True), res
