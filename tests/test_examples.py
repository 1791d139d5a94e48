"""Every example runs at a tiny size under horovodrun -np 2 and prints real numbers.

The examples' learning itself is tested in test_torch_convergence.py and
test_tf.py; here: the one-line switch works both ways, the data fallback is
said plainly, and accuracy, throughput and compression statistics are printed.
"""

import os
import re
import subprocess

import pytest

from harness.hvdrun import REPO, horovodrun_command, worker_env


def launch(script, *args, env=None, timeout=600):
    cmd = [*horovodrun_command(), "-np", "2", "-H", "localhost:2", "--gloo", "python",
           os.path.join(REPO, "examples", script), *args]
    proc = subprocess.run(cmd, env=worker_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    out = "\n".join(line.split(":", 1)[1] for line in proc.stdout.splitlines()
                    if line.startswith("[0]<stdout>:"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in:\n{text}"
    return float(match.group(1).replace(",", ""))


def assert_digits_fallback(out):
    # no torchvision / no network here: the fallback must be said, not hidden
    assert "scikit-learn digits" in out and "MNIST unavailable" in out, out


@pytest.mark.parametrize("dgc", [False, True])
def test_pytorch_mnist(dgc):
    flags = ["--dgc", "--stats", "--warmup-epochs", "1", "--delay", "1"] if dgc else []
    out = launch("pytorch_mnist.py", "--epochs", "4", "--batch-size", "32", "--lr", "0.05",
                 "--no-progress", *flags)
    assert_digits_fallback(out)
    assert ("hvd_dgc DGC" if dgc else "Horovod dense") in out
    accuracy = number(r"epoch +4 .*test accuracy ([\d.]+)", out)
    assert accuracy > (0.3 if dgc else 0.85), out  # chance is 0.1
    assert number(r"epoch +4 .* ([\d,]+) samples/s", out) > 0
    if dgc:
        assert number(r"epoch +4 .*density ([\d.]+)", out) < 0.01  # after the warm-up
        assert number(r"epoch +4 .*last step sent [\d,]+ B of [\d,]+ B \((\d+)x\)", out) > 100
        assert number(r"whole run: .*\(([\d.]+)x\)", out) > 3


def test_quick_demo_shows_dense_and_the_one_line_switch_side_by_side():
    """The install's demo: the same script dense and with hvd_dgc's defaults (no DGC
    option passed), its summary's numbers those of the two runs."""
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "quick_demo.sh"),
                          "--lr", "0.05"], env=worker_env({"EPOCHS": "4"}),
                          capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "[hvd_dgc] torch: DGC warm-up" in out and "by step 10000" in out  # the line
    dense_acc = number(r"Horovod, dense allreduce +test accuracy ([\d.]+)", out)
    dgc_acc = number(r"hvd_dgc, one-line switch +test accuracy ([\d.]+)", out)
    runs = re.findall(r"epoch +4 .*test accuracy ([\d.]+)", out)
    assert [float(a) for a in runs] == [dense_acc, dgc_acc]
    dense_sent = number(r"Horovod, dense allreduce .* sent ([\d,]+) B", out)
    dgc_sent = number(r"hvd_dgc, one-line switch .* sent ([\d,]+) B", out)
    # the dense run's bytes are what DGC's statistics count as dense fp32
    assert dense_sent == number(r"whole run: sent [\d,]+ B of ([\d,]+) B dense fp32", out)
    assert dgc_sent == number(r"whole run: sent ([\d,]+) B of", out)
    # printed with one decimal
    assert number(r"\(([\d.]+)x less\)", out) == pytest.approx(dense_sent / dgc_sent, abs=0.051)
    assert dense_sent / dgc_sent > 1.9  # 88 steps: the warm-up's 25% stage
    assert dense_acc > 0.85 and dgc_acc > dense_acc - 0.05
    assert number(r"accuracy difference: ([+-][\d.]+) points", out) == pytest.approx(
        100 * (dgc_acc - dense_acc), abs=0.051)


@pytest.mark.parametrize("dgc", [False, True])
def test_pytorch_synthetic_benchmark(dgc):
    out = launch("pytorch_synthetic_benchmark.py", "--model", "wide_mlp",
                 "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2",
                 *(["--dgc"] if dgc else []))
    assert "wide_mlp" in out and "33.5M parameters" in out, out
    assert number(r"Total img/sec on 2 CPU\(s\): ([\d.]+)", out) > 0
    if dgc:
        assert number(r"Compression: .*\((\d+)x\) over 5 steps", out) > 300


@pytest.mark.parametrize("keras", ["3", "2"])
def test_keras_mnist(keras):
    env = {"TF_USE_LEGACY_KERAS": "1" if keras == "2" else "0"}
    dense = launch("keras_mnist.py", "--epochs", "4", "--batch-size", "32", "--lr", "0.02",
                   "--verbose", "0", env=env)
    assert_digits_fallback(dense)
    assert ("Horovod dense" if keras == "2" else "density=1.0 (Keras 3)") in dense
    assert number(r"test accuracy ([\d.]+)", dense) > 0.85
    dgc = launch("keras_mnist.py", "--epochs", "4", "--batch-size", "32", "--lr", "0.02",
                 "--verbose", "0", "--dgc", "--stats", "--warmup-epochs", "1", env=env)
    assert "hvd_dgc DGC" in dgc
    assert number(r"test accuracy ([\d.]+)", dgc) > 0.3
    assert number(r"\[hvd_dgc\] epoch 3: density ([\d.]+)", dgc) == 0.001
    assert number(r"whole run: .*\(([\d.]+)x\)", dgc) > 3


def test_keras_synthetic_benchmark():
    out = launch("keras_synthetic_benchmark.py", "--model", "wide_mlp", "--dgc",
                 "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2")
    assert "33.5M parameters" in out and "hvd_dgc DGC" in out, out
    assert number(r"Total img/sec on 2 CPU\(s\): ([\d.]+)", out) > 0
    assert number(r"Compression: .*\((\d+)x\) over 5 steps", out) > 300
