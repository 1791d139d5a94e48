"""The model zoo's smoke test (bench/zoo.py, harness/zoo.py): one pair's script runs under Horovod and
switched by one line, a setting the recipe cannot take is refused and recorded as such,
and the page's arithmetic (gap paired by seed, + = worse, worst case per setting) is
right on runs written by hand. The zoo's own runs are a benchmark, not part of the suite."""

import csv

import pytest

from harness import zoo
from harness.hvdrun import run

STEPS = 80


@pytest.fixture(scope="module")
def mlp():
    return {setting: run("harness.zoo:worker", np=2, controller="gloo",
                         kwargs=dict(pair="mlp_adam", setting=setting, seed=0, steps=STEPS))
            for setting in ("horovod", "default")}


def test_a_pair_trains_under_horovod_and_switched_with_fewer_bytes(mlp):
    stock, switched = mlp["horovod"][0], mlp["default"][0]
    assert stock["numel"] == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert stock["bytes"] == stock["dense_bytes"] == 4.0 * stock["numel"] * STEPS
    assert stock["accuracy"] > 0.85 and switched["accuracy"] > 0.85  # digits, 80 steps
    assert abs(stock["accuracy"] - switched["accuracy"]) < 0.05
    assert 1.5 < switched["dense_bytes"] / switched["bytes"] < 50  # 0/1 Adam's signs
    for ranks in mlp.values():  # every rank evaluates the same weights
        assert ranks[0]["accuracy"] == ranks[1]["accuracy"]


def test_a_setting_the_recipe_cannot_take_is_recorded_as_refused():
    out = run("harness.zoo:worker", np=2, controller="gloo",
              kwargs=dict(pair="recommender", setting="wan: delay=auto", seed=0, steps=5))
    for rank in out:  # Adagrad's update is not linear in the gradient: delay is refused
        assert rank["refused"].startswith("delay=auto needs torch.optim.SGD")
        assert "loss" not in rank


def _write(path, rows):
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, zoo.FIELDS)
        out.writeheader()
        for row in rows:
            out.writerow({k: row.get(k, "") for k in zoo.FIELDS})


def test_the_page_pairs_gaps_by_seed_and_states_the_worst_case(tmp_path):
    dense = {"dense_bytes": 400.0, "numel": 10, "steps": 10}
    rows = []
    for seed, (ref_loss, ref_acc) in enumerate([(2.0, 0.95), (4.0, 0.90)]):
        rows += [
            dict(pair="gpt_lm", setting="horovod", seed=seed, metric="loss", loss=ref_loss,
                 bytes=400.0, **dense),
            dict(pair="gpt_lm", setting="default", seed=seed, metric="loss",
                 loss=ref_loss * 1.02, bytes=40.0, **dense),      # 2% worse, 10x
            dict(pair="mlp_adam", setting="horovod", seed=seed, metric="accuracy",
                 loss=0.1, accuracy=ref_acc, bytes=400.0, **dense),
            dict(pair="mlp_adam", setting="default", seed=seed, metric="accuracy",
                 loss=0.1, accuracy=ref_acc - 0.005, bytes=20.0, **dense),  # 0.5 point, 20x
            dict(pair="recommender", setting="horovod", seed=seed, metric="loss", loss=0.5,
                 bytes=400.0, **dense),
            dict(pair="recommender", setting="default", seed=seed, metric="loss", loss=0.495,
                 bytes=100.0, **dense),                           # 1% better, 4x
            dict(pair="recommender", setting="wan: delay=auto", seed=seed, metric="loss",
                 refused="delay=auto needs torch.optim.SGD"),
        ]
    path = tmp_path / "runs.csv"
    _write(path, rows)
    table = zoo.gaps(zoo.load(path))
    assert table["gpt_lm", "default"]["gap"] == pytest.approx([2.0, 2.0])
    assert table["mlp_adam", "default"]["gap"] == pytest.approx([0.5, 0.5])
    assert table["mlp_adam", "default"]["unit"] == "points"
    assert table["recommender", "default"]["gap"] == pytest.approx([-1.0, -1.0])
    assert table["gpt_lm", "default"]["ratio"] == pytest.approx([10.0, 10.0])
    median, worst, worst_gap, held, n, ratio_median, ratio_least = \
        zoo.summary(table, ["default"])["default"]
    assert (worst, n, held) == ("gpt_lm", 3, 2)   # 0.5 point holds, 2% does not
    assert median == pytest.approx(0.5) and worst_gap == pytest.approx(2.0)
    assert (ratio_median, ratio_least) == (pytest.approx(10.0), pytest.approx(4.0))
    page = zoo.report(path, str(tmp_path / "zoo.md"))
    assert "| default | +2.00 ±0.0 % (10x) | +0.50 ±0.0 pt (20x) | -1.00 ±0.0 % (4x) |" in page
    assert "+2.00 gpt_lm | 2 of 3 |" in page and "refused" in page
    assert (tmp_path / "zoo.png").stat().st_size > 1000
