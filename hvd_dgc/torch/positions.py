"""A tensor's selected positions as bytes, coded near their information content: Elias-Fano
or a bitmap, whichever is smaller (the format and its sizes: hvd_dgc/packing.py; the
NumPy reference this is held to: tests/reference.py ``encode_positions``). The same
module, with the same functions, is hvd_dgc/tensorflow/positions.py. Not yet used by a
path: the wire still carries int32 positions."""

import torch

from hvd_dgc.packing import elias_fano_low_bits, index_code

__all__ = ["encode_positions", "decode_positions"]


def _bytes_of(bits):
    """uint8 bits (any length) -> bytes, least significant bit first."""
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def _bits_of(blob):
    shifts = torch.arange(8, dtype=torch.uint8, device=blob.device)
    return ((blob.view(-1, 1) >> shifts) & 1).reshape(-1)


def encode_positions(positions, n):
    """``positions`` (sorted, distinct, in 0..n-1; an integer tensor) as a uint8 tensor
    of ``packing.index_bytes(n, k)`` bytes."""
    p = positions.reshape(-1).to(torch.int64)
    k = p.numel()
    if index_code(n, k) == "bitmap":
        bits = torch.zeros(n, dtype=torch.uint8, device=p.device)
        bits[p] = 1
        return _bytes_of(bits)
    low = elias_fano_low_bits(n, k)
    lows = (p.view(-1, 1) >> torch.arange(low, device=p.device)) & 1  # position i: [i L, ..)
    high = torch.zeros(k + ((n - 1) >> low) + 1, dtype=torch.uint8, device=p.device)
    high[(p >> low) + torch.arange(k, device=p.device)] = 1
    return _bytes_of(torch.cat([lows.reshape(-1).to(torch.uint8), high]))


def decode_positions(blob, n, k):
    """Inverse of ``encode_positions``: the k sorted positions (int64)."""
    bits = _bits_of(blob)
    if index_code(n, k) == "bitmap":
        return torch.nonzero(bits[:n]).reshape(-1)
    low = elias_fano_low_bits(n, k)
    weights = torch.ones(1, dtype=torch.int64, device=blob.device) << torch.arange(
        low, device=blob.device)
    lows = (bits[:k * low].view(k, low).to(torch.int64) * weights).sum(1)
    ones = torch.nonzero(bits[k * low:]).reshape(-1)[:k]
    return ((ones - torch.arange(k, device=blob.device)) << low) | lows
