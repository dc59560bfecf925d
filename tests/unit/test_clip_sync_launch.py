"""Issue 29 (1, 3, 7) in one process: whose clipping is in force (`DistributedOptimizer.clipping`), the
window's no_sync rule (DDP's), and what shardpar's Accelerator refuses before accelerate sets anything
up -- each refusal naming the value, the rule and the fix."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from accelerate.state import PartialState

import shardpar as smp
from shardpar.config import Config
from shardpar.integrations.accelerate import Accelerator
from shardpar.integrations.accelerate_launch import check_before_accelerate
from shardpar.optim.clipping import ACCELERATE, KNOB, TRAINER, Clipping
from shardpar.runtime.window import AccumulationWindow
from tests import models
from tests.conftest import init_world_of_one
from tests.multiproc.trainer_cases import fresh_accelerate_state

_LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ACCELERATE_VARS = ("ACCELERATE_USE_CPU", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "PMI_SIZE", "PMI_RANK")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for var in (*_LAUNCH_VARS, *_ACCELERATE_VARS):
        monkeypatch.delenv(var, raising=False)
    fresh_accelerate_state()
    yield monkeypatch
    fresh_accelerate_state()
    assert not smp.is_initialized()


# ---- the window under no_sync ([Note: no_sync] in runtime/window.py) -----------------------------


def _backward(window: AccumulationWindow) -> bool:
    ends = window.begin_backward()
    window.end_backward()
    return ends


def test_no_sync_defers_the_boundary_to_the_first_backward_outside_it() -> None:
    window = AccumulationWindow(4)
    with window.no_sync():
        assert window.in_no_sync
        assert [_backward(window), _backward(window)] == [False, False]
        with pytest.raises(ValueError, match=r"after 2 backward passes inside model.no_sync\(\).*outside no_sync"):
            window.check_step()
    assert _backward(window), "DDP syncs the first backward outside no_sync, whatever the count says"
    window.check_step()
    assert [_backward(window) for _ in range(4)] == [False, False, False, True]  # the count again
    with window.no_sync():
        _backward(window)
    window.reset()  # zero_grad drops the window: the count starts over
    assert [_backward(window) for _ in range(4)] == [False, False, False, True]


def test_no_sync_before_a_step_of_micro_batches_ends_at_its_last_micro_batch() -> None:
    window = AccumulationWindow(1)
    with window.no_sync():
        _backward(window)
    with window.in_step(3):
        assert [_backward(window) for _ in range(3)] == [False, False, True]


# ---- the clipping in force ---------------------------------------------------------------------


def test_clipping_says_whose_it_is() -> None:
    assert str(Clipping(1.0)).startswith("sdp_gradient_clipping=1.0: optimizer.step() clips")
    assert str(Clipping(0.0, KNOB)) == "sdp_gradient_clipping=0.0: no clipping in optimizer.step()"
    assert str(Clipping(0.5, TRAINER)).startswith("TrainingArguments.max_grad_norm=0.5: optimizer.step() clips")
    assert "accelerator.clip_grad_norm_" in str(Clipping(0.0, ACCELERATE))
    with pytest.raises(ValueError, match=r"max_norm=-1.*>= 0"):
        Clipping(-1.0)
    with pytest.raises(ValueError, match=r"owner='ddp'.*one of smp, trainer, accelerate"):
        Clipping(1.0, "ddp")


def test_accelerate_takes_the_clipping_and_refuses_a_knob_that_asked_for_another(
    no_launcher: pytest.MonkeyPatch,
) -> None:
    accelerator = Accelerator(cpu=True, shardpar_config={"sdp_param_persistence_threshold": 0})
    model = models.tiny_neox(0)
    _, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.optimizer.clipping == Clipping(0.0, ACCELERATE)
    smp.shutdown()
    fresh_accelerate_state()
    accelerator = Accelerator(cpu=True, shardpar_config={"sdp_gradient_clipping": 0.5})
    model = models.tiny_neox(0)
    with pytest.raises(
        ValueError, match=r"sdp_gradient_clipping=0.5 .*accelerator.clip_grad_norm_\(model.parameters\(\), 0.5\)"
    ):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    smp.shutdown()


def test_a_norm_of_fp16_loss_scaled_gradients_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with init_world_of_one(monkeypatch, fp16=True):
        model = smp.DistributedModel(models.tiny_neox(0))
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
        model.backward(model(**models.lm_batch(0, 2)).loss)
        with pytest.raises(ValueError, match=r"fp16 loss scale of 4\.29.*clip_master_grads\(max_norm\)"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert not opt.clipped_by_user


# ---- refusals before accelerate's set-up ([Note: process counts under accelerate launch]) ------------


def test_a_cpu_launch_accelerate_would_not_count_is_refused_before_its_setup(no_launcher: pytest.MonkeyPatch) -> None:
    for var, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        no_launcher.setenv(var, value)
    no_launcher.setattr(torch.accelerator, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"started 2 processes but accelerate would see 1.*ACCELERATE_USE_CPU=1"):
        Accelerator(shardpar_config={"sharded_data_parallel_degree": 2})
    assert not PartialState._shared_state, "accelerate's state was set up before the refusal"
    no_launcher.setenv("ACCELERATE_USE_CPU", "1")  # the fix: accelerate counts the two processes
    check_before_accelerate({}, Config(sharded_data_parallel_degree=2))


def test_accelerate_launch_cpu_started_one_process_for_an_sdp_that_needs_more(no_launcher: pytest.MonkeyPatch) -> None:
    # `accelerate launch --cpu --num_processes 2 train.py`: its simple launcher runs ONE process
    for var, value in {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        no_launcher.setenv(var, value)
    with pytest.raises(
        ValueError, match=r"started this script as 1 process.*ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu"
    ):
        Accelerator(shardpar_config={"sharded_data_parallel_degree": 2})
    assert not PartialState._shared_state
    check_before_accelerate({}, Config())  # sdp 1: one process, as accelerate itself runs it


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_sharding_plugin_is_refused_before_accelerates_setup(no_launcher: pytest.MonkeyPatch, how: str) -> None:
    kwargs = {"fsdp_plugin": object()} if how == "argument" else {}
    if how == "environment":
        no_launcher.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch --use_fsdp
    with pytest.raises(ValueError, match=r"(fsdp_plugin=\.\.\.|ACCELERATE_USE_FSDP=true).*would both shard"):
        Accelerator(cpu=True, **kwargs)
    assert not PartialState._shared_state


def test_a_world_of_one_that_needs_more_ranks_says_how_to_start_them() -> None:
    with pytest.raises(ValueError, match=r"divide .*\(world 1 .*runs alone.*torchrun --nproc-per-node N.*--multi_gpu"):
        Config(sharded_data_parallel_degree=2).check_world(1)


def test_an_mpi_launch_is_the_same_world_for_shardpar_as_for_accelerate(no_launcher: pytest.MonkeyPatch) -> None:
    # `accelerate launch --cpu --mpirun_hostfile H --num_processes 4`: only MPI's variables, which accelerate
    # reads (and copies to WORLD_SIZE / RANK once its state starts; smp.init may come first)
    from shardpar.api import launch_env

    no_launcher.setenv("PMI_SIZE", "4")
    no_launcher.setenv("PMI_RANK", "3")
    assert launch_env.world_and_rank() == (4, 3)
    no_launcher.setenv("WORLD_SIZE", "2")  # torchrun's come first, as in accelerate
    no_launcher.setenv("RANK", "1")
    assert launch_env.world_and_rank() == (2, 1)
