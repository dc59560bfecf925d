"""DistributedOptimizer: any torch.optim optimizer, re-pointed at this rank's fp32 main shards.

Each original parameter of a param group is replaced by the leaf the optimizer steps for it ([Note:
how the optimizer sees the shards] below), so param groups, hyperparameters and LR schedulers keep
working on the same optimizer object. A list of optimizers (Muon for the matrices, AdamW for the rest)
is stepped as one (chained.py). The model's state is reached through one interface, OptimizerState
(sharded_state.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardpar.optim.chained import OptimizerList
from shardpar.optim.clipping import KNOB, Clipping
from shardpar.optim.grad_norm import grad_norm_squared, local_grad_norm_squared, reduce_grad_norm_squared
from shardpar.optim.kinds import check_optimizer, is_elementwise, owner_kind
from shardpar.optim.loss_scaling import LossScaler, ScalerResume, StaticLossScaler, plan_scaler_resume
from shardpar.optim.nonfinite import NonFiniteGuard, gather_culprits
from shardpar.optim.nonfinite import log as nonfinite_log
from shardpar.optim.optimizer_v1 import OptimizerV1Mixin
from shardpar.optim.owner_compute import OwnerCompute
from shardpar.optim.sharded_state import OptimizerState, Piece, ShardedState
from shardpar.precision import precision_name
from shardpar.runtime.model import DistributedModel
from shardpar.sharding.tp_split import TPSplit


class DistributedOptimizer(OptimizerV1Mixin, torch.optim.Optimizer):
    """A torch.optim.Optimizer (so LR schedulers accept it) that delegates to the wrapped optimizer.

    `Optimizer.__init__` is deliberately not called: param groups, state and defaults are the inner
    optimizer's, exposed as properties.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | tuple[torch.optim.Optimizer, ...],
        model: DistributedModel,
        *,
        clip_norm: float,
        clip_owner: str = KNOB,
        loss_scaler: LossScaler | None = None,
        tp_splits: Mapping[str, TPSplit] | None = None,
        max_nonfinite_steps: int | None = None,
    ) -> None:
        """`tp_splits`: the model's TP-split parameters by name (tensor_parallel.tp_split_table), passed
        in by the caller under tensor parallelism; None or empty without it. `max_nonfinite_steps`:
        consecutive non-finite steps skipped before step() raises (None: the model's config knob
        sdp_max_nonfinite_steps; [Note: non-finite steps] in nonfinite.py). `clip_norm` and `clip_owner`: the
        clipping in force ([Note: clipping belongs to the user's front end] in clipping.py)."""
        self.view = OptimizerState(model, tp_splits)  # the optimizer's one way into the model's state
        if tp_splits is None and self.view.topology.tp.size > 1:  # the plain norm would differ per TP rank
            raise ValueError(
                f"DistributedOptimizer of a model with tensor_parallel_degree={self.view.topology.tp.size} needs its "
                "TP split table (tp_splits=tensor_parallel.tp_split_table(model.module)); smp.DistributedOptimizer "
                "passes it"
            )
        if isinstance(optimizer, (list, tuple)):
            optimizer = OptimizerList(optimizer)
        inner = optimizer.optimizers if isinstance(optimizer, OptimizerList) else [optimizer]
        for o in inner:
            check_optimizer(o)  # LBFGS, SparseAdam
        self.optimizer: torch.optim.Optimizer = optimizer
        self.model = model  # which model this optimizer steps (the facade and integrations compare it)
        self._clipped_by_user = False  # clip_master_grads ran in this window: step() does not clip again
        self._clipping = Clipping(clip_norm, clip_owner)
        self.tp_splits = tp_splits
        self.loss_scaler = loss_scaler or StaticLossScaler(1.0)  # the window reads its scale from here on
        self.overflow = False  # fp16: the last step overflowed (and was skipped)
        self.skipped = False  # the last step was skipped (fp16 overflow, or non-finite in bf16/fp32)
        limit = self.view.max_nonfinite_steps if max_nonfinite_steps is None else max_nonfinite_steps
        self.nonfinite_guard = NonFiniteGuard(limit)
        self.num_steps = 0  # step() calls that got past the window check, skipped ones included
        self._main_piece: dict[int, torch.Tensor] = {}  # leaf stepped for a compute or user parameter id
        self._grad_slots: list[tuple[torch.Tensor, Piece]] = []  # (main piece, where it lies) of trainable params
        self.owners: list[OwnerCompute] = []  # one per optimizer that is not element-wise
        self._build_pieces(inner)
        self._repoint_groups()
        self.last_grad_norm: torch.Tensor | None = None

    def _build_pieces(self, inner: list[torch.optim.Optimizer]) -> None:
        """[Note: how the optimizer sees the shards]
        An element-wise optimizer (optim/kinds.py) steps plain 1-D leaves aliasing this rank's pieces of
        the main shards: foreach kernels, no dispatch in between, no communication. Any other optimizer
        steps each sharded parameter whole on one owner rank ([Note: owner compute], owner_compute.py):
        its leaf is the whole parameter there and empty elsewhere. Persistent parameters are whole on
        every rank: every rank steps them as they are, whatever the optimizer."""
        view = self.view
        user_of = {id(where.param): u for where, u in zip(view.pieces, view.users, strict=True)}
        for o in inner:
            if is_elementwise(o):
                continue
            ids = {id(p) for g in o.param_groups for p in g["params"]}
            whole = [
                w
                for w in view.pieces
                if w.sharded and not w.frozen and (id(w.param) in ids or id(user_of[id(w.param)]) in ids)
            ]
            self.owners.append(OwnerCompute(self.view, whole, owner_kind(o)))
        owned = {k: v for oc in self.owners for k, v in oc.leaves().items()}
        for where in view.pieces:
            p, user = where.param, user_of[id(where.param)]
            piece = owned.get(id(p))
            if piece is None:
                piece = nn.Parameter(view.main(where), requires_grad=p.requires_grad)
                if p.requires_grad:
                    self._grad_slots.append((piece, where))
            self._main_piece[id(p)] = piece
            self._main_piece[id(user)] = piece

    def _repoint_groups(self) -> None:
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it with smp.DistributedOptimizer before its first step"
            )
        names = self.view.param_names()
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if id(p) not in self._main_piece:
                    raise ValueError(
                        f"optimizer parameter {names.get(id(p), tuple(p.shape))} does not belong to the "
                        "DistributedModel; build the optimizer from model.parameters() after wrapping"
                    )
                new_params.append(self._main_piece[id(p)])
            group["params"] = new_params

    @property
    def sharded_state(self) -> ShardedState:
        """The model's sharded state (checkpoints read it); optim/ itself goes through `view`."""
        return self.view.sharded

    # ---- step ---------------------------------------------------------------------------------

    def _attach_grads(self, dropped: set[int]) -> None:
        """Point each stepped leaf's .grad at its main grad; None for a parameter without a gradient in
        the window ([Note: unused params] in model.py) or whose user grad was dropped (`dropped`)."""
        skip = self.view.without_grad(dropped)
        for piece, where in self._grad_slots:
            piece.grad = None if id(where.param) in skip else self.view.grad(where)
        for owners in self.owners:
            owners.gather(skip)  # after the clip: the owners see the clipped gradients

    # ---- clipping ([Note: clipping belongs to the user's front end], clipping.py) ---------------

    @property
    def clipping(self) -> Clipping:
        """The clipping in force: what `step()` clips to and whose rule that is (`str()` of it is a log
        line). A clip the user runs in a window replaces it for that step (`clipped_by_user`)."""
        return self._clipping

    def set_clipping(self, max_norm: float, owner: str) -> None:
        """Hand the built-in clipping to a front end: `owner` TRAINER (max_grad_norm) or ACCELERATE (0).
        Rank 0 logs the change: the wrap summary named the knob's clipping before the front end took over."""
        self._clipping = Clipping(float(max_norm), owner)
        if self.view.topology.rank == 0:
            logging.getLogger("shardpar").info("clipping in force: %s", self._clipping)

    @property
    def clip_norm(self) -> float:
        """What `step()` clips to (0: it does not); `clipping` says whose rule it is."""
        return self._clipping.max_norm

    @property
    def clipped_by_user(self) -> bool:
        """A clip ran in the open window (clip_master_grads, accelerator.clip_grad_norm_, or
        torch.nn.utils.clip_grad_norm_ on the model's parameters): `step()` does not clip again."""
        return self._clipped_by_user or self.view.user_clipped

    def grad_norm_squared(self) -> torch.Tensor:
        """Squared global L2 norm of the (still scaled) grads: every element counted once.

        One AllReduce over the sharding group: shards are disjoint inside it; persistent grads are the
        same on every rank after their rdp AllReduce, so only sharding-group position 0 adds them.
        Replicas hold identical main grads after the boundary AllReduce, so they agree without
        talking. An inf/nan anywhere makes the sum non-finite on every rank: the overflow check.
        A tensor-parallel model sums its TP-split grads over the TP group too and counts TP-replicated
        ones once (shardpar/optim/grad_norm.py).
        """
        return grad_norm_squared(self.view, self.tp_splits)

    def _unscale_and_clip(self, sq: torch.Tensor, scale: float, clip_norm: float) -> torch.Tensor:
        """Divide out the loss scale the gradients carry and apply sdp_gradient_clipping, as one
        multiply per grad.

        The clip coefficient is torch.nn.utils.clip_grad_norm_'s formula (parity with a single-process
        run); it stays a tensor, so there is no host sync here.
        """
        inv_scale = 1.0 / scale
        norm = sq.sqrt() * inv_scale
        coef = torch.full_like(norm, inv_scale)
        if clip_norm > 0:
            coef = coef * torch.clamp(clip_norm / (norm + 1e-6), max=1.0)
        if clip_norm > 0 or inv_scale != 1.0:
            for grad in self.view.main_grads():
                grad.mul_(coef)
        return norm[0]

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure (the model is sharded)")
        self.view.check_step()  # before anything changes
        # What the user did to the parameters' .grad since backward ([Note: user gradients],
        # runtime/user_params.py): a dropped grad is zeroed, so the norm below leaves it out too.
        dropped = self.view.sync_user_grads()
        self.num_steps += 1
        # The norm is computed at every step (one AllReduce of one float when neither clipping nor a
        # loss scale needed it): the non-finite guard reads it ([Note: non-finite steps], nonfinite.py).
        parts = local_grad_norm_squared(self.view, self.tp_splits)
        local_finite = torch.isfinite(parts).all()  # before the AllReduce overwrites them; no sync
        sq = reduce_grad_norm_squared(self.view, parts, self.tp_splits)
        scale = self.loss_scaler.loss_scale  # what this window's backwards multiplied the loss by
        # The only host sync of the step: an inf/nan on any rank makes the norm non-finite on every
        # rank alike, so each decides the skip the same way without talking.
        finite = bool(torch.isfinite(sq).all().item())
        if self.view.compute_dtype == torch.float16:
            # fp16, whatever the scale and clipping: the loss scaler's rule, without a limit.
            self.overflow = self.skipped = not finite
            self.loss_scaler.update(self.overflow)
            if self.overflow:
                self._end_step()
                return None
        elif not finite:
            return self._skip_nonfinite(sq, local_finite)
        else:
            self.skipped = False
            self.nonfinite_guard.passed()
        # `scale`, not the scaler's: a dynamic scaler that just grew its scale (update above) must not
        # divide these gradients, scaled by the old one, by the new one.
        clip_norm = 0.0 if self.clipped_by_user else self.clip_norm
        self.last_grad_norm = self._unscale_and_clip(sq, scale, clip_norm)
        # From here on the main values and the optimizer state change (owner compute re-reads its whole
        # values in _attach_grads): an async checkpoint still copying them finishes first ([Note: writes
        # wait for staging] in runtime/write_guard.py). Not earlier: the norm's AllReduce overlaps the copy.
        self.view.will_write("DistributedOptimizer.step()")
        self._attach_grads(dropped)
        result = self.optimizer.step()
        for owners in self.owners:
            owners.scatter()
        self.view.refresh_compute()
        for owners in self.owners:
            owners.mark_values_current()
        self._end_step()
        return result

    def _skip_nonfinite(self, sq: torch.Tensor, local_finite: torch.Tensor) -> None:
        """bf16/fp32: skip the step on every rank (nothing is written), name the ranks, count the skip;
        past sdp_max_nonfinite_steps in a row, raise NonFiniteError on every rank."""
        topology = self.view.topology
        culprits = gather_culprits(
            self.view.engine,
            topology.group("world"),
            topology.rank,
            loss_bad=self.view.nonfinite_losses > 0,
            shard_bad=~local_finite,
        )
        self.skipped = True
        self.last_grad_norm = sq.sqrt()[0]
        norm = float(self.last_grad_norm)
        self._end_step()
        message = self.nonfinite_guard.skip(step=self.num_steps, norm=norm, culprits=culprits)
        if topology.rank == 0:  # once per skipped step, not once per rank
            nonfinite_log.warning("shardpar: %s", message)
        return None

    def _end_step(self) -> None:
        self._clipped_by_user = False
        self.view.end_step()  # the window just stepped (or skipped) is over: its losses, a clip of it

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's zero_grad (the one implementation: the window, its losses, the main and user
        grads), then the .grad of the leaves this optimizer steps."""
        self._clipped_by_user = False
        self.view.zero_grad(set_to_none)
        for piece, _ in self._grad_slots:
            piece.grad = None
        for owners in self.owners:
            for leaf in owners.leaves().values():
                leaf.grad = None

    def owned_leaves(self) -> list[tuple[str, nn.Parameter, bool]]:
        """(fqn, leaf, whether this rank owns it) of every parameter stepped whole on an owner."""
        return [(o.piece.fqn, o.leaf, o.owner == oc.me) for oc in self.owners for o in oc.owned]

    def main_piece(self, p: torch.Tensor) -> torch.Tensor | None:
        """The leaf the inner optimizer steps for original parameter `p` (its local main shard)."""
        return self._main_piece.get(id(p))

    # ---- torch.optim surface ------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (for its shards) in torch.optim's format, plus the loss scaler."""
        return {**self.optimizer.state_dict(), "loss_scaler": self.loss_scaler_state()}

    def load_state_dict(self, state_dict: dict[str, Any], gather_if_shard: bool = True) -> None:
        """Load `state_dict()`; the loss scaler follows [Note: loss scaler on resume] (loss_scaling.py),
        decided (and a malformed scaler state rejected) before anything is loaded. SMP v1's
        `gather_if_shard` changes nothing (local_state_dict never gathers: each rank loads its own)."""
        state = dict(state_dict)
        state.pop("_smp_is_partial", None)  # SMP v1's marker on local_state_dict()
        scaler = state.pop("loss_scaler", None)
        plan = self.plan_loss_scaler_load(scaler) if scaler is not None else None
        self.view.will_write("DistributedOptimizer.load_state_dict()")
        self.optimizer.load_state_dict(state)
        if plan is not None:
            self.load_loss_scaler_state(scaler, plan)

    # ---- SMP v1 ----------------------------------------------------------------------------------

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """SMP v1 (fp16 scripts call it before `step()`): clip the fp32 main grads by their global L2
        norm, the loss scale divided out, to `max_norm`; returns that norm. `step()` then does not clip
        this window again (sdp_gradient_clipping would otherwise clip a second time). A non-finite norm
        is left to `step()`, which skips the update."""
        if norm_type != 2.0:
            raise ValueError(f"clip_master_grads(norm_type={norm_type!r}): only the L2 norm (2.0) is supported")
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"clip_master_grads(max_norm={max_norm!r}) must be a number > 0")
        norm = self.grad_norm_squared().sqrt() / self.loss_scaler.loss_scale
        if bool(torch.isfinite(norm).all()):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s formula
            for grad in self.view.main_grads():
                grad.mul_(coef)
        self._clipped_by_user = True
        return norm[0]

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """SMP v1: the model's own parameters, grouped as the optimizer's param groups (scripts map
        them to names with `model.named_parameters()`)."""
        original = {id(piece): p for p, piece in self._originals()}
        return [[original[id(piece)] for piece in group["params"]] for group in self.optimizer.param_groups]

    def _originals(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(user parameter, the leaf the optimizer steps for it) per parameter."""
        view = self.view
        return [(u, self._main_piece[id(where.param)]) for where, u in zip(view.pieces, view.users, strict=True)]

    # ---- loss scaler ([Note: one owner of the loss scale], runtime/window.py) ----------------------

    @property
    def loss_scaler(self) -> LossScaler:
        """The fp16 loss scaler: the one owner of the loss scale, which `model.backward` reads through
        the window. Assigning another scaler hands the window that one."""
        return self._loss_scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler: LossScaler) -> None:
        self._loss_scaler = scaler
        self.view.use_scaler(scaler)

    def loss_scaler_state(self) -> dict[str, Any]:
        """The scaler's state and the precision it served, so a resume can tell whether it applies."""
        return {**self.loss_scaler.state_dict(), "precision": precision_name(self.view.compute_dtype)}

    def plan_loss_scaler_load(self, saved: dict[str, Any]) -> ScalerResume:
        """Whether `saved` applies to this run; ValueError naming the field when it is malformed."""
        return plan_scaler_resume(saved, self.loss_scaler, self.view.compute_dtype)

    def load_loss_scaler_state(self, saved: dict[str, Any], plan: ScalerResume) -> None:
        if plan.warning is not None:
            warnings.warn(plan.warning, stacklevel=3)
        if plan.apply:
            self.loss_scaler.load_state_dict(saved)  # model.backward multiplies by the loaded scale from now on

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise ValueError("add_param_group after wrapping is not supported; build all groups before wrapping")

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"
