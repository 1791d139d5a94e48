"""DGC's own work on this device (hvd_dgc/localcost.py) with the compressor's own
selection and record handling, or a payload compressor's encoding and decoding:
``cost_model="measure"`` (the link itself is timed by hvd_dgc/linkprobe.py on the seam,
hvd_dgc/seam.py)."""

import time

import torch

from hvd_dgc.localcost import CALIBRATION_NUMEL, calibrate, calibrate_payload
from hvd_dgc.torch.memory import BLOCK
from hvd_dgc.torch.positions import FP8, decode_records, decode_values, encode_records, \
    encode_values, gather_dtype

__all__ = ["measure_local", "measure_payload"]


def measure_local(compressor, collectives, density, device):
    """The ``LocalCost`` of ``compressor`` (a sparse one: ``pick``) on ``device``, agreed
    over ``collectives`` (hvd_dgc/seam.py: the slowest rank's; ``python -m
    hvd_dgc.predict`` passes ``Alone()``): a launch's selection over a synthetic memory,
    and its records taken out of the memory, coded, decoded and added, as the allgather
    path does (positions.py)."""
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

        dtype = gather_dtype(compressor)
        tensor = torch.zeros(k, dtype=torch.int64, device=device)

        def once():
            values = memory.index_select(0, positions)  # what leaves the memory
            memory.index_fill_(0, positions, 0.0)
            if dtype == FP8:  # in 8 bits, the rounding back into the memory
                codes, scales, arrived = encode_values(values, tensor, 1)
                memory.index_add_(0, positions, values - arrived)
                values = codes
            wire = encode_records(positions, values, CALIBRATION_NUMEL, dtype)
            at, got, _ = decode_records(wire.view(1, -1), CALIBRATION_NUMEL, k, dtype)
            if dtype == FP8:
                got = decode_values(got, scales[0])
            out.index_add_(0, at.view(-1), got.view(-1).float())
        return _fastest(once, v.device)
    return calibrate(select, records, collectives, density)


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
    return calibrate_payload(encode, decode, collectives)
