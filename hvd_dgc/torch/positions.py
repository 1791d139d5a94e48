"""A tensor's selected positions as bytes, coded near their information content: Elias-Fano
or a bitmap, whichever is smaller (the format and its sizes: hvd_dgc/packing.py; the
NumPy reference this is held to: tests/reference.py ``encode_positions``).
hvd_dgc/tensorflow/positions.py has the same positions' functions. PyTorch's allgather
path sends its records' positions so (paths.py ``AllgatherPath``), and decodes every
rank's at once (``decode_positions_many``); on the CPU the C++ kernel writes and reads
the bits. Their values go in 8 bits where the compressor says so (``encode_values``:
float8 e4m3 and a scale per tensor, hvd_dgc/packing.py), as TensorFlow's do."""

import torch

from hvd_dgc.packing import FP8_MAX, elias_fano_low_bits, gather_value_bits, index_bytes, \
    index_code
from hvd_dgc.torch.memory import fused_kernel_available

__all__ = ["encode_positions", "decode_positions", "decode_positions_many", "encode_records",
           "decode_records", "sorted_on_host", "encode_values", "decode_values",
           "gather_dtype", "tensor_of"]

FP8 = torch.float8_e4m3fn
KERNEL = True  # (False: ATen's operations on the CPU too, as on an accelerator; tests)


def _bytes_of(bits):
    """uint8 bits (any length) -> bytes, least significant bit first."""
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def _bits_of(blob):
    shifts = torch.arange(8, dtype=torch.uint8, device=blob.device)
    return ((blob.view(-1, 1) >> shifts) & 1).reshape(-1)


def _by_kernel(t):
    """Code on the CPU with the C++ kernel (hvd_dgc/torch/csrc), where it is built: a
    word at a time instead of ATen's passes over every bit (the same bytes)."""
    return KERNEL and t.device.type == "cpu" and fused_kernel_available()


def encode_positions(positions, n):
    """``positions`` (sorted, distinct, in 0..n-1; an integer tensor) as a uint8 tensor
    of ``packing.index_bytes(n, k)`` bytes."""
    p = positions.reshape(-1).to(torch.int64)
    k = p.numel()
    if _by_kernel(p):
        bitmap = index_code(n, k) == "bitmap"
        return torch.ops.hvd_dgc.encode_positions(
            p.contiguous(), n, 0 if bitmap else elias_fano_low_bits(n, k), bitmap,
            index_bytes(n, k))
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
    return decode_positions_many(blob.view(1, -1), n, k).view(-1)


def decode_positions_many(blobs, n, k):
    """``decode_positions`` of each row of ``blobs`` (rows of one length: every rank's
    code of k positions among n) in a fixed number of operations: ``(rows, k)`` int64.
    The number of ones is known (k a row), so no read-back waits for the device."""
    rows, device = blobs.shape[0], blobs.device
    if _by_kernel(blobs):
        bitmap = index_code(n, k) == "bitmap"
        return torch.ops.hvd_dgc.decode_positions(
            blobs.contiguous(), n, k, 0 if bitmap else elias_fano_low_bits(n, k), bitmap)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = ((blobs.unsqueeze(-1) >> shifts) & 1).view(rows, -1)
    if index_code(n, k) == "bitmap":
        return torch.nonzero_static(bits[:, :n], size=rows * k)[:, 1].view(rows, k)
    low = elias_fano_low_bits(n, k)
    weights = torch.ones(1, dtype=torch.int64, device=device) << torch.arange(
        low, device=device)
    lows = (bits[:, :k * low].reshape(rows, k, low).to(torch.int64) * weights).sum(2)
    ones = torch.nonzero_static(bits[:, k * low:], size=rows * k)[:, 1].view(rows, k)
    return ((ones - torch.arange(k, device=device)) << low) | lows


def sorted_on_host(positions):
    """Are ``positions`` on the CPU and increasing? (On an accelerator the look would be
    a wait for the device: there the answer is no.)"""
    return positions.device.type == "cpu" and bool((positions[1:] > positions[:-1]).all())


def encode_records(positions, values, n, dtype):
    """Records as bytes: the positions (distinct, in 0..n-1, any order) coded, then the
    values at them, as ``dtype``, in position order. A CPU selection's positions come
    sorted, and are then not sorted again (looking costs a hundredth of a sort; on an
    accelerator it would cost a wait for the device, so there they are sorted)."""
    if not sorted_on_host(positions):
        positions, order = torch.sort(positions)
        values = values[order]
    return torch.cat([encode_positions(positions, n), values.to(dtype).view(torch.uint8)])


def decode_records(blocks, n, k, dtype):
    """Every row of ``blocks`` (each rank's bytes, one length) as ``encode_records`` wrote
    k of them first: ``(positions, values, rest)``, ``(rows, k)`` each and the bytes after
    the records."""
    rows, code = blocks.shape[0], index_bytes(n, k)
    end = code + k * dtype.itemsize
    values = blocks[:, code:end].clone(memory_format=torch.contiguous_format).view(dtype)
    return decode_positions_many(blocks[:, :code], n, k), values, blocks[:, end:]


def gather_dtype(compressor, density=None):
    """The dtype of a record's value on the allgather (packing.gather_value_bits)."""
    return {8: FP8, 16: torch.float16, 32: torch.float32}[
        gather_value_bits(compressor, density)]


def encode_values(values, tensor, tensors):
    """``values`` of ``tensors`` tensors (``tensor``: each value's, in 0..tensors-1) in 8
    bits (hvd_dgc/packing.py): ``(codes, scales, arrived)``, the float8 e4m3 codes, each
    tensor's float32 scale (its largest finite magnitude / 448; 1 where it has none) and
    each value as it arrives. A value that is not finite goes as NaN, which the guard
    sees (a cast would saturate it to 448)."""
    finite = torch.isfinite(values)
    magnitudes = torch.where(finite, values.abs(), 0.0).float()
    largest = magnitudes.new_zeros(tensors).scatter_reduce_(0, tensor, magnitudes, "amax")
    scales = torch.where(largest > 0, largest / FP8_MAX, 1.0)
    scale = scales[tensor]
    codes = torch.where(finite, values / scale, float("nan")).to(FP8)
    return codes, scales, codes.float() * scale


def decode_values(codes, scale):
    """Inverse of ``encode_values``: ``codes`` (float8) times each one's tensor's scale."""
    return codes.float() * scale


def tensor_of(positions, starts):
    """Each position's tensor, the tensors starting at ``starts`` (increasing, a tensor
    on the positions' device)."""
    return torch.searchsorted(starts, positions.contiguous(), right=True) - 1
