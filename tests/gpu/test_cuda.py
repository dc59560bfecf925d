"""CUDA path (marked gpu; skipped without CUDA): NCCL world of one, CUDA tensors end to end."""

from __future__ import annotations

import pytest
import torch

import shardpar as smp
from tests import models

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("knobs", [{}, {"bf16": True}])
def test_world_one_on_cuda_matches_plain_pytorch(monkeypatch, knobs: dict) -> None:
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    smp.init({"sdp_param_persistence_threshold": 10, "sdp_gradient_clipping": 0.0, **knobs})
    try:
        assert smp.device().type == "cuda"
        model = smp.DistributedModel(models.tiny_neox())
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref = models.tiny_neox().cuda()
        if knobs.get("bf16"):
            ref = ref.to(torch.bfloat16)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(3):
            batch = {k: v.cuda() for k, v in models.lm_batch(step, 2).items()}
            loss = model(**batch).loss
            model.backward(loss)
            opt.step()
            opt.zero_grad()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            tol = 2e-2 if knobs.get("bf16") else 1e-5
            assert abs(loss.item() - ref_loss.item()) <= tol * max(1.0, abs(ref_loss.item()))
        assert all(u.main_shard.is_cuda for u in model.units)
    finally:
        smp.shutdown()


def test_native_wait_on_cuda_does_not_block_the_host(monkeypatch) -> None:
    """[Note: waits on the device]: waiting for an NCCL collective queued behind ~5 s of GPU work
    returns at once (the stream waits, not the host); an explicit timeout still blocks the host."""

    import torch.distributed as dist

    from shardpar.collectives import Group, NativeEngine

    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    smp.init({})
    try:
        group, engine = Group("test", (0,), handle=dist.group.WORLD), NativeEngine(timeout_s=60)
        for timeout, blocks in ((None, False), (30.0, True)):
            t = torch.ones(1, device="cuda")
            torch.cuda._sleep(10_000_000_000)  # ~5 s of GPU time on the current stream
            work = engine._run(group, lambda t=t: dist.all_reduce(t, group=group.handle, async_op=True), True, on=t)
            work.wait(timeout)
            # Whether the host waited is read off the stream, not a clock: after a wait that blocks,
            # the sleep queued before the all_reduce has finished; after one that does not, it is
            # still running (seconds of GPU time left, far more than the host needs to get here).
            finished = torch.cuda.current_stream().query()
            torch.cuda.synchronize()
            assert finished == blocks, (timeout, finished)
            assert t.item() == 1.0
    finally:
        smp.shutdown()
