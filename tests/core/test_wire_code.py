"""Selected positions coded near their information content (hvd_dgc/packing.py): the sizes
the planner can price, and the NumPy reference both frameworks will be held to
(tests/reference.py ``encode_positions``), checked on hand-derived vectors."""

import math

import numpy as np
import pytest

from harness.shapes import numel, resnet50_shapes
from hvd_dgc.packing import elias_fano_bytes, elias_fano_low_bits, index_bytes, index_code
from hvd_dgc.schedule import num_selected
from tests import reference as ref


def test_four_positions_among_sixteen_by_hand():
    """n = 16, positions 1, 4, 5, 12: L = floor(log2(16 / 4)) = 2. Low parts 1, 0, 1, 0
    in 2-bit fields (1 + (1 << 4) = 17); then high parts 0, 1, 1, 3 plus their index
    0..3 set bits 0, 2, 3, 6 of an 8-bit vector (1 + 4 + 8 + 64 = 77). Two bytes, as the
    bitmap (bits 1, 4, 5 | 12): on a tie the bitmap is the code."""
    positions, n = [1, 4, 5, 12], 16
    assert elias_fano_low_bits(n, 4) == 2
    assert ref.encode_positions(positions, n, "elias-fano").tolist() == [17, 77]
    assert ref.encode_positions(positions, n, "bitmap").tolist() == [2 + 16 + 32, 16]
    assert (elias_fano_bytes(n, 4), index_bytes(n, 4), index_code(n, 4)) == (2, 2, "bitmap")
    assert ref.encode_positions(positions, n).tolist() == [50, 16]
    for code in ("elias-fano", "bitmap", None):
        assert ref.decode_positions(ref.encode_positions(positions, n, code), n, 4,
                                    code).tolist() == positions


def test_four_positions_among_4096_by_hand():
    """n = 4096, positions 3, 1000, 1025, 4095: L = 10. Low parts 3, 1000, 1, 1023 in
    10-bit fields, then high parts 0, 0, 1, 3 plus 0..3 set bits 0, 1, 3, 6 (75) of an
    8-bit vector: 48 bits, six bytes, where int32 indices take 16 and the bitmap 512."""
    positions, n = [3, 1000, 1025, 4095], 4096
    stream = 3 | 1000 << 10 | 1 << 20 | 1023 << 30 | 75 << 40
    assert bytes(ref.encode_positions(positions, n)) == stream.to_bytes(6, "little")
    assert (elias_fano_bytes(n, 4), index_code(n, 4)) == (6, "elias-fano")
    assert ref.decode_positions(list(stream.to_bytes(6, "little")), n, 4).tolist() == \
        positions


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (7, 7), (9, 3), (1000, 1), (1000, 999),
                                 (65536, 65), (100003, 100), (25088, 2048)])
def test_every_code_round_trips_at_the_size_the_planner_prices(n, k):
    rng = np.random.default_rng(n + k)
    for draw in range(3):
        positions = np.sort(rng.choice(n, k, replace=False))
        if draw == 1:  # the ends of the range
            positions = np.unique(np.concatenate([[0, n - 1], positions]))[:k]
            positions = np.sort(positions)
        for code in ("elias-fano", "bitmap"):
            blob = ref.encode_positions(positions, n, code)
            assert len(blob) == (elias_fano_bytes(n, k) if code == "elias-fano"
                                 else (n + 7) // 8)
            assert ref.decode_positions(blob, n, k, code).tolist() == positions.tolist()
        assert len(ref.encode_positions(positions, n)) == index_bytes(n, k)


def test_positions_of_resnet50_at_dgc_density_cost_near_their_information():
    """Each of ResNet-50's tensors of 1,024 elements or more at density 0.001: the code
    within 10% (plus a byte) of log2(C(n, k)) bits, the fewest any code of k positions
    among n can average; int32 indices cost 2.8-3.4x that."""
    worst, int32_over = 0.0, []
    for _, shape in resnet50_shapes():
        n = numel(shape)
        if n < 1024:
            continue
        k = num_selected(n, 0.001)
        bound = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / \
            math.log(2) / 8
        worst = max(worst, (index_bytes(n, k) - 1) / bound)
        int32_over.append(4 * k / bound)
    assert worst < 1.10, worst
    assert 2.7 < min(int32_over) and max(int32_over) < 3.5, (min(int32_over),
                                                             max(int32_over))


def test_resnet50s_positions_encode_at_the_size_bench_record_sizes_prices():
    """bench/record_sizes.py prices from the formulas: every ResNet-50 tensor's positions
    at densities 0.001 and 0.01, encoded and decoded by the reference, at that size."""
    rng = np.random.default_rng(0)
    for density in (0.001, 0.01):
        for _, shape in resnet50_shapes():
            n = numel(shape)
            k = num_selected(n, density)
            positions = np.sort(rng.choice(n, k, replace=False))
            blob = ref.encode_positions(positions, n)
            assert len(blob) == index_bytes(n, k), (shape, density)
            assert (ref.decode_positions(blob, n, k) == positions).all(), (shape, density)


def test_bad_counts_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="n=0, k=1"):
        elias_fano_low_bits(0, 1)
    with pytest.raises(ValueError, match="n=5, k=0"):
        elias_fano_bytes(5, 0)


CASES = [(16, [1, 4, 5, 12]), (4096, [3, 1000, 1025, 4095]), (1, [0]), (9, [0, 8]),
         (1000, list(range(999)))]


def _random_cases():
    rng = np.random.default_rng(7)
    for n, k in [(65536, 65), (100003, 100), (25088, 2048), (2359296, 2360), (300, 150)]:
        yield n, np.sort(rng.choice(n, k, replace=False)).tolist()


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_both_frameworks_code_positions_byte_for_byte_as_the_reference(framework):
    """PyTorch's and TensorFlow's coding (hvd_dgc/torch/positions.py,
    hvd_dgc/tensorflow/positions.py, one module name) equal the NumPy reference byte for
    byte, and decode to the positions."""
    if framework == "torch":
        import torch
        from hvd_dgc.torch.positions import decode_positions, encode_positions

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64)
    else:
        import tensorflow as tf
        from hvd_dgc.tensorflow.positions import decode_positions, encode_positions

        def tensor(values):
            return tf.constant(values, tf.int64)
    for n, positions in CASES + list(_random_cases()):
        k = len(positions)
        blob = np.asarray(encode_positions(tensor(positions), n))
        assert blob.dtype == np.uint8 and blob.tolist() == \
            ref.encode_positions(positions, n).tolist(), (framework, n, k)
        if framework == "torch":
            got = decode_positions(torch.from_numpy(blob), n, k).numpy()
        else:
            got = decode_positions(tf.constant(blob), n, k).numpy()
        assert got.tolist() == positions, (framework, n, k)


def test_torch_decodes_every_ranks_code_at_once():
    """The allgather's receive (hvd_dgc/torch/positions.py ``decode_positions_many``):
    the rows of every rank's code of k positions among n, bitmap and Elias-Fano alike,
    decode to each rank's positions."""
    import torch
    from hvd_dgc.torch.positions import decode_positions_many

    rng = np.random.default_rng(11)
    for n, k in [(16, 4), (300, 150), (65536, 65), (25088, 2048), (1000, 1), (64, 64)]:
        rows = [np.sort(rng.choice(n, k, replace=False)) for _ in range(3)]
        blobs = np.stack([ref.encode_positions(r.tolist(), n) for r in rows])
        got = decode_positions_many(torch.from_numpy(blobs), n, k).numpy()
        assert got.shape == (3, k) and (got == np.stack(rows)).all(), (n, k)


def test_a_selection_short_of_k_is_filled_with_elements_it_did_not_pick():
    """PyTorch's allgather sends k slots a tensor (a fixed size every step); where a CPU
    selection picked fewer, the rest are positions of the members' own elements it did
    not pick (value 0), never the alignment between members (paths.py ``_unpicked``)."""
    from types import SimpleNamespace
    import torch
    from hvd_dgc.torch.paths import _unpicked

    part = SimpleNamespace(members=(SimpleNamespace(numel=5), SimpleNamespace(numel=40)),
                           ks=(2, 3), lo=32, offsets=(32, 64))
    # member 0 (part positions 0-4, then alignment to 32) picked 1; member 1 picked 0, 2
    picked = torch.tensor([1, 32, 34])
    assert _unpicked(part, (1, 2), picked).tolist() == [0, 2]
    assert _unpicked(part, (0, 0), torch.tensor([], dtype=torch.long)).tolist() == \
        [0, 1, 32, 33, 34]
    full = SimpleNamespace(members=(SimpleNamespace(numel=3),), ks=(3,), lo=0, offsets=(0,))
    assert _unpicked(full, (1,), torch.tensor([1])).tolist() == [0, 2]


def test_padding_is_merged_into_the_sorted_selection():
    """paths.py ``_merged``: a sorted selection and the unpicked positions that fill its k
    slots, one sorted list, each value where its position went and 0 at the others; an
    unsorted selection is left to encode_records' sort."""
    import torch
    from hvd_dgc.torch.paths import _merged

    positions, more = torch.tensor([1, 5, 9]), torch.tensor([0, 6, 7, 12])
    out, values = _merged(positions, torch.tensor([10.0, 50.0, 90.0]), more)
    assert out.tolist() == [0, 1, 5, 6, 7, 9, 12]
    assert values.tolist() == [0.0, 10.0, 50.0, 0.0, 0.0, 90.0, 0.0]
    out, values = _merged(torch.tensor([9, 1]), torch.tensor([90.0, 10.0]), torch.tensor([0]))
    assert out.tolist() == [9, 1, 0] and values.tolist() == [90.0, 10.0, 0.0]


def test_8bit_values_by_hand():
    """float8 e4m3 of value / scale, the scale a tensor's largest magnitude / 448: the
    largest arrives exact, 0 stays 0, and e4m3's 3 bits of mantissa round the rest to
    the nearest (ties to even) of 8 steps an octave."""
    values = np.array([4.48, -1.0, 0.0, 1.3, 2.0], np.float32)  # one tensor: scale 0.01
    codes, scales, arrived = ref.fp8_values(values, [0] * 5, 1)
    assert scales.tolist() == [np.float32(4.48) / np.float32(448)]
    # 448 (the largest), -100 -> -96 (steps of 8 in 64..128: -96 and -104 equally near,
    # the even mantissa), 0, 130 -> 128 (steps of 16 in 128..256), 200 -> 192 (192 and
    # 208 equally near, the even mantissa)
    assert (codes.view(np.uint8)[[0, 2]] == [0x7E, 0]).all()
    assert arrived == pytest.approx(np.float32(0.01) * np.array([448, -96, 0, 128, 192]),
                                    rel=1e-6)


def test_torch_codes_8bit_values_byte_for_byte_as_the_reference():
    """Several tensors of different magnitudes, zeros, a non-finite value (NaN on the
    wire, which the guard sees: a cast would saturate it to 448), and one tensor that is
    all zeros (scale 1)."""
    import torch
    from hvd_dgc.torch.positions import decode_values, encode_values, tensor_of
    gen = np.random.default_rng(3)
    values = np.concatenate([gen.standard_normal(50) * 1e-5, gen.standard_normal(30) * 3e2,
                             np.zeros(4), gen.standard_normal(9)]).astype(np.float32)
    values[60] = np.inf
    tensor = np.repeat([0, 1, 2, 3], [50, 30, 4, 9])
    want_codes, want_scales, want = ref.fp8_values(values, tensor, 4)
    codes, scales, arrived = encode_values(torch.from_numpy(values), torch.from_numpy(tensor),
                                           4)
    assert np.array_equal(codes.view(torch.uint8).numpy(), want_codes)
    assert np.array_equal(scales.numpy(), want_scales) and want_scales[2] == 1.0
    assert np.array_equal(arrived.numpy(), want, equal_nan=True)
    assert np.isnan(want[60]) and np.isnan(want[30:80]).sum() == 1
    finite = np.isfinite(values)
    # relative error at most 1/16 where a value is within 2**-6 of its tensor's largest
    near = finite & (np.abs(values) >= want_scales[tensor] * 448 / 64)
    assert (np.abs(want - values)[near] <= np.abs(values)[near] / 16).all()
    # decoded from the wire, each by its tensor's scale, found from its position
    starts = torch.tensor([0, 50, 80, 84])
    at = tensor_of(torch.arange(93), starts)
    assert at.tolist() == tensor.tolist()
    got = decode_values(codes, scales[at])
    assert np.array_equal(got.numpy(), want, equal_nan=True)


def _fp8_cases():
    """One tensor's values each: normal magnitudes, values far below the largest (float8
    subnormals once scaled), zeros, a signed zero, a non-finite value, all zeros."""
    gen = np.random.default_rng(5)
    wide = (gen.standard_normal(200) * 10.0 ** gen.uniform(-9, 2, 200)).astype(np.float32)
    spiked = gen.standard_normal(40).astype(np.float32)
    spiked[[3, 17]] = [np.inf, -np.nan]
    return [wide, np.array([4.48, -1.0, 0.0, -0.0, 1.3, 2.0], np.float32), spiked,
            np.zeros(7, np.float32), np.array([-3e-30], np.float32)]


def test_tensorflow_codes_8bit_values_byte_for_byte_as_the_reference():
    """TensorFlow's float8 codes (hvd_dgc/tensorflow/positions.py ``encode_values``: TF
    cannot bitcast float8, so the code is made from the float8 value's float32 bits) are
    the NumPy reference's, byte for byte, then the tensor's float32 scale; each value
    arrives as the reference says, and ``decode_values`` reads the bytes back to it."""
    import tensorflow as tf
    from hvd_dgc.tensorflow.positions import decode_values, encode_values
    for values in _fp8_cases():
        k = values.size
        codes, scales, want = ref.fp8_values(values, np.zeros(k, np.int64), 1)
        blob, arrived = encode_values(tf.constant(values), 8)
        assert np.asarray(blob).tolist() == codes.tolist() + \
            list(scales.astype(np.float32).tobytes()), values
        assert np.array_equal(arrived.numpy(), want, equal_nan=True)
        back = decode_values(tf.reshape(blob, [1, -1]), k, 8).numpy()[0]
        assert np.array_equal(back, want, equal_nan=True)


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_tensorflow_records_are_the_references_positions_then_values(bits):
    """A tensor's k records on TensorFlow's allgather (``encode_records``): the positions
    as the reference codes them, then the values in ``bits`` (8: the reference's float8
    codes and the scale), ``packing.gather_block_bytes`` long; every rank's rows decode
    at once to each one's positions and values as they arrive."""
    import tensorflow as tf
    from hvd_dgc.packing import gather_block_bytes
    from hvd_dgc.tensorflow.positions import decode_records, encode_records
    gen = np.random.default_rng(bits)
    for n, k in [(4096, 41), (300, 150), (1000, 1), (64, 64)]:
        rows, wants = [], []
        for _ in range(3):
            positions = np.sort(gen.choice(n, k, replace=False))
            values = (gen.standard_normal(k) * 1e-3).astype(np.float32)
            blob, arrived = encode_records(tf.constant(positions), tf.constant(values), n, k,
                                           bits)
            if bits == 8:
                codes, scales, want = ref.fp8_values(values, np.zeros(k, np.int64), 1)
                tail = codes.tobytes() + scales.astype(np.float32).tobytes()
            else:
                want = values.astype(np.float16 if bits == 16 else np.float32)
                tail, want = want.tobytes(), want.astype(np.float32)
            blob = np.asarray(blob)
            assert blob.size == gather_block_bytes(n, k, bits), (n, k)
            assert blob.tobytes() == ref.encode_positions(positions, n).tobytes() + tail
            assert np.array_equal(arrived.numpy(), want)
            rows.append(blob)
            wants.append((positions, want))
        got_positions, got_values = decode_records(tf.constant(np.stack(rows)), n, k, bits)
        for (positions, want), p, v in zip(wants, got_positions.numpy(), got_values.numpy()):
            assert p.tolist() == positions.tolist() and np.array_equal(v, want), (n, k)


def test_the_wire_simulation_is_the_bytes_that_cross_a_real_link():
    """bench/wire.py's simulation (harness/wire_sim.py: the planner's paths, buckets and
    folds, the formats' sizes) gives the bytes a real 2-rank run sends and receives, byte
    for byte, on ResNet-50's shapes with the defaults (8-bit values); and they are what
    crosses the link: the ranks on two emulated hosts (horovodrun over ssh), the TCP
    payload each way over the last step within 3% of what the simulation says a rank
    receives (measured +0.7%: Horovod's own negotiation)."""
    import contextlib
    from harness.hosts import EmulatedHosts, available
    from harness.hvdrun import run
    from harness.wire_sim import step_bytes
    from harness.wire import QUIET, payload
    hosts_here, why = available()
    with EmulatedHosts(["h1:1", "h2:1"]) if hosts_here else contextlib.nullcontext() as on:
        real = run("harness.wire:step_bytes", np=2, timeout=300, hosts=on, env=QUIET,
                   kwargs={"model": "resnet50", "mode": "sgd_dgc"})[0]
    sim = step_bytes("resnet50", "sgd_dgc", 2)
    assert real["sent"] == round(sim["sent"]) and real["received"] == sim["received"]
    assert real["paths"] == sim["paths"] == {"dense": 85, "sparse": 76}
    assert real["dense_sent"] / real["sent"] > 1000  # 1164x, 437x with fp32 values
    if not hosts_here:
        pytest.skip(f"the link's bytes: emulated hosts unavailable here: {why}")
    for crossed in payload(real["link"]):
        assert abs(crossed / sim["received"] - 1) < 0.03, (crossed, sim["received"])


def test_the_wire_simulation_is_adamws_default_exchange_at_three_ranks():
    """AdamW with no option (0/1 Adam): a real 3-rank run's exchange after the freeze
    takes the simulation's paths and period, the sign in the compressed allreduce, and
    receives its bytes, on the stdlib LM's shapes. (hvd_dgc's "sent" is a rank's own
    signs and scales, 73,772 bytes an exchange at 2 ranks, 73,790 at 3; the simulation's,
    what leaves the rank in both rounds.)"""
    from harness.hvdrun import run
    from harness.wire_sim import step_bytes
    real = run("harness.wire:step_bytes", np=3, timeout=300,
               kwargs={"model": "stdlib_lm", "mode": "adamw_default"})
    sim = step_bytes("stdlib_lm", "adamw_default", 3)
    assert all(rank["received"] == sim["received"] for rank in real)
    assert real[0]["paths"] == {"dense": 17, "sign": 11}
    assert sim["paths"] == {"dense": 17, "exchange": 11}
    assert real[0]["period"] == 4 and real[0]["dense_sent"] / real[0]["sent"] > 100


@pytest.mark.parametrize("n, k", [(16, 4), (4096, 4), (4096, 2000), (4096, 4096), (1000, 1),
                                  (64, 63), (2359296, 2360), (10 ** 6, 3), (100_003, 977)])
def test_the_cpu_kernel_codes_positions_as_atens_operations_do(n, k, monkeypatch):
    """On the CPU the C++ kernel (hvd_dgc/torch/csrc) writes and reads the codes a word at
    a time; the same bytes and positions as the ATen operations an accelerator runs."""
    import torch
    from hvd_dgc.torch import positions
    from hvd_dgc.torch.memory import fused_kernel_available
    assert fused_kernel_available()  # (built by the install, tests/torch/test_single_process.py)
    gen = np.random.default_rng(n + k)
    rows = [np.sort(gen.choice(n, k, replace=False)) for _ in range(3)]
    codes = {}
    for kernel in (True, False):
        monkeypatch.setattr(positions, "KERNEL", kernel)
        blobs = torch.stack([positions.encode_positions(torch.from_numpy(r), n)
                             for r in rows])
        codes[kernel] = (blobs, positions.decode_positions_many(blobs, n, k))
    assert torch.equal(codes[True][0], codes[False][0])
    assert codes[True][0].shape[1] == index_bytes(n, k)
    assert torch.equal(codes[True][1], codes[False][1])
    assert codes[True][1].tolist() == [r.tolist() for r in rows]
    assert np.array_equal(codes[True][0][0].numpy(), ref.encode_positions(rows[0], n))


def test_region_spaces_by_hand():
    """Three tensors of 10, 7 and 3 elements selecting 2, 1 and 1 on 4 ranks: the first
    cut into 4 regions, the others into 2 (2k); owner j's space holds its indices of
    each tensor, tensor after tensor."""
    from hvd_dgc.packing import region_layout
    layout = region_layout((10, 7, 3), (2, 1, 1), 4)
    assert layout.regions == (4, 2, 2)
    # owner 0: 0 4 8 | 0 2 4 6 | 0 2; owner 1: 1 5 9 | 1 3 5 | 1; owners 2, 3: 2 6 / 3 7
    assert layout.offsets.tolist() == [[0, 3, 7], [0, 3, 6], [0, 2, 2], [0, 2, 2]]
    assert layout.spaces.tolist() == [9, 7, 2, 2]


def _hand_block(bits):
    """Owner 1's block of that launch from a rank sending indices 5 (tensor 0), 3
    (tensor 1) and 1 (tensor 2): positions 5 // 4 = 1, 3 + 3 // 2 = 4, 6 + 1 // 2 = 6 of
    its 7, a bitmap (1 byte, Elias-Fano's would take 2): bits 1, 4 and 6."""
    return ref.region_block([1, 4, 6], np.array([2.0, -0.5, 0.25], np.float32), 7, bits)


def test_a_region_block_by_hand():
    block, arrived = _hand_block(32)
    assert block.tolist() == [3, 0, 0, 0, 2 + 16 + 64] + list(
        np.array([2.0, -0.5, 0.25], np.float32).view(np.uint8))
    block, arrived = _hand_block(8)
    # the scale 2 / 448; codes 448 (0x7E), -112 (1.75 * 2**6: 1 1101 110 = 0xEE) and
    # 56 (1.75 * 2**5: 0 1100 110 = 0x66), each exact
    assert block.tolist() == [3, 0, 0, 0] + list(
        np.array([np.float32(2) / np.float32(448)], np.float32).view(np.uint8)) + \
        [82, 0x7E, 0xEE, 0x66]
    assert arrived.tolist() == [2.0, -0.5, 0.25]
    assert ref.region_block([], [], 7, 8)[0].tolist() == [0, 0, 0, 0]  # a count, no more
    assert ref.region_block([], [], 0, 8)[0].size == 0  # an empty space: no block


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_torch_codes_region_blocks_byte_for_byte_as_the_reference(bits):
    """One rank's blocks of a launch of four tensors on 4 ranks (one tensor with fewer
    regions than ranks, one selecting all it has), coded by PyTorch as by the reference,
    read back to what arrives."""
    import torch
    from hvd_dgc.packing import region_block_bytes, region_layout
    from hvd_dgc.torch.region import code_blocks, read_block
    numels, ks, world = (1000, 37, 3, 64), (10, 2, 1, 64), 4
    gen = np.random.default_rng(bits)
    chosen = [np.sort(gen.choice(n, k, replace=False)) for n, k in zip(numels, ks)]
    starts = np.cumsum(numels) - np.asarray(numels)
    joint = np.concatenate([c + s for c, s in zip(chosen, starts)])
    values = (gen.standard_normal(joint.size) * 10.0 ** gen.integers(-3, 3, joint.size))
    values = values.astype(np.float32)
    values[3] = 1e6  # beyond fp16: arrives as 65504, the rest kept
    selections = [(joint, values)] + [(np.zeros(0, np.int64), np.zeros(0, np.float32))] * 3
    want = ref.region_reduce_coded(selections, numels, ks, bits)
    layout = region_layout(numels, ks, world)
    t = np.repeat(np.arange(4), ks)
    local = joint - starts[t]
    r = np.asarray(layout.regions)[t]
    owner, position = local % r, layout.offsets[local % r, t] + local // r
    order = np.lexsort((position, owner))
    payload, lengths, arrived, _ = code_blocks(
        torch.from_numpy(owner[order]), torch.from_numpy(position[order]),
        torch.from_numpy(values[order]), layout.spaces, bits)
    assert lengths == [b.size for b in want.to_owners[0]]
    assert payload.numpy().tolist() == np.concatenate(want.to_owners[0]).tolist()
    at = 0
    for j, length in enumerate(lengths):
        positions, got, used = read_block(payload, at, int(layout.spaces[j]), bits)
        mine = order[owner[order] == j]
        assert used == length == region_block_bytes(int(layout.spaces[j]), mine.size, bits)
        assert positions.tolist() == position[mine].tolist()
        assert np.array_equal(got.numpy(), arrived.numpy()[np.isin(order, mine)])
        at += length
    lost_i, lost_v = want.lost[0]
    back = values[order] - arrived.numpy()
    assert np.array_equal(np.sort(joint[order][back != 0]), lost_i)
    if bits == 16:
        assert back[np.flatnonzero(order == 3)[0]] == np.float32(1e6 - 65504)
