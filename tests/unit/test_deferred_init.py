"""Deferred init: parameters built on meta and materialised one by one equal a normal init bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from shardpar.sharding.deferred_init import (
    deferred_init,
    is_deferred,
    materialize,
    materialize_by_reset,
    record_init,
    record_stats,
)
from tests.memory import LiveBytes
from tests.models import UnevenMLP, tiny_gpt2_tied, tiny_neox

RNG_STATE_BYTES = torch.get_rng_state().numel()


def _uneven_mlp() -> nn.Module:
    torch.manual_seed(0)
    return UnevenMLP()


class _Odd(nn.Module):
    """Init paths HF and torch modules take, plus the awkward ones: meta-skipping inits, views,
    copies from tensors changed afterwards, literals, `.item()`, explicit generators, bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=3)  # normal_ then a row view filled with 0
        self.bn = nn.BatchNorm1d(6)  # num_batches_tracked is a torch.tensor literal
        self.conv = nn.Conv1d(4, 4, 3)
        nn.init.dirac_(self.conv.weight)
        self.trunc = nn.Parameter(torch.empty(7, 5))
        nn.init.trunc_normal_(self.trunc, std=0.3, a=-0.4, b=0.4)  # rejection loop, skips meta in torch
        self.orth = nn.Parameter(torch.empty(5, 7))
        nn.init.orthogonal_(self.orth)
        self.sparse = nn.Parameter(torch.empty(8, 3))
        nn.init.sparse_(self.sparse, 0.5)
        self.bf16 = nn.Parameter(torch.empty(5, 7, dtype=torch.bfloat16))
        nn.init.xavier_normal_(self.bf16)
        self.bf16.data.T[2].fill_(0.5)
        tmp = torch.randn(5, 7)
        self.copied = nn.Parameter(torch.empty(7, 5))
        self.copied.data.copy_(tmp.T)
        tmp.mul_(100)  # after the copy: `copied` must not see it
        self.literal = nn.Parameter(torch.tensor([1.5, -2.0]))
        self.register_buffer("frac", torch.arange(6).float() / 6)
        self.seeded = nn.Parameter(torch.empty(4, 4).uniform_(-1, 1, generator=torch.Generator().manual_seed(7)))
        self.scaled = nn.Parameter(torch.empty(9))
        with torch.no_grad():
            self.scaled.copy_(torch.linspace(0, 1, 9, device="cpu"))
            self.scaled.mul_(self.trunc.abs().max().item())
        self.expr = nn.Parameter(torch.randn(3, 3) * 2 + 1)
        w = torch.empty(6, 4)
        nn.init.kaiming_uniform_(w, a=5**0.5)
        self.top, self.bottom = nn.Parameter(w[:3]), nn.Parameter(w[3:])


def _odd() -> nn.Module:
    torch.manual_seed(11)
    return _Odd()


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "uneven_mlp": _uneven_mlp,
    "tiny_neox": lambda: tiny_neox(3),
    "tiny_gpt2_tied": lambda: tiny_gpt2_tied(5),
    "odd_inits": _odd,
}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _build_both(build: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor, nn.Module, bool]:
    """(normal model, RNG after it, deferred model, all meta inside the context)."""
    torch.manual_seed(1234)
    reference = build()
    reference_rng = torch.get_rng_state()
    torch.manual_seed(4321)  # the builders seed themselves; a different start must not matter
    with deferred_init():
        model = build()
        meta_inside = all(t.is_meta for t in _tensors(model).values())
    return reference, reference_rng, model, meta_inside


def _assert_identical(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    )
    assert torch.equal(got, want), f"{name} differs from the normal init"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_materialised_values_equal_normal_init(name: str) -> None:
    reference, reference_rng, model, meta_inside = _build_both(BUILDERS[name])
    assert torch.equal(torch.get_rng_state(), reference_rng), "RNG after deferred_init() != after a normal build"
    assert meta_inside
    want, got = _tensors(reference), _tensors(model)
    assert got.keys() == want.keys()
    assert all(t.is_meta and is_deferred(t) for t in got.values())
    rng_before = torch.get_rng_state()
    for key, tensor in got.items():
        _assert_identical(materialize(tensor), want[key], key)
    assert torch.equal(torch.get_rng_state(), rng_before), "materialize() moved the global RNG"
    assert all(t.is_meta for t in _tensors(model).values()), "materialize() must not touch the model"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_any_order_and_rng_use_in_between_give_the_same_values(name: str) -> None:
    reference, _, model, _ = _build_both(BUILDERS[name])
    want = _tensors(reference)
    torch.manual_seed(99)
    for key, tensor in reversed(list(_tensors(model).items())):
        torch.rand(17)  # whoever runs between two materialisations may use the RNG
        _assert_identical(materialize(tensor), want[key], key)


def test_tied_embeddings_stay_one_parameter_and_materialise_equal() -> None:
    reference, _, model, _ = _build_both(BUILDERS["tiny_gpt2_tied"])
    head, wte = "lm_head.weight", "transformer.wte.weight"
    assert reference.get_parameter(head) is reference.get_parameter(wte)
    assert model.get_parameter(head) is model.get_parameter(wte)
    head_value, wte_value = materialize(model.get_parameter(head)), materialize(model.get_parameter(wte))
    assert torch.equal(head_value, wte_value)
    _assert_identical(head_value, reference.get_parameter(head), head)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("name", ["tiny_neox", "tiny_gpt2_tied"])
def test_memory_one_full_parameter_at_a_time(name: str) -> None:
    with LiveBytes() as building, deferred_init():
        model = BUILDERS[name]()
    tensors = _tensors(model)
    largest = max(_nbytes(t) for t in tensors.values())
    # Building: random inits ran on CPU scratch (to advance the RNG), one tensor at a time.
    assert 0 < building.peak <= largest, (building.peak, largest)

    # The record keeps meta geometry, ops, scalars and ~5 KB RNG states; no real tensor bigger than a parameter.
    stats = record_stats(tensors.values())
    assert stats.max_real_numel <= max(t.numel() for t in tensors.values())
    assert stats.num_rng_states > 0 and stats.rng_state_bytes == stats.num_rng_states * RNG_STATE_BYTES

    for key, tensor in tensors.items():
        with LiveBytes() as replay:
            value = materialize(tensor)
        assert replay.peak >= _nbytes(tensor), f"{key}: the tracker saw no allocation"
        assert replay.peak <= max(_nbytes(tensor), largest), f"{key}: peak {replay.peak} B"
        del value
        assert replay.live == 0, f"{key}: {replay.live} B still alive after materialize() returned"


def test_meta_skipping_inits_are_restored_after_the_context() -> None:
    originals = {n: getattr(nn.init, n) for n in ("orthogonal_", "sparse_", "dirac_", "_no_grad_trunc_normal_")}
    with deferred_init():
        assert nn.init.orthogonal_ is not originals["orthogonal_"]
    assert {n: getattr(nn.init, n) for n in originals} == originals
    outside = torch.empty(4, 4, device="meta")
    assert nn.init.orthogonal_(outside) is outside  # torch's own behaviour on meta is back


def test_errors_name_the_cause_and_the_fix() -> None:
    with pytest.raises(ValueError, match="needs a meta tensor"):
        materialize(torch.zeros(3))
    with torch.device("meta"):
        stranger = nn.Linear(3, 2).weight
    assert not is_deferred(stranger)
    with pytest.raises(ValueError, match="materialize_by_reset"):
        materialize(stranger)
    with deferred_init(), pytest.raises(ValueError, match="already active"), deferred_init():
        pass


def test_materialize_by_reset_matches_the_modules_own_init() -> None:
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = UnevenMLP()
    assert not is_deferred(model.get_parameter("blocks.1.up.weight"))
    weight = materialize_by_reset(model, "blocks.1.up.weight", seed=3)
    bias = materialize_by_reset(model, "blocks.1.up.bias", seed=3)
    torch.manual_seed(3)
    reference = nn.Linear(13, 7)  # nn.Linear runs reset_parameters() once at construction
    _assert_identical(weight, reference.weight.detach(), "weight")
    _assert_identical(bias, reference.bias.detach(), "bias")
    assert model.get_parameter("blocks.1.up.weight").is_meta, "the model's own Parameter must stay on meta"
    with pytest.raises(ValueError, match="no reset_parameters"):
        materialize_by_reset(model, "temperature")


def test_record_init_replays_an_init_run_on_existing_meta_tensors() -> None:
    """record_init: meta tensors made outside deferred_init() (init_empty_weights) get a record from
    an init function run on them; each is then materialised alone, seeded alike, global RNG untouched."""
    with torch.device("meta"):
        emb, untouched = nn.Embedding(11, 6, padding_idx=3), nn.Linear(3, 2)
    real = torch.ones(4)
    rng_before = torch.get_rng_state()

    def init() -> None:
        nn.init.normal_(emb.weight, std=0.02)
        emb.weight[3].zero_()  # a view of the recorded storage
        nn.init.trunc_normal_(untouched.bias, std=0.5, a=-1.0, b=1.0)  # skips meta in torch: recorded whole
        real.mul_(2)  # real tensors are not ours: the op runs as usual

    written = record_init([emb.weight, untouched.weight, untouched.bias, real], init, seed=5)
    assert [id(t) for t in written] == [id(emb.weight), id(untouched.bias)]
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert is_deferred(emb.weight) and is_deferred(untouched.bias) and not is_deferred(untouched.weight)
    assert torch.equal(real, torch.full((4,), 2.0))
    torch.manual_seed(5)
    ref_weight = nn.init.normal_(torch.empty(11, 6), std=0.02)
    ref_weight[3].zero_()
    ref_bias = nn.init.trunc_normal_(torch.empty(2), std=0.5, a=-1.0, b=1.0)
    _assert_identical(materialize(emb.weight), ref_weight, "weight")
    _assert_identical(materialize(untouched.bias), ref_bias, "bias")
    with pytest.raises(ValueError, match="materialize_by_reset"):
        materialize(untouched.weight)  # the init never wrote it: no record, not uninitialised memory


@pytest.mark.gpu
def test_materialize_onto_cuda_keeps_cpu_init_values() -> None:
    reference, _, model, _ = _build_both(BUILDERS["tiny_neox"])
    for key, tensor in _tensors(model).items():
        value = materialize(tensor, device="cuda")
        assert value.is_cuda
        _assert_identical(value.cpu(), _tensors(reference)[key], key)


def test_delay_param_initialization_takes_smp_v1_enabled_flag() -> None:
    import shardpar as smp

    with smp.delay_param_initialization(enabled=True):
        delayed = nn.Linear(3, 2)
    with smp.delay_param_initialization(enabled=False):
        eager = nn.Linear(3, 2)
    assert is_deferred(delayed.weight) and not is_deferred(eager.weight)
    assert eager.weight.abs().sum() > 0  # initialised now, with real memory
