"""The outer loop in PyTorch (hvd_dgc/outer.py says what and why).

``DistributedOptimizer(opt, named_parameters=..., outer=hvd_dgc.OuterLoop(steps=H))``
returns this: ``step()`` runs the user's own optimizer on this rank's gradients, with no
collective, and every H-th step ends a round:

    d = start - x                        this rank's change in the round (flat)
    v = beta v + d                       this rank's residual (error feedback; beta:
                                         residual_decay, 1 by default)
    send the density's largest |v| of each tensor (records), v -= what was sent
    a = sum of every rank's records / N  (density 1.0: an allreduce of d)
    anchor -= lr * outer step(a)         Nesterov momentum, the same on every rank
    x = anchor                           every rank starts the next round alike

With ``overlap=True`` the exchange of round j is waited for at the end of round j+1,
and x = anchor - d_(j+1) there (hvd_dgc/outer.py). No backward hook is registered:
between rounds the job never waits on the network.
"""

import contextlib
import os
import time
import warnings
from typing import NamedTuple

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Average

from hvd_dgc.consistency import check_consistent, outer_consistency
from hvd_dgc.outer import RecordLayout, outer_stats, outer_step, round_bytes, round_ks
from hvd_dgc.say import rank0_warn, verbose
from hvd_dgc.switch import outer_line
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.names import tensor_names
from hvd_dgc.torch.quantize import pack_planes, unpack_planes
from hvd_dgc.torch.seam import HorovodCollectives

OUTER_KEY = "hvd_dgc_outer"


class InFlight(NamedTuple):
    """A round's exchange under way: Horovod's handle, and the buffer's shape."""

    handle: int       # the allreduce of the change (density 1.0), or the allgather of
    #                   its records (every rank's bytes, hvd_dgc/outer.py RecordLayout)
    like: object      # a flat tensor of the buffer's size, dtype and device


class _OuterLoopOptimizer(torch.optim.Optimizer):
    # Horovod's broadcast_optimizer_state runs the *base* step (no round) to create
    # the inner optimizer's state for classes from horovod.torch.optimizer's module.
    __module__ = "horovod.torch.optimizer"
    _hvd_dgc_optimizer = True  # hvd.elastic.TorchState's handler (elastic.py)

    def __init__(self, params, names, outer, density, min_compress_size, process_set):
        super(self.__class__, self).__init__(params)
        self.process_set = process_set
        self._outer = outer
        self._density = density
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._names = [names[p] for p in self._params]
        self._numels = numels = [p.numel() for p in self._params]
        self._offsets = [sum(numels[:i]) for i in range(len(numels))]
        self._ks = round_ks(numels, density, min_compress_size)
        self._layout = RecordLayout(sum(self._ks), len(self._ks), outer.value_bits)
        self._anchor = None    # flat float32: the shared weights (overlap: a round behind)
        self._start = None     # flat: where this rank's current round began
        self._buffer = None    # the outer momentum (flat), the same on every rank
        self._residual = None  # what this rank has not sent yet (flat; density < 1)
        self._inflight = None  # overlap: the last round's exchange (InFlight)
        self._inner = 0        # inner steps taken
        self._round_began = 0  # the inner step the current round began after
        self._rounds = 0
        self._waited = 0.0     # seconds this rank waited for exchanges at round ends
        if outer.overlap:  # a script that ends without flush() leaves its last round in
            #                flight (at_exit.py)
            settle_at_exit(self, lambda opt: opt._settle())

    # -- the round ----------------------------------------------------------------------
    def _flat(self):
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    def _take_anchor(self):
        """The weights of the first step (after the script's broadcast)."""
        self._anchor = self._flat()
        self._start = self._anchor.clone() if self._outer.overlap else self._anchor

    def _set_weights(self, flat):
        for o, p in zip(self._offsets, self._params):
            p.copy_(flat[o:o + p.numel()].view_as(p))

    def _launch(self, delta):
        """Every rank's ``delta`` on its way to the average: whole (density 1.0), or the
        density's largest coordinates of ``residual + delta`` per tensor, the rest kept in
        the residual."""
        self._rounds += 1
        if self._density >= 1:
            return InFlight(_hvd.allreduce_async_(delta, op=Average,
                                                  name="hvd_dgc.outer.dense",
                                                  process_set=self.process_set), delta)
        if self._residual is None:
            self._residual = torch.zeros_like(delta)
        v = self._residual
        if self._outer.residual_decay != 1:
            v.mul_(self._outer.residual_decay)
        v.add_(delta)
        picked = []
        for offset, numel, k in zip(self._offsets, self._numels, self._ks):
            if k >= numel:
                picked.append(torch.arange(offset, offset + numel, device=v.device))
            else:
                part = v[offset:offset + numel]
                picked.append(part.abs().topk(k, sorted=False).indices + offset)
        positions = torch.cat(picked)
        payload, sent = pack_records(positions, v[positions], self._ks, self._layout)
        v[positions] -= sent  # what stays (the values' rounding too) is owed to a later round
        # one collective, not one for positions and one for values: a Horovod operation
        # costs round trips, which a long link makes the exchange's largest part
        return InFlight(_hvd.allgather_async(payload, name="hvd_dgc.outer.records",
                                             process_set=self.process_set), delta)

    def _waited_for(self, flight):
        """``_average`` at a round's end: the time training stands still is counted."""
        began = time.perf_counter()
        average = self._average(flight)
        self._waited += time.perf_counter() - began
        return average

    def _average(self, flight):
        """Wait for ``flight``: the average of every rank's change."""
        result = _hvd.synchronize(flight.handle)
        if self._density >= 1:
            return result
        positions, values = unpack_records(result, self._ks, self._layout)
        total = torch.zeros_like(flight.like)
        total.index_add_(0, positions.reshape(-1).long(), values.reshape(-1))
        return total.div_(self.process_set.size())

    def _settle(self):
        """At exit: the round in flight (``overlap``), waited for, not applied."""
        if self._inflight is not None:
            _hvd.synchronize(self._inflight.handle)

    def _apply(self, average):
        """The outer step on the shared weights, the same on every rank."""
        step, self._buffer = outer_step(self._outer, average, self._buffer)
        self._anchor.add_(step, alpha=-self._outer.lr)

    def _round(self):
        with torch.no_grad():
            delta = self._start - self._flat()  # this rank's change in the round
            self._round_began = self._inner
            if not self._outer.overlap:
                self._apply(self._waited_for(self._launch(delta)))
                self._set_weights(self._anchor)
                return
            if self._inflight is not None:  # the last round's average, a round late
                self._apply(self._waited_for(self._inflight))  # (before the next launch:
            # Horovod refuses a second collective of a name still in flight)
            self._start = self._anchor - delta  # the common trajectory, and own round
            self._set_weights(self._start)
            self._inflight = self._launch(delta)  # (after: the allreduce is in place)

    # -- Horovod's optimizer API --------------------------------------------------------
    def step(self, closure=None):
        """One inner step of the wrapped optimizer; every ``steps``-th ends a round."""
        if self._anchor is None:
            self._take_anchor()
        loss = super(self.__class__, self).step(closure)
        self._inner += 1
        if self._inner % self._outer.steps == 0:
            self._round()
        return loss

    def synchronize(self):
        """Nothing to wait for: gradients stay local between rounds."""

    def skip_synchronize(self):
        return contextlib.nullcontext()

    def flush(self):
        """Every rank on the same weights: the exchange in flight (``overlap``) applied,
        and the round under way ended now (its change averaged and applied). Before
        evaluating, checkpointing, or at the end of training."""
        if self._anchor is None:
            return
        with torch.no_grad():
            if self._inflight is not None:
                self._apply(self._average(self._inflight))
                self._inflight = None
            if self._inner != self._round_began:  # (the same count on every rank)
                self._apply(self._average(self._launch(self._start - self._flat())))
                self._round_began = self._inner
            self._set_weights(self._anchor)
            self._start = self._anchor.clone() if self._outer.overlap else self._anchor

    @property
    def in_flight(self):
        """1 while a round's exchange is in flight (``overlap``), else 0."""
        return int(self._inflight is not None)

    def compression_stats(self):
        """The outer loop's counts (this rank): bytes sent over the rounds against dense
        fp32 rounds and against Horovod's allreduce every inner step (hvd_dgc/outer.py)."""
        return outer_stats(self._outer, self._density, self._inner, self._rounds,
                           self._rounds * round_bytes(self._numels, self._ks, self._density,
                                                      self._outer.value_bits),
                           self._numels, self._inflight is not None,
                           self.process_set.size(), self._waited)

    # -- checkpoints and elastic Horovod ------------------------------------------------
    def state_dict(self):
        if self._inflight is not None:
            raise RuntimeError("hvd_dgc: a round's exchange is in flight (OuterLoop(overlap="
                               "True)); its average cannot be saved. Call optimizer.flush() "
                               "after step() before optimizer.state_dict().")
        state = super(self.__class__, self).state_dict()
        state[OUTER_KEY] = {"inner": self._inner, "round_began": self._round_began,
                            "rounds": self._rounds,
                            "anchor": self._anchor, "start": self._start,
                            "buffer": self._buffer, "residual": self._residual,
                            "rank": _hvd.rank()}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        outer = state_dict.pop(OUTER_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        self._inflight = None  # (an elastic restore: what was in flight is gone)
        if outer is None:
            rank0_warn("hvd_dgc: the loaded optimizer state has no outer-loop entry; the "
                       "round starts afresh from the current weights", UserWarning)
            self._anchor = self._start = self._buffer = self._residual = None
            self._round_began = self._inner
            return
        if outer["rank"] != _hvd.rank() and outer["residual"] is not None:
            warnings.warn(f"hvd_dgc: loading rank {outer['rank']}'s outer-loop residual on "
                          f"rank {_hvd.rank()}: it holds what that rank had not sent yet",
                          UserWarning)
        self._inner, self._rounds = outer["inner"], outer["rounds"]
        self._round_began = outer["round_began"]
        self._anchor, self._start, self._buffer, self._residual = (
            None if t is None else t.clone() for t in
            (outer["anchor"], outer["start"], outer["buffer"], outer["residual"]))
        if self._anchor is not None and not self._outer.overlap:
            self._start = self._anchor  # (one tensor: the round starts from the anchor)

    def shared_state(self):
        """What every rank must hold alike after an elastic sync: rank 0's count of inner
        steps, anchor and outer momentum (a rank that joins has no residual)."""
        return self._inner, self._round_began, self._rounds, self._anchor, self._buffer

    def load_shared_state(self, state):
        """Rank 0's round; this rank goes on from where its weights are (Horovod's sync
        gave it rank 0's), its change since the round began kept as its own."""
        self._inflight = None
        self._inner, self._round_began, self._rounds, anchor, self._buffer = state
        if anchor is None:
            self._anchor = self._start = None
            return
        self._anchor = anchor.clone()
        self._start = self._anchor.clone() if self._outer.overlap else self._anchor


# -- a round's records on the wire (hvd_dgc/outer.py RecordLayout) -------------------------
def pack_records(positions, values, ks, layout):
    """``(payload, sent)``: the uint8 bytes of this rank's records, and each value as it
    arrives (``values`` itself, or its low-bit level)."""
    as_bytes = [positions.to(torch.int32).view(torch.uint8)]
    if layout.value_bits == 32:
        return torch.cat(as_bytes + [values.view(torch.uint8)]), values
    owner = _owners(ks, values.device)
    mags = values.abs()
    lo = mags.new_full((len(ks),), float("inf")).scatter_reduce(0, owner, mags, "amin")
    hi = mags.new_zeros(len(ks)).scatter_reduce(0, owner, mags, "amax")
    step = (hi - lo) / (layout.levels - 1)
    lo_r, step_r = lo[owner], step[owner]
    level = torch.where(step_r > 0, torch.round((mags - lo_r) / step_r),
                        torch.zeros_like(mags)).clamp_(0, layout.levels - 1)
    negative = values < 0
    arrived = lo_r + level * step_r
    codes = level.to(torch.uint8) | (negative.to(torch.uint8) << (layout.value_bits - 1))
    return (torch.cat(as_bytes + [torch.stack([lo, hi], 1).reshape(-1).view(torch.uint8),
                                  pack_planes(codes, layout.value_bits)]),
            torch.where(negative, -arrived, arrived))


def unpack_records(gathered, ks, layout):
    """Every rank's ``(positions, values)``, ``[world, count]`` each, from the allgather
    of ``pack_records``' payloads."""
    rows = gathered.view(-1, layout.nbytes)
    positions = rows[:, :4 * layout.count].contiguous().view(torch.int32)
    at = layout.values_at
    if layout.value_bits == 32:
        return positions, rows[:, at:].contiguous().view(torch.float32)
    scales = rows[:, 4 * layout.count:at].contiguous().view(torch.float32)
    lo, hi = scales.view(len(rows), -1, 2).unbind(-1)
    step = (hi - lo) / (layout.levels - 1)
    codes = torch.stack([unpack_planes(row, layout.value_bits, layout.count)
                         for row in rows[:, at:]])
    owner = _owners(ks, gathered.device)
    level = (codes & (layout.levels - 1)).to(torch.float32)
    arrived = lo[:, owner] + level * step[:, owner]
    return positions, torch.where((codes >> (layout.value_bits - 1)) > 0, -arrived, arrived)


def _owners(ks, device):
    """Each record's tensor (0 .. len(ks) - 1)."""
    return torch.repeat_interleave(torch.arange(len(ks), device=device),
                                   torch.tensor(ks, device=device))


def outer_optimizer(optimizer, named_parameters, outer, config, process_set):
    """The outer-loop optimizer for ``DistributedOptimizer(..., outer=...)`` (its options
    checked there)."""
    names = tensor_names(named_parameters, optimizer.param_groups)
    density = 1.0 if config.density is None else float(config.density)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_OuterLoopOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, names, outer, density, config.min_compress_size,
                  process_set)
    if process_set.included():
        if os.environ.get("HOROVOD_ELASTIC") != "1":
            _check_same(wrapped, outer, density, config, process_set)
        if _hvd.rank() == 0:  # short; the whole story with verbose
            print(outer_line("torch", outer, density, type(optimizer).__name__,
                             verbose(config.verbose)), flush=True)
    return wrapped


def _check_same(wrapped, outer, density, config, process_set):
    """Every rank wrapped alike (one allgather at wrap time, hvd_dgc/consistency.py)."""
    check_consistent(HorovodCollectives(process_set), outer_consistency(
        outer, density, config.min_compress_size, wrapped._names,
        [p.shape for p in wrapped._params]), "DistributedOptimizer")
