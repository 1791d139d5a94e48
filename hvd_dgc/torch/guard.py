"""What a step does with a NaN or Inf gradient (``skip_nonfinite``, GradScaler).

A non-finite local gradient must never enter the memory: error feedback would keep
sending it, every step after. And every rank must decide alike, or their collectives
would differ. Three modes:

    "skip"  (synchronous steps; GradScaler always): the memory is written beside its old
            buffers (FlatMemory.snapshot: no copy), a rank whose gradient is not finite
            sends inf in its tensors' payloads, so every rank's average shows it; then
            every rank keeps its old memory and skips the step (``settle``)
    "drop"  (delay > 0 or period > 1, where the other ranks have applied their own part
            of the step already): the rank that has it sends zeros for that tensor and
            keeps it out of its memory (u and v as they were)
    None    (skip_nonfinite=False, no GradScaler): it goes through

Finiteness is read off device flags (one norm per launch, no read-back) in "skip", so
a GPU never waits; the step's one read-back is in ``settle``.
"""

import warnings

import torch

from hvd_dgc.say import rank0_warn
from hvd_dgc.torch.gpu_select import on_device

__all__ = ["NonFiniteGuard"]


class NonFiniteGuard:
    """Owns the guard's state for one optimizer: the mode, this step's saved compressor
    RNG, the tensors dropped, and the counts of steps skipped."""

    def __init__(self, skip_nonfinite, grad_scaler, compressor, rank):
        self.skip_nonfinite, self.grad_scaler = skip_nonfinite, grad_scaler
        self.compressor, self.rank = compressor, rank
        self.mode = None
        self._saved_rng = None
        self.dropped = []          # names this rank sent as zeros this step ("drop")
        self.overflow_steps = 0    # GradScaler overflows (steps skipped by the scaler)
        self.nonfinite_steps = 0   # skip_nonfinite: steps skipped (delay > 0: dropped here)
        self._said_nonfinite = False  # the first skipped step is said (rank 0), the rest counted

    def scaling(self):
        return self.grad_scaler is not None and self.grad_scaler.is_enabled()

    def begin(self, keeps_own):
        """The mode of the step about to launch."""
        if self.scaling():
            self.mode = "skip"
        elif not self.skip_nonfinite:
            self.mode = None
        else:
            self.mode = "drop" if keeps_own else "skip"

    # -- around each launch (exchange.py) ------------------------------------------------
    def before_accumulate(self, memory, launch):
        """Before the memory moves. "skip": write the step beside the old memory and keep
        the sampler's RNG. "drop": find this rank's non-finite tensors now (one
        read-back), keep their memory aside, and let zeros in instead."""
        layout = launch.layout
        if self.mode == "skip":
            if layout.block is not None:
                memory.undo.snapshot(layout.block)
            launch.guarded = True
            self._save_rng(launch.g.device)
            return None
        if self.mode != "drop" or not layout.dense_grads:
            return None
        norms = torch.stack(torch._foreach_norm(layout.g_views, 1))
        bad = [layout.dense_grads[j] for j, ok in enumerate(torch.isfinite(norms).tolist())
               if not ok]
        if not bad:
            return None
        block, saved = layout.block, []
        if block is not None:
            block.settle()  # (what it saves is read as it is)
        for i in bad:
            self.dropped.append(layout.members[i].name)
            layout.g_views[layout.dense_grads.index(i)].zero_()
            if block is not None and i < len(block.keys):
                lo, hi = block.span(i)
                saved.append((i, lo, hi, None if block.u is None else block.u[lo:hi].clone(),
                               block.v[lo:hi].clone()))
        return saved

    def accumulated(self, launch, saved):
        """"skip": flag the tensors whose payload could hide this rank's non-finite
        gradient (``launch.poison``: their payloads will carry inf), read off the memory's
        block maxima where it computed them (a NaN or inf there shows in its block's
        maximum: no pass of its own). "drop": the dropped tensors send zeros."""
        if self.mode == "skip":
            launch.poison = _flags(launch.layout)
        for _, lo, hi, _, _ in saved or ():
            launch.block.v[lo:hi].zero_()

    @staticmethod
    def launched(launch, saved):
        """"drop": their memory as it was, and nothing of theirs counted as sent."""
        block = launch.block
        for i, lo, hi, u, v in saved or ():
            block.v[lo:hi].copy_(v)
            if u is not None:
                block.u[lo:hi].copy_(u)
            if launch.own is not None:
                o = launch.layout.offsets[i]
                launch.own[o:o + launch.layout.members[i].numel].zero_()

    def _save_rng(self, device):
        """The sampler's RNG (or a compressor's state: the sign's server errors) as it
        was before this step, for a step that gets skipped."""
        comp = self.compressor
        if self._saved_rng is None and (getattr(comp, "random", False) or
                                        getattr(comp, "stateful", False)):
            if hasattr(comp, "generator"):  # they exist before they are saved
                comp.generator(device, self.rank)
                comp.generator("cpu", self.rank)
            self._saved_rng = comp.state_dict()

    # -- the end of a step -------------------------------------------------------------
    @staticmethod
    def nonfinite(sums):
        """Names of the tensors whose average is not finite, from ``[(sum, named)]``: a
        device scalar per launch (one read-back per device for the step) and, for the
        rare step where one is not finite, ``named()`` -> ``[(name, tensor)]``."""
        by_device = {}
        for total, named in sums:
            by_device.setdefault(total.device, []).append((total, named))
        bad = []
        for pairs in by_device.values():
            ok = torch.isfinite(torch.stack([t for t, _ in pairs])).tolist()
            suspects = [nt for good, (_, named) in zip(ok, pairs) if not good
                        for nt in named()]
            if suspects:  # the rare bad step: one more read-back names them all
                finite = torch.stack([torch.isfinite(t).all() for _, t in suspects]).tolist()
                bad += [n for (n, _), f in zip(suspects, finite) if not f]
        return bad

    def settle(self, memory, bad, step):
        """End of a guarded step. Every rank saw the same averages, so every rank agrees
        on ``bad``: then the step must leave no trace in the memory (or what was sent
        this step would be lost) nor in the sampler's RNG. Returns whether the base
        optimizer's step is skipped."""
        saved, self._saved_rng = self._saved_rng, None
        if not bad:
            memory.undo.commit()
            return False
        memory.undo.rollback()
        if saved is not None:
            self.compressor.load_state_dict(saved, self.rank)
        if self.scaling():
            self.overflow_steps += 1  # p.grad holds inf: GradScaler.step skips step()
            return False
        self.nonfinite_steps += 1
        # every rank sees it (the rank sends inf): said by rank 0, the first time; the
        # later ones are counted in compression_stats()["nonfinite_steps"]
        if self._said_nonfinite:
            return True
        self._said_nonfinite = True
        rank0_warn(
            f"hvd_dgc: step {step}: non-finite gradient (NaN/Inf) on at least one rank in "
            f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; this step is "
            f"skipped on every rank (weights, DGC memory and step count unchanged; later "
            f"ones are counted in compression_stats()['nonfinite_steps']). Look at the "
            f"learning rate, the loss or the data; skip_nonfinite=False lets such gradients "
            f"through.", RuntimeWarning)
        return True

    def report_dropped(self, step, delay, period):
        """"drop": say which tensors this rank sent as zeros this step."""
        if not self.dropped:
            return
        self.nonfinite_steps += 1
        warnings.warn(
            f"hvd_dgc: step {step}: non-finite gradient (NaN/Inf) in "
            f"{', '.join(self.dropped[:3])} on rank {self.rank}: with delay={delay}, "
            f"period={period} this rank contributes zero to the step and keeps it out of its memory; the other ranks "
            f"have applied their own part already and keep it ({self.nonfinite_steps} "
            f"such steps here).", RuntimeWarning)
        self.dropped = []

    def reset(self):
        """A step cut short (an elastic reset): nothing of it to undo or report."""
        self._saved_rng, self.dropped = None, []


def _flags(layout):
    """Per member of a launch, whether this rank's gradient is not finite (a device
    tensor), for the tensors whose payload could hide it (a selection may leave it
    behind, a compressor round it away: the path class's ``checked``); a dense allreduce
    carries it into every rank's sum as it is."""
    checked = layout.checked
    if not checked:
        return None
    block = layout.block
    if block is not None and block.block_max is not None and \
            all(i < block.aligned for i in checked):
        if block.block_max.device.type == "cpu" and \
                bool(torch.isfinite(block.block_max.sum())):
            return None  # a CPU reads one sum back for free: nothing to flag
        # the maxima of each member's blocks: one cumulative count of bad blocks
        bad = (~torch.isfinite(block.block_max)).cumsum(0)
        bad = torch.cat([bad.new_zeros(1), bad])
        ends, starts = layout.block_spans
        flags = bad[ends] > bad[starts]
    else:
        flags = ~torch.isfinite(torch.stack(torch._foreach_norm(
            [layout.g_views[layout.dense_grads.index(i)] for i in checked], 1)))
        if len(checked) < len(layout.members):
            return torch.zeros(len(layout.members), dtype=torch.bool,
                               device=flags.device).index_put_(
                (on_device(tuple(checked), str(flags.device)),), flags)
        return flags
    if len(checked) < len(layout.members):
        flags = torch.cat([flags, flags.new_zeros(len(layout.members) - len(flags))])
    return flags
