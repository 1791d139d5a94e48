"""DGC's own work on this device (hvd_dgc/localcost.py) with the compressor's own
selection and record handling, or a payload compressor's encoding and decoding:
``cost_model="measure"`` (the link itself is timed by hvd_dgc/linkprobe.py on the seam,
hvd_dgc/seam.py). And the link watched while training (hvd_dgc/linkwatch.py,
``LinkWatcher``)."""

import time

import torch
import horovod.torch as _hvd

from hvd_dgc.linkprobe import probe_link
from hvd_dgc.linkwatch import LinkWatchState, judge_probe, relinked_words
from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate, calibrate_payload
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.memory import BLOCK

__all__ = ["measure_local", "measure_payload", "LinkWatcher"]


def measure_local(compressor, collectives, density, device):
    """The ``LocalCost`` of ``compressor`` (a sparse one: ``pick``, ``pack``,
    ``records_at``) on ``device``, agreed over ``collectives`` (hvd_dgc/seam.py: the
    slowest rank's; ``python -m hvd_dgc.predict`` passes ``Alone()``): a launch's
    selection over a synthetic memory, and its records taken out of the memory, packed,
    unpacked and added, as the engine does."""
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(CALIBRATION_NUMEL, generator=gen).to(device)
    block_max = v.view(-1, BLOCK).abs().amax(1)  # (the memory's update makes these)
    out = torch.zeros_like(v)

    def select(numel, k):
        return _fastest(lambda: compressor.pick(v, block_max, (0,), (numel,), (k,),
                                                ("hvd_dgc.calibrate",), 0, 0), v.device)

    def records(k):
        positions = torch.randperm(CALIBRATION_NUMEL, generator=gen)[:k].to(device)
        memory = v.clone()

        def once():
            values = memory.index_select(0, positions)  # what leaves the memory
            memory.index_fill_(0, positions, 0.0)
            wire = compressor.pack(values, positions)
            at, got = compressor.records_at(wire, (0,), (k,))
            out.index_add_(0, at, got)
        return _fastest(once, v.device)
    return calibrate(select, records, _agree(collectives), density)


def _fastest(fn, device, times=3):
    """The fastest of ``times`` calls of ``fn``, in seconds (a GPU's work waited for)."""
    cuda = torch.device(device).type == "cuda"
    best = float("inf")
    for _ in range(times):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _agree(collectives):
    def agree(values):
        return collectives.max(values, "hvd_dgc.calibrate.agree")
    return agree


def measure_payload(compressor, collectives, device):
    """The agreed ``PayloadCost`` of a payload ``compressor`` (sign, QSGD, bf16:
    ``encode``, ``decode``) on ``device``: one payload of a synthetic memory encoded, and
    decoded, as every rank's is at each exchange."""
    v = torch.randn(CALIBRATION_NUMEL, generator=torch.Generator().manual_seed(0)).to(device)
    payload = compressor.encode(v, 0)

    def encode(numel):
        return _fastest(lambda: compressor.encode(v[:numel], 0), device)

    def decode(numel):
        return _fastest(lambda: compressor.decode(payload, numel, torch.float32), device)
    return calibrate_payload(encode, decode, _agree(collectives))


class LinkWatcher:
    """The link watch of one optimizer (hvd_dgc/linkwatch.py): ``observe`` after each
    synchronous step's wait for its averages; at a window's end the last window's agreed
    waits may call for a probe, after which the paths follow the link where it changed."""

    made = 0  # watchers made in this process: each names its collectives apart

    def __init__(self, watch, planner, collectives):
        self.state = LinkWatchState(watch)
        self.planner, self.collectives = planner, collectives
        self._agreeing = None  # (handle of the last window's sums, what they were on)
        self._windows = 0
        LinkWatcher.made += 1
        self._name = f"hvd_dgc.linkwatch.{LinkWatcher.made}"
        # a job that ends at a window's end leaves its agreement in flight (at_exit.py)
        settle_at_exit(self, LinkWatcher._settle)

    def observe(self, waited, launches, density, step):
        state = self.state
        state.observe(waited)
        if not state.window_done():
            return
        now = (density, self.planner.generation)
        sums = state.take_window()
        moved = 0
        if self._agreeing is not None:
            handle, measured_on = self._agreeing
            agreed = tuple(self.collectives.wait(handle))
            moved = state.decide(agreed, measured_on, now)
        if moved:  # (before this window's agreement: nothing of ours in flight)
            self._probe(density, launches, step, moved)
            now = (density, self.planner.generation)
        self._windows += 1
        name = f"{self._name}.{self._windows % 2}"
        self._agreeing = (self.collectives.max_async(sums, name), now)

    def _settle(self):
        """At exit: the agreement in flight, waited for."""
        if self._agreeing is not None:
            self.collectives.wait(self._agreeing[0])

    def _probe(self, density, launches, step, moved):
        planner = self.planner
        link = probe_link(self.collectives)
        relinked, before, after = judge_probe(planner, link, density, launches,
                                              self.state.watch.change, moved)
        if relinked:
            was = planner.link
            planner.relink(link)
            if _hvd.rank() == 0:
                print(relinked_words(step, link, was, before, after, planner, density),
                      flush=True)  # (short by default; the full story with verbose)
        self.state.probed(relinked, step)


