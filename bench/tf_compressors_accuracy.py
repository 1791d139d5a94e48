"""TensorFlow's compressors on digits through Keras 3 ``model.fit``: dense, DGC 0.1% and
each of ``--compressors`` (sign, qsgd, bf16 by default), 2 ranks, one run of each,
side by side: final test accuracy, the bytes ratio against dense fp32, and whether the
ranks end with identical weights. The training is the test suite's
(tests/tensorflow/tf_dgc.py ``keras_fit_digits``: a small CNN, SGD momentum 0.9).

    python bench/tf_compressors_accuracy.py [--epochs 30] [--compressors sign qsgd bf16]
"""

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from harness.hvdrun import run  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--compressors", nargs="*", default=["sign", "qsgd", "bf16"])
    args = parser.parse_args()
    outs = run("tests.tensorflow.tf_dgc:suite", np=2, timeout=1800,
               env={"TF_USE_LEGACY_KERAS": "0"},
               kwargs={"names": ["keras_fit_digits"], "kwargs": {"keras_fit_digits": {
                   "epochs": args.epochs, "compressors": args.compressors}}})
    out = outs[0]["keras_fit_digits"]
    print(f"Keras {out['keras']}, 2 ranks, digits, {args.epochs} epochs")
    print(f"{'method':<8} {'accuracy':>9} {'vs dense':>9} {'bytes ratio':>12} identical")
    dense = out["dense"]["accuracy"]
    for name in ["dense", "dgc"] + list(args.compressors):
        got = out[name]
        ratio = (got["stats"] or {}).get("compression_ratio", 1.0)
        print(f"{name:<8} {100 * got['accuracy']:>8.2f}% {100 * (got['accuracy'] - dense):>+8.2f} "
              f"{ratio:>11.1f}x {got['identical']}")


if __name__ == "__main__":
    main()
