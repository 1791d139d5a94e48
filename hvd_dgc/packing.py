"""Wire sizes of the quantising compressors, framework-free (payload layouts and stats).

Codes of ``width`` bits are stored as ``width`` bit planes of ``ceil(n/8)``
bytes each (plane j holds bit j of every code, 8 codes per byte): packing is
then one vectorised pass per bit for any width, and 1-bit signs cost exactly
``ceil(n/8)`` bytes.
"""

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from hvd_dgc.aggregation import chunk_spans, quota, regions

__all__ = ["plane_bytes", "level_bits", "num_buckets", "sign_payload_bytes", "sign_segments",
           "sign_chunk_bytes", "sign_reduce_bytes", "sign_shares", "SIGN_COLLECTIVES",
           "check_sign_collective", "sign_reduces", "reduces_signs", "exchange_bytes",
           "qsgd_payload_bytes", "check_qsgd", "SCALE_BYTES", "elias_fano_low_bits",
           "elias_fano_bytes", "index_code", "index_bytes", "gather_index_bytes",
           "gather_record_bytes", "values_bytes", "gather_block_bytes", "fold_block_bytes",
           "fold_index_bytes",
           "FP8_MAX", "GATHER_VALUE_BITS",
           "check_value_bits", "gather_value_bits", "gather_value_bytes", "folds_values",
           "RegionLayout", "region_layout", "region_block_bytes", "region_record_bytes",
           "region_record", "region_value_bits", "REGION_COUNT_BYTES", "shares_of"]

SCALE_BYTES = 4  # one float32 scale or norm


def plane_bytes(n, width=1):
    """Bytes of ``n`` codes of ``width`` bits as bit planes."""
    return width * ((n + 7) // 8)


def level_bits(levels):
    """Bits for a level in 0..levels (QSGD's s levels above zero)."""
    return max(1, math.ceil(math.log2(levels + 1)))


def num_buckets(n, bucket_size):
    return (n + bucket_size - 1) // bucket_size


def sign_payload_bytes(n):
    """EF-SignSGD: one bit per element, plus the float32 scale ||p||_1 / n."""
    return plane_bytes(n, 1) + SCALE_BYTES


def _total(numels):
    """Elements of tensors of ``numels`` elements (an int: one tensor)."""
    return numels if isinstance(numels, int) else sum(int(n) for n in numels)


def sign_segments(numels, world):
    """Scales in each chunk of the sign's compressed allreduce of tensors of ``numels``
    elements (an int: one tensor): the most segments any chunk holds
    (hvd_dgc.aggregation.sign_rows), at least one."""
    if isinstance(numels, int):
        return 1
    return _segments(tuple(int(n) for n in numels), max(1, world))


@lru_cache(maxsize=64)
def _segments(numels, world):
    """``sign_segments`` of a group (a tuple): asked at every launch for its bytes, and
    O(N) to count, so kept for the few groups a run has."""
    return max(1, max(len(spans) for spans in chunk_spans(numels, world)))


def sign_chunk_bytes(numels, world):
    """The sign's compressed allreduce (1-bit Adam's, with a scale per segment): tensors
    of ``numels`` elements (an int: one tensor) one after the other, in ``world`` chunks
    (hvd_dgc.aggregation.sign_rows: contiguous, the first total % N one longer), each
    chunk on the wire as its float32 scales (one per tensor it holds part of, as many as
    the chunk that holds most) and its signs, one bit each, padded to the longest
    chunk's ceil(total / N): the same size for every chunk."""
    total = _total(numels)
    return SCALE_BYTES * sign_segments(numels, world) + \
        plane_bytes(-(-total // world) if world else total, 1)


def sign_reduce_bytes(numels, world):
    """``(sent, received)`` bytes of one rank in the sign's compressed allreduce of
    tensors of ``numels`` elements (an int: one tensor): its chunks to their owners (an
    alltoall), then its own chunk's average re-signed to every rank (an allgather). What
    a rank receives, 2 (N-1) chunks, is about 2 (N-1)/N n/8 bytes: flat in N, where the
    allgather of every rank's signs receives (N-1) n/8."""
    if world < 2:
        return sign_payload_bytes(_total(numels)), 0
    chunk = sign_chunk_bytes(numels, world)
    return world * chunk, 2 * (world - 1) * chunk


def sign_shares(numels, world):
    """A group's ``sign_reduce_bytes(numels, world)[0]`` as each tensor's share (in
    proportion to its elements, the remainder to the last): what the statistics count
    for each."""
    numels = [int(n) for n in numels]
    return shares_of(sign_reduce_bytes(numels, world)[0], numels)


def shares_of(total, weights):
    """``total`` bytes shared in proportion to ``weights`` (integers; the remainder, or
    all where the weights are zero, to the last): a launch's bytes as its tensors' in the
    statistics."""
    weights = list(weights)
    whole = sum(weights)
    shares = [total * w // whole for w in weights] if whole else [0] * len(weights)
    shares[-1] += total - sum(shares)
    return shares


#: the sign compressor's ``collective`` option: "allgather" (every rank's signs to every
#: rank), "allreduce" (the compressed allreduce, ``sign_reduce_bytes``) or "auto"
SIGN_COLLECTIVES = ("auto", "allgather", "allreduce")


def check_sign_collective(collective):
    if collective not in SIGN_COLLECTIVES:
        raise ValueError(f"Compression.sign's collective must be one of {SIGN_COLLECTIVES}, "
                         f"got {collective!r}")
    return collective


def sign_reduces(collective, world):
    """Does the sign go as the compressed allreduce on ``world`` ranks? "allreduce": from 2
    ranks; "auto": from 3, where it receives fewer bytes than the allgather for any
    tensor of more than 96 elements (at 2 ranks both move one rank's signs, and the
    allgather in one round, exactly); "allgather" (or a compressor without the option:
    None): never."""
    return world >= (2 if collective == "allreduce" else 3) and \
        collective in ("allreduce", "auto")


def reduces_signs(compressor, world):
    """Does ``compressor`` send its tensors as the sign's compressed allreduce on ``world``
    ranks (``sign_reduces`` of its ``collective``; a compressor without one never)?"""
    return sign_reduces(getattr(compressor, "collective", None), world)


def exchange_bytes(compressor, n, world):
    """``(sent, received)`` bytes of one rank for a tensor of ``n`` elements that a payload
    compressor (sign, QSGD, bf16: ``payload_bytes``) exchanges on ``world`` ranks."""
    if reduces_signs(compressor, world):
        return sign_reduce_bytes(n, world)
    payload = compressor.payload_bytes(n)
    return payload, (world - 1) * payload


def qsgd_payload_bytes(n, levels, bucket_size):
    """QSGD: a float32 norm per bucket, then sign + level bits per element."""
    return num_buckets(n, bucket_size) * SCALE_BYTES + plane_bytes(n, 1 + level_bits(levels))


def check_qsgd(levels, bucket_size):
    """QSGD's options, as both frameworks' compressors accept them: a level fits in 7
    bits beside the sign bit; a bucket holds at least one element."""
    if not isinstance(levels, int) or not 1 <= levels <= 127:
        raise ValueError(f"QSGD levels must be an int in 1..127, got {levels!r}")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"QSGD bucket_size must be an int >= 1, got {bucket_size!r}")


# -- a tensor's selected positions, coded near their information content -----------------
# k sorted positions among n take about log2(C(n, k)) ~ k (log2(n/k) + 1.44) bits; as
# int32 they take 32k. Elias-Fano coding (Elias 1974, Fano 1971) keeps each position's
# low L = floor(log2(n/k)) bits as they are and its high part in unary. One bit stream,
# least significant bit first: position i's low bits at bits [i L, (i + 1) L), then a bit
# vector of k + ((n-1) >> L) + 1 bits in which bit (p_i >> L) + i is set. That is at
# most k (L + 2) + 1 bits, known from (n, k) alone, so every rank's records of a tensor
# have the same size (an allgather of equal blocks), and coding and decoding are a few
# vectorised passes (no bit-serial loop). Where k is a large share of n a bitmap of n
# bits is smaller: the code is whichever is smaller (``index_code``).
# The NumPy reference both frameworks are held to: tests/reference.py ``encode_positions``.


def elias_fano_low_bits(n, k):
    """L: the low bits of each position kept as they are, floor(log2(n / k)) (0 where
    k > n / 2)."""
    if k < 1 or n < 1:
        raise ValueError(f"positions need n >= 1 and k >= 1, got n={n}, k={k}")
    return max(0, (n // k).bit_length() - 1)


def elias_fano_bytes(n, k):
    """Bytes of k positions among n, Elias-Fano coded (one bit stream)."""
    low = elias_fano_low_bits(n, k)
    return (k * low + k + ((n - 1) >> low) + 1 + 7) // 8


def index_code(n, k):
    """"bitmap" or "elias-fano": the smaller code of k positions among n (the bitmap on
    a tie)."""
    return "elias-fano" if elias_fano_bytes(n, k) < (n + 7) // 8 else "bitmap"


def index_bytes(n, k):
    """Bytes of k positions among n in their smaller code."""
    return min(elias_fano_bytes(n, k), (n + 7) // 8)


def _codes_positions(compressor):
    """Does the allgather path code this compressor's positions (both frameworks')?"""
    return getattr(compressor, "codes_positions", False)


def gather_index_bytes(compressor, n, k):
    """A record's position on the allgather path of ``k`` records among ``n``: coded
    where the compressor's records are (``codes_positions``: hvd_dgc's compressors,
    about 12 bits at density 0.001), else an int32 (hierarchical DGC sends those)."""
    if _codes_positions(compressor) and 0 < k < n:
        return index_bytes(n, k) / k
    return 4


def fold_index_bytes(compressor):
    """A dense element's position where it rides in the allgather (folded): none where
    the positions are coded (its values alone: every index, which every rank knows),
    else an int32 record's."""
    return 0 if _codes_positions(compressor) else 4


# -- a record's value on the allgather ---------------------------------------------------
# Where the values go in 8 bits (``value_bits=8``, the default), each is a float8
# e4m3 code of ``value / scale``, one float32 ``scale`` per tensor (its largest finite
# magnitude / 448, so the largest maps to e4m3's largest): 1/16 relative precision over
# the 2**17 of range below it, and 0 exact (a filler record, a folded tensor's zeros).
# What the rounding loses stays in the memory (error feedback): delayed, never lost.
# The NumPy reference both frameworks are held to: tests/reference.py ``fp8_values``.
FP8_MAX = 448.0
GATHER_VALUE_BITS = (8, 16, 32)


def check_value_bits(value_bits):
    if isinstance(value_bits, bool) or value_bits not in GATHER_VALUE_BITS:
        raise ValueError(f"value_bits must be one of {GATHER_VALUE_BITS} (the bits of each "
                         f"value the allgather sends), got {value_bits!r}")
    return value_bits


def gather_value_bits(compressor, density=None):
    """The bits of a record's value on the allgather path: the compressor's
    ``value_bits``, at most 16 where its records are fp16 (``fp16_values``). At
    ``density`` 1 the records carry every element, and their values go whole (fp32, or
    fp16 with ``fp16_values``): density 1.0 is dense averaging, exact."""
    bits = 8 * getattr(compressor, "value_bytes", 4)
    if density is not None and density >= 1:
        return bits
    return min(bits, getattr(compressor, "value_bits", bits))


def folds_values(bits, dense_fp16):
    """May a launch's dense tensors ride in its allgather, whose values go in ``bits``?
    In 8 bits always (their rounding kept in their own residual, as the records'); else
    only where those values have the dense allreduce's width (fp16 on both, or fp32)."""
    return bits == 8 or dense_fp16 == (bits == 16)


def gather_value_bytes(compressor, k, tensors=1):
    """A record's value on the allgather path, among ``k`` records of ``tensors``
    tensors: in 8 bits, a byte and a share of each tensor's float32 scale."""
    bits = gather_value_bits(compressor)
    if bits == 8:
        return 1 + SCALE_BYTES * tensors / max(k, 1)
    return bits // 8


def values_bytes(count, value_bits):
    """One tensor's ``count`` values in ``value_bits``, and in 8 bits its float32 scale."""
    return count * value_bits // 8 + (SCALE_BYTES if value_bits == 8 else 0)


def gather_block_bytes(n, k, value_bits):
    """One tensor's k records on the allgather, coded: their positions
    (``index_bytes``), then their values (``values_bytes``). TensorFlow codes every
    tensor's positions so; PyTorch codes a part's positions together and shares the
    code among its tensors (torch/paths.py ``record_bytes``)."""
    return index_bytes(n, k) + values_bytes(k, value_bits)


def fold_block_bytes(n, value_bits):
    """A dense tensor of ``n`` elements folded into the allgather: its values alone
    (every index, which every rank knows)."""
    return values_bytes(n, value_bits)


def gather_record_bytes(compressor, n, k):
    """A record on the allgather path: its position and its value."""
    return gather_index_bytes(compressor, n, k) + gather_value_bytes(compressor, k)


# -- region reduce's records, coded (hvd_dgc/torch/region.py) ----------------------------
# Owner j of a launch's tensors holds, of tensor t, the indices i = j + R_t m (R_t =
# aggregation.regions(k_t, N)): m in 0..size(j, t)-1. Its region space is those of every
# tensor one after the other: position offset(j, t) + i // R_t, in 0..space(j)-1. Both
# rounds send an owner's records as one block of that space, its positions coded as the
# allgather's are (Elias-Fano or a bitmap, ``index_bytes``), so an index costs about
# log2(space / count) + 2 bits, not 32:
#     [count: int32][scale: float32, 8-bit values only, count > 0][positions][values]
# The values in ``value_bits`` (8: float8 e4m3 of value / scale, the block's largest
# finite magnitude / 448, as ``fp8_values``; 16: fp16; 32: as they are), what the
# rounding loses kept by whoever rounded (the sender's memory, the owner's residual).
# The optimizer sends them whole (``region_value_bits``).
# An owner whose space is empty (a tensor of few records has fewer regions than ranks)
# gets no block at all: every rank knows the spaces. The NumPy reference both rounds are
# held to: tests/reference.py ``region_reduce_coded``.
REGION_COUNT_BYTES = 4


class RegionLayout(NamedTuple):
    """The region spaces of a launch's tensors on ``world`` ranks."""

    regions: tuple     # R_t per tensor
    offsets: np.ndarray  # (world, tensors) int64: tensor t's first position in owner j's space
    spaces: np.ndarray   # (world,) int64: owner j's space


@lru_cache(maxsize=256)
def region_layout(numels, ks, world):
    """``RegionLayout`` of tensors of ``numels`` elements selecting ``ks`` (tuples) on
    ``world`` ranks (the same on every rank: kept for the few launches a run has)."""
    r = np.array([regions(k, world) for k in ks], np.int64)
    n = np.array(numels, np.int64)
    owner = np.arange(world, dtype=np.int64)[:, None]
    sizes = np.where(owner < r, np.maximum(0, (n - owner + r - 1) // r), 0)
    offsets = np.cumsum(sizes, axis=1) - sizes
    return RegionLayout(tuple(int(x) for x in r), offsets, sizes.sum(axis=1))


def region_block_bytes(space, count, value_bits):
    """Bytes of one owner's block of ``count`` records in a region space of ``space``
    positions (none where the space is empty)."""
    if space == 0:
        return 0
    if count == 0:
        return REGION_COUNT_BYTES
    scale = SCALE_BYTES if value_bits == 8 else 0
    return REGION_COUNT_BYTES + scale + index_bytes(space, count) + count * value_bits // 8


def region_record_bytes(n, k, world, value_bits):
    """A record's bytes on region reduce's coded wire, over both rounds, for a tensor of
    ``n`` elements selecting ``k`` on ``world`` ranks (what the cost model prices, the
    blocks' counts and scales left out): the alltoall's k(N-1)/N records at the
    selection's density (about ``index_bytes(n, k) / k``), the allgather's quota R(N-1)/N
    at twice it, each with a value of ``value_bits``."""
    if k < 1 or n < 1 or world < 2:
        return 4 + value_bits / 8
    r, q = regions(k, world), quota(k, world)
    space = -(-n // r)
    first, second = k, q * r
    positions = index_bytes(n, min(k, n)) + r * index_bytes(space, min(q, space))
    return positions / (first + second) + value_bits / 8


def region_value_bits(compressor):
    """The bits of a value on region reduce's wire: whole, fp32 (fp16 where the
    compressor's records are, ``fp16_values``). In 8 bits, as on the allgather, region
    reduce trained digits 0.49 points below its fp32 values at 4 ranks (8 seeds,
    deterministic; bench/results/region_accuracy.md): the owners' sums round twice."""
    return 8 * getattr(compressor, "value_bytes", 4)


def region_record(compressor, n, k, world):
    """A record on region reduce's wire as ``compressor``'s path sends it: coded where
    the compressor's region records are (``codes_regions``: PyTorch's,
    ``region_record_bytes``), else an int32 index and a value (TensorFlow's)."""
    if getattr(compressor, "codes_regions", False):
        return region_record_bytes(n, k, world, region_value_bits(compressor))
    return getattr(compressor, "record_bytes", 8)
