"""``python -m hvd_dgc.predict``: its predicted paths are the optimizer's own choices on
the same model and link (a real 2-rank job), and bad input is named with its fix."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from harness.hvdrun import run
from hvd_dgc.predict import link_measurement

from harness.hvdrun import REPO
MODEL = "tests.core.predict_check:small"
#: a link on which the warm-up's first stage goes dense and the later ones sparse
RATE, ALPHA_US, GATHER = 1000.0, 500.0, 80.0
#: case -> (optimizer, hvd_dgc options, the same options on the command line)
CASES = {
    "sgd, warm-up in steps": ("sgd", dict(warmup=4, warmup_unit="step"),
                              ["--warmup", "4", "--warmup-unit", "step"]),
    "sgd, density 0.01": ("sgd", dict(density=0.01, warmup=0),
                          ["--density", "0.01", "--warmup", "0"]),
    "adamw, defaults (0/1 Adam)": ("adamw", {}, []),
}
STEPS = 28  # past AdamW's freeze (step 20) by two exchanges of its period 4


def cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "hvd_dgc.predict", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def predicted(optimizer, flags):
    out = cli("--model", MODEL, "--np", "2", "--rate-mbit", str(RATE), "--alpha-us",
              str(ALPHA_US), "--gather-mbit", str(GATHER), "--step-ms", "10",
              "--local-cost", "none", "--optimizer", optimizer, "--json", *flags)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def job():
    """Each case's steps on 2 real ranks, wrapped with the CLI's link as the cost model."""
    model = link_measurement(RATE, ALPHA_US / 1e6, GATHER).cost_model()
    return run("tests.core.predict_check:chosen", np=2, controller="gloo", timeout=300,
               kwargs={"cases": {k: v[:2] for k, v in CASES.items()},
                       "cost_model": dataclasses.asdict(model), "steps": STEPS})


def _stage_at(stages, step):
    for s in stages:
        if s["from"] <= step and (s["to"] is None or step < s["to"]):
            return s
    raise AssertionError(step)


@pytest.mark.parametrize("case", list(CASES))
def test_each_stage_predicts_the_paths_the_optimizer_took(job, case):
    """At every step of a 2-rank job the optimizer's density and each tensor's path
    (its statistics: what it sent) are what the CLI predicts for that step's stage."""
    optimizer, _, flags = CASES[case]
    want = predicted(optimizer, flags)
    for rank, ranks in enumerate(job):
        got = ranks[case]
        assert got["model"] == want["cost_model"], rank  # the same link, priced alike
        compared = set()
        for step, seen in enumerate(got["steps"]):
            stage = _stage_at(want["stages"], step)
            assert seen["density"] == pytest.approx(stage["density"]), (case, step)
            if not seen["exchanged"]:  # period: no exchange at this step
                continue
            paths = {n: (got["compressor"] if p == "exchange" else p)
                     for n, p in stage["paths"].items()}
            assert seen["paths"] == paths, (case, rank, step, stage["stage"])
            compared.add(stage["stage"])
        assert compared == {s["stage"] for s in want["stages"]}, case  # every stage seen
    # what the stages say: dense at 25% on this link, sparse later (the first case)
    if case == "sgd, warm-up in steps":
        first, last = want["stages"][0], want["stages"][-1]
        assert first["groups"] == {"dense (cheaper than sparse on this link)": 4,
                                   "dense (< 1024 elements)": 2}
        assert last["groups"] == {"sparse via allgather": 4, "dense (< 1024 elements)": 2}
        assert last["bytes_per_step"] < first["bytes_per_step"] / 100
        assert last["speedup"] > 1 > first["speedup"] * 0.99
    if case == "adamw, defaults (0/1 Adam)":  # the sign's payload, priced as it is sent
        last = want["stages"][-1]
        assert last["bytes_per_exchange"] < want["horovod"]["bytes_per_step"] / 20
        assert last["exchange_seconds"] < want["horovod"]["exchange_seconds"]


def test_the_report_in_words():
    out = cli("--model", MODEL, "--np", "4", "--hosts", "2", "--link", "100mbit",
              "--step-ms", "10", "--local-cost", "none").stdout
    assert "4 ranks on 2 host(s); link 100 Mbit/s, RTT 0 ms" in out
    assert "from step 10,000, density 0.001: " in out
    assert "against Horovod's" in out
    assert "horovodrun -np 4 -H host1:2,host2:2 --config-file " \
           "horovodrun_configs/cheap_1gbe.yaml python train.py" in out
    wan = cli("--model", MODEL, "-H", "lon:1,tok:1,sfo:1", "--rate-mbit", "50",
              "--rtt-ms", "150", "--step-ms", "10", "--local-cost", "none").stdout
    assert "-np 3 -H lon:1,tok:1,sfo:1 --config-file " \
           "horovodrun_configs/wan_cross_region.yaml" in wan


@pytest.mark.parametrize("args, named, fix", [
    (["--np", "0", "--link", "1gbit"], "argument --np", "must be >= 1"),
    (["--np", "6", "--hosts", "4", "--link", "1gbit"], "argument --hosts",
     "do not divide --np 6"),
    (["--np", "2", "--rate-mbit", "0"], "argument --rate-mbit", "must be > 0"),
    (["--np", "2", "--rate-mbit", "-5"], "argument --rate-mbit", "must be > 0"),
    (["--np", "2"], "argument --rate-mbit", "--link 1gbit"),
    (["--link", "1gbit"], "argument --np", "--np 8 --hosts 2"),
    (["--np", "4", "-H", "a:2,b:x", "--link", "1gbit"], "argument -H", "host1:4,host2:4"),
    (["--np", "3", "-H", "a:2,b:2", "--link", "1gbit"], "argument --np", "make them agree"),
    (["--np", "2", "--link", "1gbit", "--density", "2"], "argument --density", "(0, 1]"),
    (["--np", "2", "--link", "1gbit", "--period", "0"], "argument --period", ">= 1"),
    (["--np", "2", "--link", "1gbit", "--delay", "soon"], "argument --delay", "or auto"),
    (["--np", "2", "--link", "2gbit"], "argument --link", "invalid choice"),
])
def test_bad_input_names_the_argument_and_the_fix(args, named, fix):
    proc = cli("--model", MODEL, *args, check=False)
    assert proc.returncode == 2 and named in proc.stderr and fix in proc.stderr, \
        proc.stderr


def test_a_module_function_that_returns_no_model_is_named():
    proc = cli("--model", "tests.core.predict_check:not_a_model", "--np", "2",
               "--link", "1gbit", "--step-ms", "5", check=False)
    assert proc.returncode == 2
    assert "argument --model: tests.core.predict_check:not_a_model returned dict, " \
           "not a torch.nn.Module or a Keras model" in proc.stderr
    proc = cli("--model", "tests.core.predict_check:nothing", "--np", "2", "--link",
               "1gbit", check=False)
    assert "argument --model: tests.core.predict_check has no function 'nothing'" \
        in proc.stderr


def test_an_unknown_model_name_lists_those_available():
    proc = cli("--model", "resnet5O", "--np", "2", "--link", "1gbit", check=False)
    assert proc.returncode == 2 and "argument --model: unknown model 'resnet5O'" in \
        proc.stderr and "module:function" in proc.stderr
    assert "ResNet50" in proc.stderr or "resnet50" in proc.stderr or \
        "neither torchvision nor Keras" in proc.stderr


def test_a_torch_model_never_imports_tensorflow():
    code = ("import sys, contextlib, io; from hvd_dgc.predict import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    main(['--model', '{MODEL}', '--np', '2', '--link', '1gbit', "
            "'--step-ms', '5', '--local-cost', 'none'])\n"
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed here")
def test_a_keras_model_takes_the_paths_the_same_tensors_take_in_torch():
    """The planner is the frameworks' one: a Keras model of the same sizes gets the same
    stages and, at the final density, the same paths; and TensorFlow's start-up lines
    stay off stderr. Each framework's planner prices its own wire (test_plan.py):
    PyTorch's allgather codes its positions and sends 8-bit values, TensorFlow's int32
    positions and fp32 values, so in the warm-up's dense stages PyTorch may go sparse
    first, and never sends more."""
    flags = ["--np", "2", "--link", "100mbit", "--step-ms", "10", "--local-cost", "none",
             "--json"]
    keras = cli("--model", "tests.core.predict_check:small_keras", *flags)
    torch = json.loads(cli("--model", MODEL, *flags).stdout)
    out = json.loads(keras.stdout)
    assert out["framework"] == "keras" and out["parameters"] == torch["parameters"]
    assert [s["density"] for s in out["stages"]] == [s["density"] for s in torch["stages"]]
    assert out["stages"][-1]["groups"] == torch["stages"][-1]["groups"]
    assert "sparse via allgather" in torch["stages"][-1]["groups"]
    assert all(t["bytes_per_step"] <= k["bytes_per_step"]
               for t, k in zip(torch["stages"], out["stages"]))
    assert "absl" not in keras.stderr and "oneDNN" not in keras.stderr, keras.stderr
