"""The statistics, where training is, and hvd_dgc's entry in the optimizer's checkpoint.

``Progress`` holds the step and epoch (which decide every rank's density and path, so
every rank must hold the same ones) and the statistics. The checkpoint entry gathers
what each part owns: the memory (exchange.py), the compressor's state (its RNG, PowerSGD's
Q), the guard's counts, the delay ``delay="auto"`` reached. It is kept apart from the
base optimizer's state so ``hvd.broadcast_optimizer_state`` (which broadcasts rank
0's ``state``) never overwrites a rank's own residual. Its format, one memory entry
per parameter, is the same as every earlier release's.
"""

import warnings

from hvd_dgc.stats import CompressionStats

__all__ = ["Progress", "STATE_KEY", "STATE_VERSION", "checkpoint", "restore"]

STATE_KEY = "hvd_dgc"
STATE_VERSION = 1


class Progress:
    """The step and epoch every rank shares, and this rank's statistics."""

    def __init__(self, schedule, sparse, log_every=0, min_compress_size=1024):
        self.schedule, self.sparse, self.log_every = schedule, sparse, log_every
        self.step = 0
        self.epoch = 0.0
        self.stats = CompressionStats(min_compress_size)
        # (step, density before, density now) -> rank 0's line where a new density stage
        # changes the tensors' paths, or None (PlanWords.stage_line)
        self.stage_line = None
        self._stage = None  # the density the last step ran at

    def density(self):
        """The density of the step about to run (1.0 without a sparse compressor)."""
        return self.schedule(self.step, self.epoch) if self.sparse else 1.0

    def maybe_log(self, rank):
        """After a step: rank 0's statistics every ``log_every`` steps, and a short line
        where the next step's density stage sends the tensors another way."""
        if self.stage_line is not None and self.sparse and rank == 0:
            now, before = self.density(), self._stage
            if before is None:
                before = self.schedule(max(self.step - 1, 0), self.epoch)
            self._stage = now
            line = self.stage_line(self.step, before, now) if now != before else None
            if line:
                print(line, flush=True)
        if self.log_every and self.step % self.log_every == 0 and rank == 0:
            print(f"[hvd_dgc] step {self.step}: {self.stats.format(self.density())}",
                  flush=True)


def checkpoint(progress, memory_state, compressor, guard, lagging, rank):
    """hvd_dgc's entry in ``optimizer.state_dict()`` (``memory_state``: the memory's
    entries, GradientExchange.memory_state)."""
    comp = compressor.state_dict() if hasattr(compressor, "state_dict") else {}
    return {"version": STATE_VERSION, "step": progress.step, "epoch": progress.epoch,
            "rank": rank, "memory": memory_state, "compressor": comp,
            "stats": progress.stats.state_dict(), "overflow_steps": guard.overflow_steps,
            "nonfinite_steps": guard.nonfinite_steps, "delay": lagging.delay}


def restore(state, progress, memory, compressor, guard, lagging, device_of, rank):
    """Load an entry ``checkpoint`` made (``device_of(key)``: where a parameter lives)."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"hvd_dgc state version {state.get('version')!r} is not "
                         f"{STATE_VERSION}; this checkpoint was written by another "
                         f"hvd_dgc release")
    if state.get("rank", rank) != rank:
        warnings.warn(f"hvd_dgc: rank {rank} is loading the DGC memory that rank "
                      f"{state['rank']} saved. Residuals are per rank: save and load one "
                      f"file per rank (e.g. 'ckpt.rank{{hvd.rank()}}.pt'), or every rank "
                      f"resends rank {state['rank']}'s residual.")
    progress.step, progress.epoch = state["step"], state["epoch"]
    memory.load_state_dict(state["memory"], device_of)
    if hasattr(compressor, "load_state_dict") and state["compressor"]:
        compressor.load_state_dict(state["compressor"], rank)
    progress.stats.load_state_dict(state["stats"])
    guard.overflow_steps = state.get("overflow_steps", 0)
    guard.nonfinite_steps = state.get("nonfinite_steps", 0)
    if lagging.auto is not None:  # delay="auto" goes on from the D it had reached
        lagging.resume_delay(int(state.get("delay", lagging.delay)))
