"""The gradient ReduceScatter of a sharding group that spans nodes, in two hops (issue 28).

[Note: two-hop ReduceScatter]
A flat ReduceScatter over a group of L ranks on each of N nodes sends every rank's whole bucket
around the group, so (N-1)/N of the model crosses the network from every rank -- L times what must
(and gloo's ReduceScatter, an AllReduce underneath, doubles it again: [Note: ReduceScatter by
exchange], native.py). In two hops only one node's worth crosses:

    node hop   ReduceScatter over the node's L members ("sharding_node_reduce", shm or loopback):
               local rank j gets the node's sum of the rows of every rank at local position j,
               [N, width] -- rows (node 0, j), (node 1, j), ...
    cross hop  ReduceScatter of that over the N members at local position j ("sharding_cross"):
               rank (n, j) gets row (n, j) summed over every node -- its reduced shard.

Bytes crossing nodes per rank: (N-1)/N of bucket / L, the minimum. For the node hop to hand local
rank j a contiguous [N, width] block, the bucket is laid out local-major in memory -- [L][N][width] --
while units pack into it through a transposed view indexed in the sharding group's order (node-major:
shard s = node * L + local), so nothing is copied to reorder it (`bucket_rows`). Where the engine reads
the ReduceScatter input in place (smddp inside a node), the spans are listed in local-major order.

The cross hop of bucket b is issued when bucket b+1's node hop is (or at `finish`, for the last): a
fixed point in every rank's sequence of collectives, whatever the node hops' timing -- a cross hop
issued "when its node hop completes" would interleave differently with the gathers that share its
process group on different ranks. The node hop of b has had a bucket of backward to complete by then.

[Note: cross hop at the boundary]
With `sdp_defer_cross_node_reduce`, a backward inside an accumulation window does only the node hop and
adds its result (x the window's grad scale) into a per-bucket fp32 partial, [N, width]; the backward
that ends the window adds its own node sum and sends the partial across nodes once. Cross-node bytes
per step: one ReduceScatter instead of one per backward (MiCS's 2-hop idea applied to a spanning
group). The price: the partials, N x the sharded gradients in fp32 per rank, live through the window
(shardpar estimate counts them), and a unit's main grad holds nothing until the boundary -- nothing
reads it before then (a step or a save inside a window is refused; zero_grad drops the partials).
The sum is the same up to rounding order: node sums first, then micro-batches, then nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shardpar.collectives import CompletedWork, Engine, Group, ReduceOp, Span, Work
from shardpar.collectives import quantize as q8


@dataclass
class CrossInflight:
    """A cross hop in flight, or a node hop whose result went into the partials (work complete, no out)."""

    bucket: int
    work: Work
    out: torch.Tensor | None  # this rank's reduced row; None: nothing for the main grads this backward
    factor: float  # what `out` enters the main grads with


@dataclass
class _NodeHop:
    bucket: int
    work: Work
    out: torch.Tensor  # [N * width]: the node's sums of this local position's rows


@dataclass
class TwoHopReduce:
    engine: Engine
    node: Group  # this rank's sharding-group members on its node, in local order
    cross: Group  # the members at this rank's local position on each node, in node order
    reduce_dtype: torch.dtype
    device: torch.device
    defer: bool  # sdp_defer_cross_node_reduce
    quantize: bool = False  # sdp_quantize_cross_node_gradients ([Note: cross-node quantization])
    _pending: _NodeHop | None = None
    # sdp_quantize_cross_node_gradients: what quantization dropped from each bucket's node sums, [N, width]
    _residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    _partials: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket -> fp32 [N * width]
    _boundary: bool = True
    _scale: float = 1.0

    @property
    def num_local(self) -> int:
        return self.node.size

    @property
    def num_nodes(self) -> int:
        return self.cross.size

    def begin_backward(self, *, boundary: bool, scale: float) -> None:
        self._pending, self._boundary, self._scale = None, boundary, scale

    def drop_partials(self) -> None:
        """zero_grad inside a window: the deferred sums go with the rest of the window's gradients."""
        self._partials.clear()

    @property
    def partial_numel(self) -> int:
        return sum(p.numel() for p in self._partials.values())

    def bucket_buffer(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(memory [L, N, width], its rows in sharding order [N, L, width]) -- see the Note."""
        mem = torch.empty(self.num_local, self.num_nodes, width, dtype=self.reduce_dtype, device=self.device)
        return mem, mem.transpose(0, 1)

    def shard_order(self) -> list[int]:
        """The sharding group's shard indices in local-major order (the in-place spans' row order)."""
        local, nodes = self.num_local, self.num_nodes
        return [n * local + j for j in range(local) for n in range(nodes)]

    def issue(self, bucket: int, width: int, packed: torch.Tensor | Sequence[Span]) -> CrossInflight | None:
        """Start bucket `bucket`'s node hop (of a [L, N, width] buffer, or spans in local-major order) and
        complete the previous bucket's (its cross hop, or its partial); returns that previous one."""
        out = torch.empty(self.num_nodes * width, dtype=self.reduce_dtype, device=self.device)
        if isinstance(packed, torch.Tensor):
            work = self.engine.reduce_scatter(out, packed.view(-1), self.node, op=ReduceOp.SUM, async_op=True)
        else:
            work = self.engine.reduce_scatter_spans(out, packed, self.node, op=ReduceOp.SUM, async_op=True)
        previous, self._pending = self._pending, _NodeHop(bucket, work, out)
        return None if previous is None else self._cross(previous)

    def finish(self) -> CrossInflight | None:
        """End of backward: the last bucket's cross hop (or partial)."""
        previous, self._pending = self._pending, None
        return None if previous is None else self._cross(previous)

    def _cross(self, hop: _NodeHop) -> CrossInflight:
        hop.work.wait()
        sdp = self.num_local * self.num_nodes
        if self.defer:
            partial = self._partials.get(hop.bucket)
            if not self._boundary:  # inside the window: keep the node sum, send nothing
                if partial is None:
                    self._partials[hop.bucket] = hop.out.float().mul_(self._scale)
                else:
                    partial.add_(hop.out, alpha=self._scale)
                return CrossInflight(hop.bucket, CompletedWork(), None, 0.0)
            if partial is not None:  # the window's earlier sums and this one, rounded once to the reduce dtype
                del self._partials[hop.bucket]
                torch.add(partial, hop.out, alpha=self._scale, out=partial)
                send = partial if self.reduce_dtype == torch.float32 else partial.to(self.reduce_dtype)
                return self._send(hop.bucket, send, factor=1.0 / sdp)
            return self._send(hop.bucket, hop.out, factor=self._scale / sdp)
        return self._send(hop.bucket, hop.out, factor=self._scale / sdp)

    def _send(self, bucket: int, node_sums: torch.Tensor, *, factor: float) -> CrossInflight:
        width = node_sums.numel() // self.num_nodes
        out = torch.empty(width, dtype=self.reduce_dtype, device=self.device)
        if self.quantize:
            return CrossInflight(bucket, self._send_quantized(bucket, node_sums, out), out, factor)
        work = self.engine.reduce_scatter(out, node_sums, self.cross, op=ReduceOp.SUM, async_op=True)
        return CrossInflight(bucket, work, out, factor)

    @property
    def residual_numel(self) -> int:
        return sum(r.numel() for r in self._residuals.values())

    def _send_quantized(self, bucket: int, node_sums: torch.Tensor, out: torch.Tensor) -> Work:
        """The cross hop as an AllToAll of int8 node blocks with error feedback ([Note: cross-node
        quantization]); `out` gets the fp32 sum of the dequantized blocks, in node order."""
        nodes, width = self.num_nodes, out.numel()
        x = node_sums.view(nodes, width).to(torch.float32, copy=True)
        residual = self._residuals.get(bucket)
        if residual is not None:
            x += residual
        q, scales = q8.quantize(x)
        self._residuals[bucket] = x.sub_(q8.dequantize(q, scales, width, torch.float32))  # x is now the error
        q_in, scales_in = torch.empty_like(q), torch.empty_like(scales)
        works = [
            self.engine.all_to_all(q_in.view(-1), q.view(-1), self.cross, async_op=True),
            self.engine.all_to_all(scales_in.view(-1), scales.view(-1), self.cross, async_op=True),
        ]

        def finish() -> None:
            out.copy_(q8.dequantize(q_in, scales_in, width, torch.float32).sum(dim=0))

        return q8.FinishingWork(works, finish)
