"""Attention of a sequence slice against the keys and values of its earlier slices.

A sequence longer than any row that fits is cut into slices that run in different
microbatches (``dynmb.core.types``: ``Microbatch.offsets`` / ``continued``). On every stage,
slice j of a document attends causally to its own tokens and to all keys and values of
slices 0..j-1 at the same layer. Two pieces make that exact under pipeline execution:

``PrefixAttention`` (an ``autograd.Function``): exact softmax attention of one slice's
queries ``(heads, n, head_dim)`` over ``[prefix keys..., own keys]`` with the own part
causal (query i sees own keys <= i and every prefix key). Keys and values may have fewer
heads than the queries (grouped-query attention, ``kv_heads`` dividing ``heads``: query head
h reads K/V head ``h // (heads / kv_heads)``); they are saved and kept with ``kv_heads``
heads. On CPU it runs torch's fused flash-attention kernel once per part (each earlier
slice's keys without a mask, its own keys causal:
``aten._scaled_dot_product_flash_attention_for_cpu``, which also returns the log-sum-exp)
and merges the parts by their log-sum-exps, ``lse = logsumexp_i(lse_i)``, ``O = sum_i
exp(lse_i - lse) O_i``; the backward calls the kernel's backward per part with the merged
``O`` and ``lse`` (the gradient of a softmax split over key blocks, as ring attention does)
and sums the query gradients; the kernel takes grouped K/V as they are. Elsewhere (or
without that kernel) it runs over key blocks in plain torch with the online softmax of
FlashAttention: a running max ``m``, normaliser ``l`` and accumulator per query, so no ``(n,
prefix + n)`` score matrix or mask is ever held; own blocks skip the queries before them
(block-level causal skip). It saves ``q, k, v``, the output and the log-sum-exp (``heads *
n`` floats) plus references to the prefix tensors (storage shared with the earlier slices,
no copy). Backward is FlashAttention's: per block, ``P = exp(S - lse)``, ``dV = P^T dO``,
``dS = P * (dO V^T - rowsum(dO * O))``, ``dQ += dS K``, ``dK = dS^T Q`` (scaled); the prefix
blocks' ``dK``/``dV`` are the gradients of the earlier slices' keys and values. Grouped K/V
are repeated to the query heads for the blocks (a temporary) and their gradients summed back
over each group. Work ``n * prefix + n**2 / 2`` multiply-adds per head dimension, memory
linear in ``n``; measured about 2x slower than the fused kernel on CPU, which is why the
fused path is preferred.

``PrefixStore`` (one per rank and step): what a continued slice leaves for later ones. At
a slice's forward, each layer keeps its keys and values ``k, v`` (still attached to the
slice's graph) and hands later slices detached leaves ``k.detach().requires_grad_()``
(same storage). Later slices' backwards accumulate into the leaves' ``.grad``; since
backwards of one document run in reverse slice order, when slice j's backward starts the
leaves hold the complete gradient of its keys and values, and the runtime adds ``(k,
k_leaf.grad)``, ``(v, v_leaf.grad)`` as extra roots of that backward
(``backward_roots``), so the whole document's gradient is exact. A split backward's ``I``
computes only the gradients it is asked for, so it asks for the leaves the microbatch read
(``read_leaves``) and accumulates them itself (``dynmb.runtime.splitbackward``). Under full
recomputation (``dynmb.models.recompute.RecomputedBlock``) the forward builds no graph: the
recomputed keys and values are the roots instead (``keep`` during the recomputation
queues them, ``pop_pending`` hands them to the block's backward). ``release`` drops a
slice's entries after its backward and refuses an order in which a later slice's
backward has not run yet (its gradient would be missing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["PrefixAttention", "PrefixStore", "SliceOrderError", "prefix_attention", "KEY_BLOCK_ELEMENTS"]

KEY_BLOCK_ELEMENTS = 1 << 20
"""Score elements per key block (heads x queries x keys), bounding the block temporaries."""


class SliceOrderError(RuntimeError):
    """Slices of one document ran out of order (forward not in slice order, or a backward
    before a later slice's backward)."""


def _key_block(heads: int, queries: int) -> int:
    return max(64, KEY_BLOCK_ELEMENTS // max(1, heads * queries))


def _blocks(n: int, prefix_k: list[torch.Tensor], prefix_v: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor,
            width: int):
    """``(piece, start, end, causal_start)``: key blocks, prefix pieces first (index into the
    prefix list, ``causal_start`` None), then the own keys (piece -1, causal from ``start``)."""
    for i, pk in enumerate(prefix_k):
        for c in range(0, pk.shape[1], width):
            yield i, c, min(c + width, pk.shape[1]), None
    for c in range(0, n, width):
        yield -1, c, min(c + width, n), c


def _scores(q: torch.Tensor, kb: torch.Tensor, scale: float, causal_start: int | None) -> tuple[torch.Tensor, int]:
    """Scaled scores of the queries that see block ``kb`` (all, or from ``causal_start`` on)."""
    r0 = 0 if causal_start is None else causal_start
    s = torch.matmul(q[:, r0:], kb.transpose(-1, -2)) * scale
    if causal_start is not None:
        rows = torch.arange(r0, q.shape[1], device=q.device)[:, None]
        cols = torch.arange(r0, r0 + kb.shape[1], device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s, r0


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and _FLASH_CPU is not None and _FLASH_CPU_BACKWARD is not None


def _parts(k: torch.Tensor, v: torch.Tensor, prefix: tuple[torch.Tensor, ...], n_prefix: int):
    """``(keys, values, causal)`` of every part, batched ``(1, heads, len, head_dim)``, contiguous."""
    pieces = [(prefix[i], prefix[n_prefix + i], False) for i in range(n_prefix)] + [(k, v, True)]
    return [(a.unsqueeze(0).contiguous(), b.unsqueeze(0).contiguous(), c) for a, b, c in pieces]


def _fused_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: tuple[torch.Tensor, ...],
                   n_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    assert _FLASH_CPU is not None                  # the caller checked _fused()
    qb = q.unsqueeze(0).contiguous()
    outs, lses = [], []
    for kb, vb, causal in _parts(k, v, prefix, n_prefix):
        o, lse = _FLASH_CPU(qb, kb, vb, 0.0, causal)
        outs.append(o)
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(li - lse).unsqueeze(-1).to(o.dtype) * o for li, o in zip(lses, outs))
    return out[0], lse[0]


def _fused_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, prefix: tuple[torch.Tensor, ...], n_prefix: int):
    assert _FLASH_CPU_BACKWARD is not None         # the caller checked _fused()
    qb, ob, lb = q.unsqueeze(0).contiguous(), out.unsqueeze(0).contiguous(), lse.unsqueeze(0).contiguous()
    gb = d_out.unsqueeze(0).contiguous()
    dq = torch.zeros_like(qb)
    dks, dvs = [], []
    for kb, vb, causal in _parts(k, v, prefix, n_prefix):
        gq, gk, gv = _FLASH_CPU_BACKWARD(gb, qb, kb, vb, ob, lb, 0.0, causal)
        dq += gq
        dks.append(gk[0])
        dvs.append(gv[0])
    return dq[0], dks[-1], dvs[-1], dks[:-1], dvs[:-1]


class PrefixAttention(torch.autograd.Function):
    """``apply(q, k, v, n_prefix, *prefix)``: ``q, k, v`` ``(heads, n, head_dim)``, ``prefix``
    the earlier slices' keys then values (``n_prefix`` of each, ``(heads, p_i, head_dim)``).
    Returns ``(heads, n, head_dim)`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_prefix: int,
                *prefix: torch.Tensor) -> torch.Tensor:
        ctx.n_prefix = n_prefix
        if _fused(q):
            out, lse = _fused_forward(q, k, v, prefix, n_prefix)
            ctx.save_for_backward(q, k, v, out, lse, *prefix)
            return out
        heads, n, dh = q.shape
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        g = heads // k.shape[0]
        pk, pv = [_heads(t, g, acc_dtype) for t in prefix[:n_prefix]], [_heads(t, g, acc_dtype) for t in prefix[n_prefix:]]
        qf, kf, vf = q.to(acc_dtype), _heads(k, g, acc_dtype), _heads(v, g, acc_dtype)
        scale = dh ** -0.5
        m = torch.full((heads, n), float("-inf"), dtype=acc_dtype, device=q.device)
        norm = torch.zeros((heads, n), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((heads, n, dh), dtype=acc_dtype, device=q.device)
        for piece, c0, c1, causal in _blocks(n, pk, pv, kf, vf, _key_block(heads, n)):
            kb = (kf if piece < 0 else pk[piece])[:, c0:c1]
            vb = (vf if piece < 0 else pv[piece])[:, c0:c1]
            s, r0 = _scores(qf, kb, scale, causal)
            m_new = torch.maximum(m[:, r0:], s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            corr = torch.exp(m[:, r0:] - m_new)
            norm[:, r0:] = norm[:, r0:] * corr + p.sum(-1)
            acc[:, r0:] = acc[:, r0:] * corr[..., None] + torch.matmul(p, vb)
            m[:, r0:] = m_new
        out = acc / norm[..., None]
        lse = m + torch.log(norm)
        ctx.save_for_backward(q, k, v, out, lse, *prefix)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse, *prefix = ctx.saved_tensors
        n_prefix = ctx.n_prefix
        if _fused(q):
            dq, dk, dv, dpk, dpv = _fused_backward(d_out, q, k, v, out, lse, tuple(prefix), n_prefix)
            return (dq, dk, dv, None, *dpk, *dpv)
        heads, n, dh = q.shape
        acc_dtype = out.dtype
        g = heads // k.shape[0]
        pk, pv = [_heads(t, g, acc_dtype) for t in prefix[:n_prefix]], [_heads(t, g, acc_dtype) for t in prefix[n_prefix:]]
        qf, kf, vf, do = q.to(acc_dtype), _heads(k, g, acc_dtype), _heads(v, g, acc_dtype), d_out.to(acc_dtype)
        scale = dh ** -0.5
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(qf)
        dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
        dpk, dpv = [torch.zeros_like(t) for t in pk], [torch.zeros_like(t) for t in pv]
        for piece, c0, c1, causal in _blocks(n, pk, pv, kf, vf, _key_block(heads, n)):
            kb = (kf if piece < 0 else pk[piece])[:, c0:c1]
            vb = (vf if piece < 0 else pv[piece])[:, c0:c1]
            s, r0 = _scores(qf, kb, scale, causal)
            p = torch.exp(s - lse[:, r0:, None])
            dob = do[:, r0:]
            dvb = torch.matmul(p.transpose(-1, -2), dob)
            ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - delta[:, r0:, None])
            dq[:, r0:] += torch.matmul(ds, kb) * scale
            dkb = torch.matmul(ds.transpose(-1, -2), qf[:, r0:]) * scale
            (dk if piece < 0 else dpk[piece])[:, c0:c1] += dkb
            (dv if piece < 0 else dpv[piece])[:, c0:c1] += dvb
        grads = [_group_sum(d, g).to(t.dtype) for d, t in zip(dpk + dpv, prefix)]
        return (dq.to(q.dtype), _group_sum(dk, g).to(k.dtype), _group_sum(dv, g).to(v.dtype), None, *grads)


def _heads(t: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``(kv_heads, n, hd)`` -> ``(kv_heads * groups, n, hd)`` at ``dtype`` (head h reads ``h // groups``)."""
    t = t.to(dtype)
    return t if groups == 1 else t.repeat_interleave(groups, dim=0)


def _group_sum(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_heads``: sum each group of ``groups`` consecutive heads."""
    return t if groups == 1 else t.view(t.shape[0] // groups, groups, *t.shape[1:]).sum(1)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: list[torch.Tensor],
                     prefix_v: list[torch.Tensor]) -> torch.Tensor:
    """``PrefixAttention`` with the prefix given as two lists."""
    return PrefixAttention.apply(q, k, v, len(prefix_k), *prefix_k, *prefix_v)


@dataclass(eq=False)
class _Kept:
    """One continued slice's keys and values at one layer."""

    length: int
    mb: int
    k: torch.Tensor
    v: torch.Tensor
    k_leaf: torch.Tensor
    v_leaf: torch.Tensor
    users: set[int] = field(default_factory=set)


class PrefixStore:
    """Keys and values of continued slices, per (layer, sequence), for later slices (module docstring). A layer
    key is the layer index, or for a piece of an attention half its ``dynmb.models.pieces.store_key``
    (``layer + c0 / 8``: each piece keeps its own K/V heads)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[float, int], dict[int, _Kept]] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._done: set[tuple[float, int]] = set()

    def prefix(self, layer: float, seq: int, offset: int, mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The leaves of slices ``[0, offset)`` of ``seq`` at ``layer``, in order; ``mb`` (the
        microbatch asking) is recorded as their user. Raises if they do not cover the prefix."""
        if offset == 0:
            return [], []
        kept = self._kept.get((layer, seq), {})
        ks, vs, at = [], [], 0
        while at < offset:
            e = kept.get(at)
            if e is None:
                raise SliceOrderError(f"sequence {seq}: the slice at offset {offset} (microbatch {mb}) ran before "
                                      f"the slice at offset {at} on layer {layer}; slices must run forward in order")
            if torch.is_grad_enabled():
                e.users.add(mb)
            ks.append(e.k_leaf)
            vs.append(e.v_leaf)
            at += e.length
        if at != offset:
            raise SliceOrderError(f"sequence {seq}: earlier slices on layer {layer} cover {at} tokens, not {offset}")
        return ks, vs

    def keep(self, layer: float, seq: int, offset: int, k: torch.Tensor, v: torch.Tensor, mb: int) -> None:
        """Keep a continued slice's ``k, v`` ``(heads, n, head_dim)``. Called again for the same
        slice while its block is recomputed in backward, it queues the recomputed tensors
        with the leaves' accumulated gradients as extra backward roots (``pop_pending``)."""
        kept = self._kept.setdefault((layer, seq), {})
        e = kept.get(offset)
        if e is None:
            if k.grad_fn is None:          # recomputed block: nothing saves them, keep compact copies
                k, v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
            kept[offset] = _Kept(int(k.shape[1]), mb, k, v, k.detach().requires_grad_(True),
                                 v.detach().requires_grad_(True))
            return
        if torch.is_grad_enabled() and k.requires_grad:
            e.k, e.v = k, v
            self._pending += self._roots(e, layer, seq)

    @staticmethod
    def _roots(e: _Kept, layer: float, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if e.k_leaf.grad is None or e.v_leaf.grad is None:
            raise SliceOrderError(f"sequence {seq}: the backward of its slice in microbatch {e.mb} (layer {layer}) ran "
                                  f"before every later slice's backward; slices must run backward in reverse order")
        return [(e.k, e.k_leaf.grad), (e.v, e.v_leaf.grad)]

    def pop_pending(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The roots queued by a recomputation (see ``keep``), emptied."""
        out, self._pending = self._pending, []
        return out

    def backward_roots(self, layers: Sequence[float], mb: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor, gradient)`` pairs to add to microbatch ``mb``'s backward on a stage holding
        ``layers``: its continued slices' keys and values (those with a graph; a recomputed
        microbatch adds its roots inside the recomputation)."""
        out = []
        for (layer, seq), kept in self._kept.items():
            if layer in layers:
                for e in kept.values():
                    if e.mb == mb and e.k.grad_fn is not None:
                        out += self._roots(e, layer, seq)
        return out

    def read_leaves(self, layers: Sequence[float], mb: int) -> list[torch.Tensor]:
        """The key/value leaves of earlier slices that microbatch ``mb`` read on a stage holding
        ``layers``: a split backward's ``I`` (``autograd.grad``) accumulates their gradients
        explicitly (``dynmb.runtime.splitbackward.backward_input``), a full one does by itself."""
        out = []
        for (layer, _), kept in self._kept.items():
            if layer in layers:
                for e in kept.values():
                    if mb in e.users:
                        out += [e.k_leaf, e.v_leaf]
        return out

    def release(self, layers: Sequence[float], mb: int) -> None:
        """After microbatch ``mb``'s backward on a stage holding ``layers``: drop its slices'
        entries, refusing if a later slice that used them has not run its backward."""
        for layer in layers:
            self._done.add((layer, mb))
        for (layer, seq), kept in list(self._kept.items()):
            if layer not in layers:
                continue
            for off, e in list(kept.items()):
                if e.mb != mb:
                    continue
                late = sorted(u for u in e.users if (layer, u) not in self._done)
                if late:
                    raise SliceOrderError(f"sequence {seq}: the slice in microbatch {mb} ran its backward before "
                                          f"microbatch {late[0]}'s (a later slice); backwards must run in reverse "
                                          f"slice order")
                del kept[off]
            if not kept:
                del self._kept[(layer, seq)]

    def held_tensors(self, layers: Sequence[float]) -> list[torch.Tensor]:
        """What the store holds on a stage: kept keys and values and their leaves' gradients
        (for the CPU memory meter, which sees only saved tensors otherwise)."""
        out = []
        for (layer, _), kept in self._kept.items():
            if layer in layers:
                for e in kept.values():
                    out += [e.k, e.v] + [g for g in (e.k_leaf.grad, e.v_leaf.grad) if g is not None]
        return out

    def __len__(self) -> int:
        return sum(len(k) for k in self._kept.values())
