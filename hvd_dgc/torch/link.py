"""The link probe (hvd_dgc/linkprobe.py) with Horovod's PyTorch allreduce, and DGC's own
work on this device (hvd_dgc/localcost.py) with the compressor's own selection and
record handling: ``cost_model="measure"``."""

import time

import torch
import horovod.torch as _hvd
from horovod.torch.mpi_ops import Max, Sum

from hvd_dgc.linkprobe import measure_link
from hvd_dgc.linkwatch import LinkWatchState, judge_probe, relinked_words
from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate, calibrate_payload
from hvd_dgc.torch.at_exit import settle_at_exit
from hvd_dgc.torch.memory import BLOCK

__all__ = ["measure", "measure_local", "measure_payload", "LinkWatcher"]


def _agree(process_set, name):
    def agree(values):
        return _hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=Max,
                              name=name, process_set=process_set).tolist()
    return agree


def measure(process_set, peers=()):
    """The agreed ``LinkMeasurement`` of ``process_set``'s ranks (None for one rank), and
    inside this rank's host where ``peers`` (its global ranks, hierarchical DGC's) are
    several. Every rank of the set calls it at the same point (the wrapper, after the
    config check)."""
    def allreduce(numel):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allreduce(tensor, op=Sum, name=f"hvd_dgc.probe.{numel}", process_set=process_set)
        return time.perf_counter() - start

    def allgather(numel):
        tensor = torch.zeros(numel)
        start = time.perf_counter()
        _hvd.allgather(tensor, name=f"hvd_dgc.probe.gather.{numel}", process_set=process_set)
        return time.perf_counter() - start

    def alltoall(numel):  # (hierarchical DGC's first round: nothing across hosts)
        splits = torch.zeros(process_set.size(), dtype=torch.int32)
        splits[[r for r in peers if r != _hvd.rank()]] = numel
        tensor = torch.zeros(int(splits.sum()))
        start = time.perf_counter()
        _hvd.alltoall(tensor, splits=splits, name=f"hvd_dgc.probe.host.{numel}",
                      process_set=process_set)
        return time.perf_counter() - start
    return measure_link(allreduce, _agree(process_set, "hvd_dgc.probe.agree"),
                        process_set.size(), allgather=allgather,
                        alltoall=alltoall if len(peers) > 1 else None,
                        local_size=len(peers))


def measure_local(compressor, process_set, density, device, agree=None):
    """The agreed ``LocalCost`` of ``compressor`` (a sparse one: ``pick``, ``pack``,
    ``records_at``) on ``device``: a launch's selection over a synthetic memory, and its
    records taken out of the memory, packed, unpacked and added, as the engine does.
    ``agree``: how the ranks agree on the timings (default: the slowest of
    ``process_set``'s; ``python -m hvd_dgc.predict``, with no Horovod job, passes its
    own)."""
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
    return calibrate(select, records,
                     agree or _agree(process_set, "hvd_dgc.calibrate.agree"), density)


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


def measure_payload(compressor, process_set, device):
    """The agreed ``PayloadCost`` of a payload ``compressor`` (sign, QSGD, bf16:
    ``encode``, ``decode``) on ``device``: one payload of a synthetic memory encoded, and
    decoded, as every rank's is at each exchange."""
    v = torch.randn(CALIBRATION_NUMEL, generator=torch.Generator().manual_seed(0)).to(device)
    payload = compressor.encode(v, 0)

    def encode(numel):
        return _fastest(lambda: compressor.encode(v[:numel], 0), device)

    def decode(numel):
        return _fastest(lambda: compressor.decode(payload, numel, torch.float32), device)
    return calibrate_payload(encode, decode, _agree(process_set, "hvd_dgc.calibrate.agree"))


class LinkWatcher:
    """The link watch of one optimizer (hvd_dgc/linkwatch.py): ``observe`` after each
    synchronous step's wait for its averages; at a window's end the last window's agreed
    waits may call for a probe, after which the paths follow the link where it changed."""

    made = 0  # watchers made in this process: each names its collectives apart

    def __init__(self, watch, planner, process_set):
        self.state = LinkWatchState(watch)
        self.planner, self.process_set = planner, process_set
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
        sums = torch.tensor(state.take_window(), dtype=torch.float64)
        moved = 0
        if self._agreeing is not None:
            handle, measured_on = self._agreeing
            agreed = tuple(_hvd.synchronize(handle).tolist())
            moved = state.decide(agreed, measured_on, now)
        if moved:  # (before this window's agreement: nothing of ours in flight)
            self._probe(density, launches, step, moved)
            now = (density, self.planner.generation)
        self._windows += 1
        name = f"{self._name}.{self._windows % 2}"
        self._agreeing = (_hvd.allreduce_async(sums, op=Max, process_set=self.process_set,
                                               name=name), now)

    def _settle(self):
        """At exit: the agreement in flight, waited for."""
        if self._agreeing is not None:
            _hvd.synchronize(self._agreeing[0])

    def _probe(self, density, launches, step, moved):
        planner = self.planner
        link = measure(self.process_set)
        relinked, before, after = judge_probe(planner, link, density, launches,
                                              self.state.watch.change, moved)
        if relinked:
            was = planner.link
            planner.relink(link)
            if _hvd.rank() == 0:
                print(relinked_words(step, link, was, before, after, planner, density),
                      flush=True)  # (short by default; the full story with verbose)
        self.state.probed(relinked, step)


