"""Every example runs at a tiny size under horovodrun -np 2 and prints real numbers.

The examples' learning itself is tested in test_torch_convergence.py and
test_tf.py; here: the one-line switch works both ways, the data fallback is
said plainly, and accuracy, throughput and compression statistics are printed.
"""

import importlib.util
import os
import re
import shutil
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


# The quick demo (examples/quick_demo.sh, run at the end of tools/install.sh): its last two
# lines, exactly this form, each number from the runs above them.
DEMO_LINES = (re.compile(r"  Horovod, dense allreduce   test accuracy (\d\.\d{3})   "
                         r"(\d{1,3}(?:,\d{3})*) samples/s"),
              re.compile(r"  hvd_dgc, one-line switch   test accuracy (\d\.\d{3})   "
                         r"(\d{1,3}(?:,\d{3})*) samples/s \((\d+\.\d)x\)"))
# Horovod's dense allreduce of the example's CNN on digits (151,306 fp32 parameters): 2 ranks
# in a ring each send the whole gradient once per step, 605,224 B, over the demo's link.
CNN_GRADIENT_BYTES = 605_224
DEMO_RATE_MBIT = 50  # the demo's link
# Horovod's samples/s can be no more than the link carries: 2 ranks x batch 32 a step
DENSE_CAP = DEMO_RATE_MBIT * 1e6 / 8 / CNN_GRADIENT_BYTES * 64


def quick_demo():
    spec = importlib.util.spec_from_file_location(
        "quick_demo", os.path.join(REPO, "examples", "quick_demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_runs(out):
    """(dense log, hvd_dgc log, the summary's last two lines) of an emulated demo's output."""
    dense = out.split("== Horovod: ", 1)[1].split("== hvd_dgc: ", 1)[0]
    dgc = out.split("== hvd_dgc: ", 1)[1].split("quick demo, side by side", 1)[0]
    return dense, dgc, out.rstrip("\n").splitlines()[-2:]


def check_demo_summary(dense, dgc, last_two):
    """The last two lines match the form exactly; their numbers are the runs' own: the last
    epoch's accuracy, samples/s over every epoch's training steps, and their ratio."""
    matches = [pattern.fullmatch(line) for pattern, line in zip(DEMO_LINES, last_two)]
    assert all(matches), last_two
    runs = []
    for log, match in zip((dense, dgc), matches):
        epochs = re.findall(r"epoch +\d+ .*test accuracy ([\d.]+) +([\d,]+) samples/s", log)
        assert epochs, log
        rates = [float(r.replace(",", "")) for _, r in epochs]
        rate = len(rates) / sum(1 / r for r in rates)  # equal steps each epoch
        assert float(match.group(1)) == pytest.approx(float(epochs[-1][0]), abs=0.0005)
        assert float(match.group(2).replace(",", "")) == pytest.approx(rate, abs=0.5)
        assert min(rates) <= rate <= max(rates)
        runs.append((len(epochs), float(match.group(1)), rate))
    assert runs[0][0] == runs[1][0]  # equal steps
    assert float(matches[1].group(3)) == pytest.approx(runs[1][2] / runs[0][2], abs=0.051)
    return runs


def test_quick_demo_summary_is_the_runs_own_numbers_and_names_a_failed_run():
    demo = quick_demo()
    dense = ("[0]<stdout>:data: scikit-learn digits 8x8 (shipped with the package) - MNIST "
             "unavailable (x); 719 train images per rank\n"
             "[0]<stdout>:epoch   1  loss 2.2  test accuracy 0.5000  900 samples/s (2 ranks)\n"
             "[0]<stdout>:epoch   2  loss 0.1  test accuracy 0.9583  1,800 samples/s (2 ranks)\n")
    dgc = ("[0]<stdout>:epoch   1  loss 2.2  test accuracy 0.5000  1,000 samples/s (2 ranks)"
           "  density 0.2526\n[0]<stdout>:epoch   2  loss 0.1  test accuracy 0.9556  "
           "9,000 samples/s (2 ranks)  density 0.0045\n")
    lines = demo.summary_lines(dense, dgc)
    # 2 epochs of equal steps at 900 and 1,800 samples/s: 1,200 over the run
    assert lines == ["  Horovod, dense allreduce   test accuracy 0.958   1,200 samples/s",
                     "  hvd_dgc, one-line switch   test accuracy 0.956   1,800 samples/s (1.5x)"]
    check_demo_summary(dense, dgc, lines)
    with pytest.raises(ValueError, match="hvd_dgc run: no 'epoch N"):
        demo.summary_lines(dense, "Traceback (most recent call last):\n")
    with pytest.raises(ValueError, match="1 and 2 epochs"):
        demo.summary_lines(dense.rsplit("[0]<stdout>:epoch   2", 1)[0], dgc)


def test_recorded_quick_demo_meets_its_targets():
    """bench/results/quick_demo.md's recorded output (the command it names; its table
    lists every run): the summary is what the helper makes of the runs above it; hvd_dgc
    at least 3x Horovod's samples/s, within 1 point of its accuracy, both at least 0.95."""
    with open(os.path.join(REPO, "bench", "results", "quick_demo.md")) as f:
        record = f.read()
    out = record.split("```text\n", 1)[1].split("```", 1)[0]
    dense, dgc, last_two = demo_runs(out)
    assert quick_demo().summary_lines(dense, dgc) == last_two
    (steps, dense_acc, dense_rate), (_, dgc_acc, dgc_rate) = check_demo_summary(
        dense, dgc, last_two)
    assert steps == 30 and f"{DEMO_RATE_MBIT:.1f} Mbit/s" in out and "scikit-learn's digits" in out
    assert dgc_rate >= 3 * dense_rate and dense_acc >= 0.95 and dgc_acc >= 0.95
    assert abs(dgc_acc - dense_acc) <= 0.01
    # the dense exchange is the bottleneck: the link caps Horovod's steps
    assert dense_rate <= DENSE_CAP


def emulator():
    return quick_demo().emulator_available()


@pytest.mark.skipif(not emulator()[0], reason=f"no emulated link here: {emulator()[1]}")
def test_quick_demo_over_the_emulated_link_ends_with_the_two_lines():
    """A short run of the install's demo (2 epochs; the full one is recorded in
    bench/results/quick_demo.md): the same script under Horovod and switched by one line,
    across two emulated hosts on a 50 Mbit/s link, the summary's last two lines exactly
    of their form, with the runs' own numbers."""
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", "quick_demo.sh")],
                          env=worker_env({"EPOCHS": "2"}),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert f"[hosts] 2 hosts, each pair {DEMO_RATE_MBIT:.1f} Mbit/s" in out
    assert out.count("horovodrun -np 2 -H h1:1,h2:1 --gloo python examples/pytorch_mnist.py "
                     "--epochs 2 --max-steps 22 --batch-size 32 --no-progress") == 2
    assert "--no-progress --dgc --warmup-epochs 4 ==" in out
    assert "scikit-learn's digits" in out and "MNIST is not available here" in out
    dense, dgc, last_two = demo_runs(out)
    assert "Horovod dense" in dense and "hvd_dgc DGC" in dgc
    (steps, _, dense_rate), _ = check_demo_summary(dense, dgc, last_two)
    assert steps == 2
    # The link is in the way: Horovod's dense exchange is capped by it (605 KB a step).
    assert dense_rate <= DENSE_CAP
    # hvd_dgc's second epoch (6.25% of each large gradient) already outruns Horovod's (its
    # first also holds the link probe and the timeline's trial steps)
    second = [number(r"epoch +2 .* ([\d,]+) samples/s", log) for log in (dense, dgc)]
    assert second[1] > second[0]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="hides /dev/net/tun in a mount namespace: needs root and unshare")
def test_quick_demo_without_the_emulator_says_so_once_and_shows_bytes_over_loopback():
    """Where the link cannot be emulated (here: /dev/net/tun hidden under a tmpfs in a mount
    namespace of its own), one line says why and the two runs go over loopback."""
    demo = os.path.join(REPO, "examples", "quick_demo.sh")
    proc = subprocess.run(["unshare", "-m", "sh", "-c",
                           'mount -t tmpfs none /dev/net && exec bash "$0" "$@"', demo,
                           "--max-steps", "4", "--lr", "0.05"],
                          env=worker_env({"EPOCHS": "1"}), capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert out.splitlines()[0] == (
        "quick demo: no emulated slow link here (no /dev/net/tun): the two runs over "
        "loopback instead, which shows bytes sent, not speed")
    assert out.count("no emulated slow link") == 1 and "[hosts]" not in out
    dense_sent = number(r"Horovod, dense allreduce .* sent ([\d,]+) B", out)
    dgc_sent = number(r"hvd_dgc, one-line switch .* sent ([\d,]+) B", out)
    # 4 steps of the CNN's gradient, dense; hvd_dgc's own count of what it sent
    assert dense_sent == 4 * CNN_GRADIENT_BYTES
    assert dgc_sent == number(r"whole run: sent ([\d,]+) B of", out) < dense_sent
    assert number(r"\(([\d.]+)x less\)", out) == pytest.approx(dense_sent / dgc_sent, abs=0.051)


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
