"""Point-to-point messages between pipeline stages, with shapes known from the plan.

Algorithm
---------
A message is named ``(kind, stage, mb)``: ``("act", s, m)`` is the hidden state
stage ``s - 1`` sends to stage ``s`` for microbatch ``m``; ``("grad", s, m)`` is
the gradient stage ``s + 1`` sends back to stage ``s``. Both ends read the same
validated Schedule and the same Plan, so a receiver allocates its buffer with
the shape ``(mb.batch, mb.padded_len, channels)`` it already knows: there is no
per-message shape handshake (``channels``: ``d_model``, or more after a stage holding a
shard of a head split by vocabulary, ``ModelConfig.message_channels``: both messages of
microbatch ``m`` between stages ``s`` and ``s + 1`` have the shape of what ``s`` sends).

Ordering. Message tags are not honoured by every backend (NCCL ignores them), so
correctness rests only on FIFO order per ordered pair (src, dst):

1. every ordered pair of neighbouring pipeline ranks gets its own two-rank
   process group, used for that direction only (``make_pair_groups``). On NCCL a
   pending send then never sits in front of a receive from the same peer on one
   stream, which is the classic 1F1B deadlock;
2. the receiver derives the sender's send order from the sender's action list
   (an ``F`` of stage s sends ``("act", s+1, m)``, a ``B`` or ``I`` of stage s sends
   ``("grad", s-1, m)``; a ``W`` sends nothing) and posts its ``irecv`` s in exactly that order. When it
   needs a message whose predecessors on that pair were not consumed yet, it posts
   those first and keeps them (``pending``) until their actions ask for them.

For GPipe and plain 1F1B the per-pair receive order already equals the send order
(each pair carries one kind of message in increasing microbatch order); for
interleaved schedules activations and gradients of different chunks share a pair
and the orders can differ, which rule 2 absorbs.

Sends are ``isend``: the handle and the tensor are kept until the send completed
(checked at every later send) or until ``finish()`` at the end of the step. Messages
between stages on the same rank (interleaved schedule on one rank) are local handoffs.
This module takes the device and the groups as arguments and makes no ``torch.cuda`` call.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from dynmb.core.types import Schedule

__all__ = ["make_pair_groups", "sender_order", "P2P", "CommError"]

Msg = tuple[str, int, int]   # (kind, stage, mb)


class CommError(RuntimeError):
    """A message the schedule promises never came, or one arrived that nobody expects."""


def make_pair_groups(world_size: int, pp_size: int, timeout=None,
                     device: torch.device | None = None) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One two-rank group per ordered pair of neighbouring pipeline ranks, for every DP replica.

    Global rank = ``dp_idx * pp_size + pp_idx``; neighbours are ``pp_idx`` and
    ``(pp_idx + 1) % pp_size`` (the ring the interleaved placement uses). Every rank
    must call this with the same arguments (``new_group`` is collective).
    Returns ``{(src, dst): group}`` for all pairs (non-members get placeholders).
    With ``device``, each pair exchanges one tiny message, pair by pair in a global
    order (no cycle can wait), so lazily created communicators (NCCL) exist before
    the first step and no later send blocks in communicator set-up.
    """
    groups: dict[tuple[int, int], dist.ProcessGroup] = {}
    if pp_size < 2:
        return groups
    for d in range(world_size // pp_size):
        base = d * pp_size
        pairs = []
        for i in range(pp_size):
            a, b = base + i, base + (i + 1) % pp_size
            for p in ((a, b), (b, a)):
                if p not in pairs:
                    pairs.append(p)
        for src, dst in pairs:
            groups[(src, dst)] = dist.new_group(ranks=sorted({src, dst}), timeout=timeout)
    if device is not None:
        me = dist.get_rank()
        for (src, dst), g in groups.items():
            t = torch.zeros(1, device=device)
            if me == src:
                dist.send(t, dst=dst, group=g)
            elif me == dst:
                dist.recv(t, src=src, group=g)
    return groups


def sender_order(schedule: Schedule, src_rank: int, dst_rank: int, stage_rank: dict[int, int]) -> list[Msg]:
    """The messages pipeline rank ``src_rank`` sends to ``dst_rank`` during a step, in send order."""
    out: list[Msg] = []
    last = schedule.num_stages - 1
    for a in schedule.ranks[src_rank]:
        if a.op == "F" and a.stage < last and stage_rank[a.stage + 1] == dst_rank:
            out.append(("act", a.stage + 1, a.mb))
        elif a.op in ("B", "I") and a.stage > 0 and stage_rank[a.stage - 1] == dst_rank:
            out.append(("grad", a.stage - 1, a.mb))
    return out


class P2P:
    """This rank's messages for one step of one schedule.

    ``pp_rank``: this rank's index in the pipeline; ``pp_ranks[i]``: the global rank
    of pipeline index i (this DP replica); ``pair_groups``: from ``make_pair_groups``;
    ``shape_of(mb, sender)``: the shape of the message stage ``sender`` sends on for microbatch ``mb``
    (``("act", s, m)`` is sent by ``s - 1``; ``("grad", s, m)`` is the gradient of what ``s`` sent).
    """

    def __init__(self, schedule: Schedule, pp_rank: int, pp_ranks: list[int],
                 pair_groups: dict[tuple[int, int], dist.ProcessGroup], shape_of: Callable[[int, int], tuple[int, ...]],
                 *, dtype: torch.dtype, device: torch.device) -> None:
        self.schedule, self.me, self.pp_ranks = schedule, pp_rank, pp_ranks
        self.groups, self.shape_of, self.dtype, self.device = pair_groups, shape_of, dtype, device
        self.stage_rank = schedule.stage_to_rank()
        peers = {self.stage_rank[s] for s in self.stage_rank} - {pp_rank}
        # messages still to be posted, per source pipeline rank, in the sender's order
        self._expected = {p: deque(sender_order(schedule, p, pp_rank, self.stage_rank)) for p in peers}
        self._posted: dict[Msg, tuple[torch.Tensor, dist.Work]] = {}
        self._local: dict[Msg, torch.Tensor] = {}
        self._sends: list[tuple[torch.Tensor, dist.Work]] = []
        self.bytes_sent = 0

    # --- sending ---------------------------------------------------------------
    def send(self, kind: str, stage: int, mb: int, tensor: torch.Tensor) -> None:
        """Send ``tensor`` as message ``(kind, stage, mb)`` to the rank holding ``stage``."""
        dst = self.stage_rank[stage]
        t = tensor.detach()
        if dst == self.me:
            self._local[(kind, stage, mb)] = t
            return
        t = t.contiguous()
        src_g, dst_g = self.pp_ranks[self.me], self.pp_ranks[dst]
        work = dist.isend(t, dst=dst_g, group=self.groups[(src_g, dst_g)])
        assert work is not None   # this rank is in the pair's group
        # keep a send's tensor alive until it completed; drop finished ones so that sent
        # input gradients do not pile up until the end of the step
        self._sends = [(b, w) for b, w in self._sends if not w.is_completed()]
        self._sends.append((t, work))
        self.bytes_sent += t.numel() * t.element_size()

    # --- receiving -------------------------------------------------------------
    def recv(self, kind: str, stage: int, mb: int) -> tuple[torch.Tensor, float]:
        """Message ``(kind, stage, mb)`` and the host seconds spent waiting for it."""
        msg = (kind, stage, mb)
        if msg in self._local:
            return self._local.pop(msg), 0.0
        src = self.stage_rank[stage - 1 if kind == "act" else stage + 1]
        if src == self.me:
            raise CommError(f"local message {kind} for stage {stage} mb {mb} was never produced on rank {self.me}")
        queue = self._expected.get(src)
        while msg not in self._posted:
            if not queue:
                raise CommError(f"rank {self.me} waits for {kind} of stage {stage} mb {mb} from rank {src}, "
                                f"but rank {src}'s schedule never sends it")
            self._post(src, queue.popleft())
        buf, work = self._posted.pop(msg)
        t0 = time.perf_counter()
        work.wait()
        return buf, time.perf_counter() - t0

    def _post(self, src: int, msg: Msg) -> None:
        kind, stage, mb = msg
        buf = torch.empty(self.shape_of(mb, stage - 1 if kind == "act" else stage), dtype=self.dtype,
                          device=self.device)
        src_g, dst_g = self.pp_ranks[src], self.pp_ranks[self.me]
        work = dist.irecv(buf, src=src_g, group=self.groups[(src_g, dst_g)])
        assert work is not None   # this rank is in the pair's group
        self._posted[msg] = (buf, work)

    # --- end of step -----------------------------------------------------------
    def finish(self) -> None:
        """Wait for every send; fail if a posted or expected message was never used."""
        for _, work in self._sends:
            work.wait()
        self._sends.clear()
        left = [m for q in self._expected.values() for m in q] + list(self._posted) + list(self._local)
        if left:
            raise CommError(f"rank {self.me}: messages never consumed at step end: {left[:6]}")
