"""Wire sizes of the quantising compressors, framework-free (payload layouts and stats).

Codes of ``width`` bits are stored as ``width`` bit planes of ``ceil(n/8)``
bytes each (plane j holds bit j of every code, 8 codes per byte): packing is
then one vectorised pass per bit for any width, and 1-bit signs cost exactly
``ceil(n/8)`` bytes.
"""

import math

__all__ = ["plane_bytes", "level_bits", "num_buckets", "sign_payload_bytes",
           "qsgd_payload_bytes", "check_qsgd", "SCALE_BYTES"]

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
