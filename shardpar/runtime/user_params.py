"""The parameters a user sees: one ShardedTensor parameter per original parameter, on the modules
outside forward, swapped for the compute parameters while a unit's forward runs ([Note: sharded
parameters] in sharded_tensor.py), and their `.grad`: the sharded main gradient.

[Note: two parameters per original]
Every original parameter has two objects:
  * the *compute* parameter -- the object the user built. Its `.data` is a view of the unit's gathered
    buffer while the unit is unsharded and an empty tensor otherwise (unit.py); autograd, the
    gradient hooks and the reducer work on it;
  * the *user* parameter -- a ShardedTensor parameter with the global shape over this rank's piece of
    the fp32 main shard. `model.parameters()`, `state_dict(keep_vars=True)`, optimizers, PEFT and
    HF's `num_parameters()` see it.
Each module holds the user parameter, except between a unit's forward pre-hook and its post-hook, when
the unit's modules (and those of the units it borrows from) hold the compute parameters -- FSDP2's
`to_unsharded` / `to_sharded` (`_fsdp_param.py`). A reference to a parameter taken before wrapping is
the compute one (smp.register_parameter, tied weights kept as plain attributes): it still computes.
The same holds from a unit's pre-backward hook until its gradients are reduced (FSDP2 unshards in
pre-backward too): a recomputation that calls `forward` without module hooks (transformers' gradient
checkpointing wraps `forward`) reads the compute parameters from the modules. `refs` counts the
forwards and backwards that need a unit's compute parameters (a borrower's forward runs inside its
lender's), so an inner post-hook does not take them away from an outer forward; a forward that raised
leaves them counted, so the root's next forward, and the end of every backward, start from zero (`reset`).

[Note: user gradients]
After every backward the user parameters' `.grad` are ShardedTensor views of the main grads (the
sum of the window's backwards so far; AllReduced over the replication group once the window ends),
None where a parameter got no gradient in the window. Plain PyTorch idioms on them act on the main
grads: `p.grad.mul_(s)` scales them, `clip_grad_norm_` clips them, `p.grad = None` (zero_grad of any
optimizer, `model.zero_grad()`) drops them -- `sync` reads the user grads back before the next
backward adds to the main grads and before a step, so a dropped grad is neither accumulated into
nor stepped, as with plain PyTorch.

[Note: a user's own clip]
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` takes a norm of the `.grad`s (one
collective for the sharded ones, sharded_tensor.py) and then multiplies them in place. The gradients'
layouts report both to `GradClipWatch`: a norm read, then a write, after the window's last backward is
a clip the user ran, and `DistributedOptimizer.step()` then leaves its built-in clipping out for that
step (optim/clipping.py), as a script ported from DDP or FSDP2 expects. A norm alone (logging it) is
not a clip; a backward after it starts over. The gradients carry the fp16 loss scale until step()
divides it out, so with a scale other than 1 a norm of them is refused: it would be the scaled one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from shardpar.runtime.persistent import PersistentParams
from shardpar.runtime.replica_shard import ReplicaShard
from shardpar.runtime.sharded_tensor import ShardComm, ShardedTensor, ShardLayout, sharded_parameter
from shardpar.runtime.state import ShardedState
from shardpar.runtime.unit import Unit
from shardpar.sharding.tp_split import TPSplit

_Location = tuple[nn.Module, str]
_GradHolder = Unit | PersistentParams | ReplicaShard


class GradClipWatch:
    """Whether the user clipped the gradients since the last backward ([Note: a user's own clip])."""

    def __init__(self, loss_scale: Callable[[], float]) -> None:
        self._loss_scale = loss_scale
        self._norm_read = False
        self.clipped = False

    def norm_read(self) -> None:
        scale = self._loss_scale()
        if scale != 1.0:
            raise ValueError(
                f"a norm of the gradients of a model trained with an fp16 loss scale of {scale:g}: they are scaled "
                "until optimizer.step() divides the scale out, so the norm (and a clip by it) would be the scaled "
                "one. Clip with optimizer.clip_master_grads(max_norm) (or accelerator.clip_grad_norm_), which "
                "divide the scale out first"
            )
        self._norm_read = True

    def written(self) -> None:
        if self._norm_read:
            self.clipped = True

    def reset(self) -> None:
        self._norm_read = self.clipped = False


class UserParams:
    def __init__(
        self,
        root: nn.Module,
        state: ShardedState,
        units: list[Unit],
        persistent: PersistentParams,
        *,
        unit_of_persistent: Mapping[int, int],
        comm: ShardComm,
        tp_splits: Mapping[str, TPSplit] | None,
        tp_rank: int,
        loss_scale: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self._state = state
        self.clip_watch = GradClipWatch(loss_scale)
        self._units = units
        self._persistent = persistent
        self.pieces = state.pieces
        locations = _locations(root)
        self.user: list[ShardedTensor] = []  # in pieces order
        self._grad_layouts: list[ShardLayout] = []
        self._by_unit: list[list[tuple[list[_Location], nn.Parameter, ShardedTensor]]] = [[] for _ in units]
        for piece in self.pieces:
            split = (tp_splits or {}).get(piece.fqn)
            layout = ShardLayout(
                fqn=piece.fqn,
                shape=torch.Size(split.full_shape(piece.shape) if split else piece.shape),
                local_shape=piece.shape,
                start=piece.start,
                length=piece.length,
                sharded=piece.sharded,
                comm=comm,
                tp=split,
                tp_rank=tp_rank,
                on_write=state.mark_written,
                before_write=state.will_write,
                on_use=None if (frozen := state.quantized_frozen(piece)) is None else frozen.read_values,
            )
            # Writing a grad does not change the parameters (nor wait for a checkpoint's staging); a norm
            # and then a write is a user's clip.
            watch = self.clip_watch
            grads = dataclasses.replace(layout, on_write=watch.written, on_norm=watch.norm_read, before_write=None)
            self._grad_layouts.append(grads)
            user = sharded_parameter(state.main(piece), layout, requires_grad=piece.param.requires_grad)
            self.user.append(user)
            state.add_user(piece, user)
            unit = piece.unit if piece.sharded else unit_of_persistent[id(piece.param)]
            self._by_unit[unit].append((locations[id(piece.param)], piece.param, user))
        self.user_of = {id(p.param): u for p, u in zip(self.pieces, self.user, strict=True)}
        self._index = {id(u): i for i, u in enumerate(self.user)} | {id(p.param): i for i, p in enumerate(self.pieces)}
        self.refs = [0] * len(units)
        self._in_backward = [False] * len(units)
        self._published: list[torch.Tensor | None] = [None] * len(self.pieces)
        self.reset()

    def index_of(self, p: torch.Tensor) -> int | None:
        """The piece index of a user or compute parameter (None: not this model's)."""
        return self._index.get(id(p))

    # ---- which object the modules hold ----------------------------------------------------------

    def enter(self, unit: Unit) -> None:
        """A forward of `unit` starts: its modules (and its lenders') hold the compute parameters."""
        for u in (unit, *unit.deps):
            self.refs[u.index] += 1
            if self.refs[u.index] == 1:
                self._install(u.index, compute=True)

    def exit(self, unit: Unit) -> None:
        for u in (unit, *unit.deps):
            if self.refs[u.index] > 0:
                self.refs[u.index] -= 1
                if self.refs[u.index] == 0:
                    self._install(u.index, compute=False)

    def enter_backward(self, unit: Unit) -> None:
        """The unit's backward starts (its pre-backward hook, once per backward): its modules hold the
        compute parameters until its grads are reduced -- a recomputation that calls `forward` without
        the module hooks (transformers' gradient checkpointing) reads them from the modules."""
        if not self._in_backward[unit.index]:
            self._in_backward[unit.index] = True
            self.enter(unit)

    def exit_backward(self, unit: Unit) -> None:
        if self._in_backward[unit.index]:
            self._in_backward[unit.index] = False
            self.exit(unit)

    def reset(self) -> None:
        """Every module holds the user parameters (a forward starts, a backward ended; see the Note)."""
        for i in range(len(self._units)):
            self.refs[i] = 0
            self._in_backward[i] = False
            self._install(i, compute=False)

    def _install(self, unit: int, *, compute: bool) -> None:
        for locations, compute_param, user in self._by_unit[unit]:
            if compute and user.requires_grad != compute_param.requires_grad:
                raise ValueError(
                    f"{user.shard_layout.fqn}: requires_grad was set to {user.requires_grad} after "
                    f"smp.DistributedModel wrapped the model (it was {compute_param.requires_grad}); the sharded "
                    "gradient plan is made at wrapping, and a parameter frozen then keeps no fp32 main copy, "
                    "gradient or optimizer state ([Note: frozen shards], frozen.py), so freeze or unfreeze "
                    "parameters before wrapping"
                )
            param = compute_param if compute else user
            for module, name in locations:
                _set_param(module, name, param)  # type: ignore[arg-type]  # user: a ShardedTensor parameter

    # ---- gradients ([Note: user gradients]) -------------------------------------------------------

    def publish_grads(self, unused: Iterable[int] = ()) -> None:
        """After a backward: each user parameter's `.grad` views its main grad (None where there is
        none, or for the compute parameters whose ids are in `unused`)."""
        skip = set(unused)
        self.clip_watch.reset()  # new gradients: a clip before this backward did not cover them
        for i, (piece, user) in enumerate(zip(self.pieces, self.user, strict=True)):
            grad = None if id(piece.param) in skip or not user.requires_grad else self._state.grad(piece)
            if grad is None:
                user.grad = None
                self._published[i] = None
                continue
            if self._published[i] is None or user.grad is not self._published[i] or _stale(user.grad, grad):
                user.grad = ShardedTensor(grad, self._grad_layouts[i])
                self._published[i] = user.grad
        return None

    def sync(self) -> set[int]:
        """Read back what the user did to the `.grad`s since `publish_grads`: a dropped grad zeroes its
        piece of the main grad (all of it dropped: the main grad goes), a replaced one is copied in.
        Returns the ids of the compute parameters without a grad now."""
        dropped: set[int] = set()
        for holder, idx in self._holders():
            if holder.main_grad is None and all(self.user[i].grad is None for i in idx):
                dropped.update(id(self.pieces[i].param) for i in idx)
                continue
            if all(self.user[i].grad is None for i in idx):
                holder.main_grad = None
                dropped.update(id(self.pieces[i].param) for i in idx)
                continue
            for i in idx:
                self._adopt(i, holder, dropped)
        return dropped

    def _adopt(self, i: int, holder: _GradHolder, dropped: set[int]) -> None:
        piece, user = self.pieces[i], self.user[i]
        grad = user.grad
        if grad is self._published[i] and grad is not None:
            return
        if holder.main_grad is None:
            holder.main_grad = torch.zeros_like(holder.main_shard if isinstance(holder, Unit) else holder.main)
        target = self._state.grad(piece)
        if target is None:
            raise AssertionError(f"{piece.fqn}: no main grad after it was made")
        if grad is None:
            target.zero_()
            dropped.add(id(piece.param))
        elif isinstance(grad, ShardedTensor):
            target.copy_(grad.local_piece.reshape(target.shape))
        else:
            target.copy_(user.shard_layout.piece_of(grad).reshape(target.shape))
        user.grad = ShardedTensor(target, self._grad_layouts[i])
        self._published[i] = user.grad

    def clear_grads(self) -> None:
        self.clip_watch.reset()
        for i, user in enumerate(self.user):
            user.grad = None
            self._published[i] = None

    def _holders(self) -> list[tuple[_GradHolder, list[int]]]:
        """Each holder of the grads an optimizer steps, with the indices of its trainable pieces: a unit's
        main grad, or with shard_optimizer_state its replica piece's (runtime/replica_shard.py); the
        persistent one."""
        by_holder: dict[int, list[int]] = {}
        for i, piece in enumerate(self.pieces):
            if piece.param.requires_grad:
                by_holder.setdefault(piece.unit, []).append(i)
        return [(self._stepped(u), idx) for u, idx in by_holder.items()]

    def _stepped(self, unit: int) -> _GradHolder:
        if unit < 0:
            return self._persistent
        holder = self._units[unit]
        return holder.replicas.grad_holder(holder)


def _stale(published: torch.Tensor | None, grad: torch.Tensor) -> bool:
    """Whether a published grad no longer views `grad` (the main grad was replaced by a new tensor)."""
    if not isinstance(published, ShardedTensor):
        return True
    return bool(published.local_piece.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr())


def _locations(root: nn.Module) -> dict[int, list[_Location]]:
    """id(parameter) -> every (module, attribute) that holds it (a tied parameter has several)."""
    out: dict[int, list[_Location]] = {}
    for _, module in root.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                where = out.setdefault(id(p), [])
                if all(m is not module or n != name for m, n in where):
                    where.append((module, name))
    return out


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """`setattr(module, name, param)` without nn.Module.__setattr__'s checks where the module does not
    override it (FSDP2's unsafe_setattr_param: it runs for every parameter of every forward)."""
    if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)
