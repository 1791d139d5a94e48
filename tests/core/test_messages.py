"""What hvd_dgc says while a job runs: one short line on rank 0 at wrap time (the full plan
with ``verbose=True`` or ``HVD_DGC_VERBOSE=1``), warnings on rank 0 once, short lines
when the plan changes, labelled statistics. The wording is framework-free
(hvd_dgc/switch.py ``brief``, hvd_dgc/plan_words.py ``PlanWords.brief``), checked here for every
kind of run; then a real 2-rank job of a small script switched by one line."""

import sys
import warnings

import pytest

from hvd_dgc import CostModel, DensitySchedule, say
from hvd_dgc.config import DGCConfig
from hvd_dgc.resolve import HorovodArguments
from hvd_dgc.plan import Planner, TensorInfo
from hvd_dgc.plan_words import PlanWords
from hvd_dgc.stats import CompressionStats
from hvd_dgc.switch import CHANGE_LIMIT, HINT, LINE_LIMIT, change_line, percent

ARGS = HorovodArguments("average", 1.0, 1, None, ("average", "sum", "adasum"))
TENSORS = [TensorInfo(0, "conv.weight", 64 * 64 * 9, (64, 64, 3, 3)),
           TensorInfo(1, "conv.bias", 64, (64,)),
           TensorInfo(2, "fc.weight", 1000 * 512, (1000, 512)),
           TensorInfo(3, "fc.bias", 1000, (1000,))]
SGD, ADAMW = (True, "SGD"), (False, "AdamW", True)
SLOW = CostModel(alpha=1e-3, bandwidth=1e7)  # 80 Mbit/s: compression pays


def _line(compression=None, optimizer=SGD, world=2, **options):
    from hvd_dgc.torch.compression import Compression
    from hvd_dgc.torch.optimizer import TORCH
    options.setdefault("cost_model", SLOW)
    if isinstance(compression, str):
        compression = getattr(Compression, compression)
    config = DGCConfig.from_options(options, "torch", "DistributedOptimizer")
    resolved = config.resolve(TORCH, compression, ARGS, optimizer)
    planner = Planner(resolved, TENSORS, world)
    planner.adam_freeze(resolved.chosen_lagging)
    settled = planner.settled()
    delay = settled.config.delay
    density = settled.schedule(0, 0.0) if settled.sparse else 1.0
    return planner, PlanWords(planner).brief("torch", delay, settled.config.period, density)


#: every kind of run: options -> what the line must say
KINDS = {
    "dgc default": ({}, "DGC warm-up: 25% of each large tensor now, falling to 0.1% by step "
                        "10000; 2 of 4 tensors compressed at 0.1%, the rest dense"),
    "dgc no warm-up": ({"density": 0.01}, "DGC at 1% of each large tensor; 2 of 4 tensors"),
    "dgc epochs": ({"density": 0.001, "warmup": 4},
                   "DGC warm-up: 25% of each large tensor now, falling to 0.1% by epoch 4"),
    "dense": ({"density": 1.0}, "dense averaging (density=1.0), as Horovod's."),
    "topk": ({"compression": "topk", "density": 0.01}, "top-k at 1% of each large tensor"),
    "sign": ({"compression": "sign"}, "sign on 2 of 4 tensors, the rest dense"),
    "powersgd": ({"compression": "powersgd"}, "powersgd on "),
    "0/1 Adam": ({"optimizer": ADAMW}, "AdamW: 0/1 Adam (exact Adam to step 20, then 1-bit "
                                       "signs every 4th step, local steps between)"),
    "1-bit Adam": ({"optimizer": ADAMW, "delay": 2},
                   "AdamW: 1-bit Adam (exact Adam to step 20, then 1-bit signs); 2 of 4"),
    "Adam, DGC": ({"optimizer": ADAMW, "density": 0.01},
                  "AdamW: exact Adam to step 20, then DGC at 1% of each large tensor"),
    "Adam exact": ({"optimizer": ADAMW, "cost_model": CostModel(encode_element_seconds=1e-6)},
                   "AdamW runs exact, every tensor dense as with Horovod: compressing would "
                   "not pay on this link."),
    "delay": ({"delay": 4}, "; delayed averaging (delay=4)."),
    "delay auto": ({"delay": "auto"}, "; delayed averaging (delay='auto')."),
    "period": ({"period": 4}, "; an exchange every 4 steps (period=4)."),
    "schedule": ({"density": DensitySchedule(0.001, warmup=300, unit="step")},
                 "DGC warm-up: 25% of each large tensor now, falling to 0.1% by step 300"),
    "dense link": ({"cost_model": CostModel(select_element_seconds=1e-6)},
                   "DGC: every tensor dense on this link (sparse would cost more)"),
    "too small": ({"min_compress_size": 10 ** 7},
                  "DGC: no tensor has min_compress_size=10000000 elements or more: every "
                  "tensor dense"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_wrap_line_says_what_runs_in_at_most_200_characters(kind):
    options, says = KINDS[kind]
    planner, line = _line(**dict(options))
    assert len(line) <= LINE_LIMIT, (len(line), line)
    assert line.startswith("[hvd_dgc] torch: ") and "\n" not in line, line
    assert says in line, line
    if kind != "dense":
        assert line.endswith(f"{HINT}."), line
    # the full plan, as before, with verbose: longer, the link's and each tensor's story
    full = PlanWords(planner).summary("torch", 0)
    assert full.startswith("[hvd_dgc] torch: ") and full != line


def test_the_outer_loop_says_one_short_line():
    from hvd_dgc import OuterLoop
    from hvd_dgc.switch import outer_line
    for outer, density in ((OuterLoop(steps=500, lr=0.7, residual_decay=0.9, value_bits=8,
                                      overlap=True), 0.001), (OuterLoop(), 1.0)):
        line = outer_line("torch", outer, density, "AdamW")
        assert len(line) <= LINE_LIMIT and line.endswith(f"{HINT}."), line
        assert line.startswith("[hvd_dgc] torch: outer loop (DiLoCo): AdamW steps alone; "
                               f"every {outer.steps} steps the weights' change is averaged")
        full = outer_line("torch", outer, density, "AdamW", full=True)
        assert outer.words() in full and "AdamW steps locally between rounds" in full
    assert "averaged as 0.1% records, applied by outer Nesterov (lr 0.7)" in \
        outer_line("torch", OuterLoop(steps=500), 0.001, "AdamW")


def test_a_plain_adamw_user_hears_nothing_of_a_compressor_they_did_not_choose():
    """0/1 Adam's sign is Adam's default: where it would save nothing on the link, Adam
    runs exact (as Horovod) and the line says that, with no warning about "sign"; a
    script that asked for the sign is told."""
    cost = CostModel(encode_element_seconds=1e-6)
    planner, line = _line(optimizer=ADAMW, cost_model=cost)
    assert planner.adam.declined and PlanWords(planner).idle_warning() is None
    assert "sign" not in line and "exact" in line, line
    chosen, _ = _line(compression="sign", cost_model=cost)
    assert "sign does nothing" in PlanWords(chosen).idle_warning()


def test_a_long_trace_is_said_with_its_numbers_and_a_short_one_is_not():
    """A TensorFlow step's graph holds every stage's paths: from LONG_TRACE compressed
    paths on, rank 0 is told its first run may take minutes (in one short line)."""
    from hvd_dgc.switch import LONG_TRACE, long_trace_line
    assert long_trace_line(2, 10, 5) is None
    assert long_trace_line(20, LONG_TRACE - 1, 5) is None
    line = long_trace_line(51, 255, 5)
    assert line.startswith("[hvd_dgc] tensorflow: ") and len(line) <= LINE_LIMIT, line
    assert "51 compressed tensors" in line and "5 density stages" in line, line
    assert "(255 paths)" in line and "minutes" in line, line


def test_wording_helpers():
    assert [percent(d) for d in (0.25, 0.0625, 0.015625, 0.004, 0.001, 1.0)] == \
        ["25%", "6.25%", "1.56%", "0.4%", "0.1%", "100%"]
    line = change_line(1234, "the link changed " + "x" * 200)
    assert len(line) == CHANGE_LIMIT and line.startswith("[hvd_dgc] step 1234: the link")


def test_a_change_of_plan_is_one_short_line_and_the_full_story_with_verbose(monkeypatch):
    """A re-measured link (linkwatch.relinked_words, both frameworks) and a new density
    stage whose paths differ (PlanWords.stage_line, PyTorch)."""
    from hvd_dgc.linkprobe import LinkMeasurement
    from hvd_dgc.linkwatch import relinked_words
    monkeypatch.setenv("HVD_DGC_VERBOSE", "")
    planner, _ = _line(density=DensitySchedule(0.001, warmup=300, unit="step",
                                               warmup_densities=(1.0,)))
    fast = LinkMeasurement(50e-6, 1.25e9, 0.1, 1 << 20)
    slow = LinkMeasurement(1e-3, 1.25e6, 0.4, 1 << 16)
    line = relinked_words(1234, slow, fast, 0.01, 0.5, planner, 0.001, traced=True)
    assert line == ("[hvd_dgc] step 1234: link now 10 Mbit/s (was 10000): 2 of 2 large "
                    "tensors sparse at 0.1%; step traced again"), line
    assert len(line) <= CHANGE_LIMIT
    assert PlanWords(planner).stage_line(300, 1.0, 0.001) == \
        "[hvd_dgc] step 300: density 0.1% now: 2 of 2 large tensors sparse"
    assert PlanWords(planner).stage_line(300, 0.001, 0.001) is None  # no new stage
    assert PlanWords(planner).sync_line(2) is None  # nothing measured: nothing to say
    planner.measured(slow)
    assert PlanWords(planner).sync_line(2) == ("[hvd_dgc] elastic sync at 2 ranks: link 10 "
                                               "Mbit/s, 2 of 2 large tensors sparse at 0.1%")
    monkeypatch.setenv("HVD_DGC_VERBOSE", "1")
    assert PlanWords(planner).sync_line(2).startswith(
        "hvd_dgc: elastic sync at 2 ranks: link measured:")
    line = relinked_words(1234, slow, fast, 0.01, 0.5, planner, 0.001)
    assert line.startswith("hvd_dgc: at step 1234 the link measured 1000 us per message, "
                           "10 Mbit/s (was 50 us per message, 10000 Mbit/s; a 0.40 s probe)")


def test_statistics_say_per_step_and_cumulative():
    stats = CompressionStats()
    for _ in range(3):
        stats.record("w", "sparse", 10 ** 6, 10 ** 4, 80000, 0.01, positions=40000)
        stats.end_step()
    line = stats.format(0.01)
    assert line.startswith("density 0.01 now; sent 0.080 MB this step, 0.240 MB in 3 steps "
                           "(50.0x less than dense fp32); of which positions 50%, values 50%; "
                           "paths in 3 steps {'sparse': 3}"), line


def test_statistics_say_why_the_bytes_went():
    """Each byte under its cause (hvd_dgc/stats.py ``CAUSES``): the records' positions and
    values, a large tensor sent dense (a warm-up stage), a small one dense every step, a
    compressor's payload, embedding rows, Adam's refresh; a later round's bytes under
    their tensor's cause."""
    stats = CompressionStats(min_compress_size=100)
    stats.record("conv", "sparse", 10 ** 6, 10 ** 3, 5000, 0.001, positions=2000)
    stats.record("owned", "region", 10 ** 4, 10, 80, 0.001, positions=40)
    stats.add_bytes("owned", 2920, positions=960)  # its kept records, a later round
    stats.record("fc", "dense", 1000, 1000, 4000, 0.25)
    stats.record("bias", "dense", 10, 10, 40, 1.0)
    stats.record("emb", "sparse_grad", 500, 50, 400, 1.0)
    stats.record("low", "powersgd", 10 ** 4, 10 ** 4, 1200, 1.0)
    stats.add_bytes("low", 800)
    stats.add_bytes("hvd_dgc.adam_refresh", 2000)
    stats.end_step()
    s = stats.summary()
    assert s["bytes_by_cause"] == {"positions": 3000, "values": 5000,
                                   "large tensors dense": 4000, "small tensors dense": 40,
                                   "payloads": 2000, "sparse gradients": 400, "refresh": 2000}
    assert sum(s["bytes_by_cause"].values()) == s["bytes_sent"] == 16440
    assert "of which positions 18%, values 30%, large tensors dense 24%, small tensors " \
        "dense 0%, payloads 12%, sparse gradients 2%, refresh 12%;" in stats.format()
    restored = CompressionStats(100)
    restored.load_state_dict(stats.state_dict())
    assert restored.summary()["bytes_by_cause"] == s["bytes_by_cause"]
    old = stats.state_dict()
    del old["bytes_by_cause"]  # a checkpoint from before the causes were counted
    restored.load_state_dict(old)
    assert restored.summary()["bytes_by_cause"] == {}
    old["bytes_by_cause"] = {"records": 8000, "refresh": 2000}  # before positions and
    restored.load_state_dict(old)                               # values were told apart
    assert restored.summary()["bytes_by_cause"] == {"refresh": 2000, "records": 8000}


def test_warnings_and_lines_rank_0_once(monkeypatch, capsys):
    say.reset()
    # The rank from the launcher's environment: a Horovod initialised by an earlier test
    # in this process would answer 0 whatever HOROVOD_RANK says.
    for module in ("horovod.torch", "horovod.tensorflow"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv("HOROVOD_RANK", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not say.rank0_once("hvd_dgc: x") and not say.say("line")
    assert not caught and capsys.readouterr().out == ""
    monkeypatch.setenv("HOROVOD_RANK", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert say.rank0_once("hvd_dgc: x") and not say.rank0_once("hvd_dgc: x")
        assert say.say("line") and not say.say("line") and say.say("line", once=False)
    assert [str(w.message) for w in caught] == ["hvd_dgc: x"]
    assert capsys.readouterr().out == "line\nline\n"
    monkeypatch.setenv("HVD_DGC_VERBOSE", "1")
    assert say.verbose() and say.verbose(True)
    monkeypatch.setenv("HVD_DGC_VERBOSE", "0")
    assert not say.verbose() and say.verbose(True)
    say.reset()


def test_adam_with_averages_sixteen_steps_late_is_warned_once(monkeypatch):
    """The model zoo saw Adam/AdamW taken over diverge at period=8, delay=8 (a GPT-style
    LM, every seed) where period=4, delay=4 held: rank 0 says so once, at wrap time."""
    from hvd_dgc.resolve import ADAM_LAG_LIMIT, warn_known_losses
    say.reset()
    for module in ("horovod.torch", "horovod.tensorflow"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setenv("HOROVOD_RANK", "0")

    def said(options, adam=True):
        config = DGCConfig.from_options(options, "torch", "DistributedOptimizer")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_known_losses(config, "AdamW", adam)
        return [str(w.message) for w in caught]

    assert ADAM_LAG_LIMIT == 16
    assert said({"period": 4, "delay": 4}) == [] and said({"delay": 8}) == []
    assert said({"period": 8, "delay": 8}, adam=False) == []  # SGD held there
    line, = said({"period": 8, "delay": 8})
    assert line.startswith("hvd_dgc: AdamW with delay=8 and period=8: averages up to 16 "
                           "steps late diverged") and "OuterLoop" in line, line
    assert len(line) <= 250
    assert said({"period": 8, "delay": 8}) == []  # once
    say.reset()
    line, = said({"period": 8, "delay": "auto"})  # AutoDelay's max_delay, 8
    assert "delay=auto and period=8: averages up to 16 steps late" in line
    say.reset()


def test_verbose_is_an_option_a_rank_may_set_alone():
    assert DGCConfig(verbose=True).verbose
    assert "verbose" not in DGCConfig(verbose=True).to_dict(shared=True)
    with pytest.raises(ValueError, match="verbose must be True"):
        DGCConfig(verbose="yes")


# -- a real 2-rank job ------------------------------------------------------------------
def _by_rank(job, stream):
    """horovodrun's gloo output, by rank: ``[0]<stdout>:line``."""
    out = {0: [], 1: []}
    for line in getattr(job, stream).splitlines():
        for rank in out:
            prefix = f"[{rank}]<{stream}>:"
            if line.startswith(prefix):
                out[rank].append(line[len(prefix):])
    return out


def _ours(lines):
    return [line for line in lines if "hvd_dgc" in line]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_two_rank_pytorch_run_says_one_short_line_on_rank_0(verbose):
    from harness.hvdrun import launch
    env = {"HVD_DGC_VERBOSE": "1"} if verbose else {"HVD_DGC_VERBOSE": ""}
    job = launch("tests.core.messages:torch_default", np=2, controller="gloo",
                 kwargs={"optimizer": "sgd", "steps": 3}, env=env, timeout=240)
    assert job.returncode == 0 and sorted(job.results) == [0, 1], job.output()
    out, err = _by_rank(job, "stdout"), _by_rank(job, "stderr")
    line, = _ours(out[0])  # exactly one line of ours on rank 0
    assert line.startswith("[hvd_dgc] torch: ")
    if verbose:  # the full plan: each stage, each tensor's path
        assert "warm-up 0.25 to step 160, 0.0625 to step 640" in line and \
            "For dense averaging: density=1.0." in line, line
    else:
        assert len(line) <= LINE_LIMIT and "DGC warm-up" in line and HINT in line, line
    assert _ours(out[1]) == [] and _ours(err[1]) == [], (out[1], err[1])
    assert not [w for w in err[1] if "Warning" in w], err[1]  # rank 1: no warnings at all
    assert not [w for w in err[0] if "Warning" in w], err[0]


def test_a_plain_adamw_run_is_told_what_runs_and_nothing_of_sign():
    from harness.hvdrun import launch
    job = launch("tests.core.messages:torch_default", np=2, controller="gloo",
                 kwargs={"optimizer": "adamw", "steps": 3}, env={"HVD_DGC_VERBOSE": ""},
                 timeout=240)
    assert job.returncode == 0, job.output()
    out, err = _by_rank(job, "stdout"), _by_rank(job, "stderr")
    line, = _ours(out[0])
    assert line.startswith("[hvd_dgc] torch: AdamW") and len(line) <= LINE_LIMIT, line
    assert "sign" not in " ".join(_ours(err[0] + err[1])), err
    assert _ours(out[1]) == [] and _ours(err[1]) == []


CLIP_SETTINGS = [{"delay": 2}, {"period": 2}, {}]


@pytest.fixture(scope="module")
def clipped_under_delay():
    """The clipping recipe on 2 ranks, one launch for every setting."""
    from harness.hvdrun import run
    return run("tests.core.messages:torch_clip_under_delay", np=2, controller="gloo",
               kwargs={"steps": 4, "settings": CLIP_SETTINGS}, timeout=240)


@pytest.mark.parametrize("which", range(len(CLIP_SETTINGS)))
def test_clipping_between_synchronize_and_step_under_delay_is_warned_once(which,
                                                                         clipped_under_delay):
    """Horovod's clipping recipe breaks delayed averaging's correction (each rank scales
    its own correction and the average by its own factor, and the ranks drift apart:
    bench/results/zoo.md, the LSTM): rank 0 says so once, naming clip_norm=. Synchronous
    steps clip the average itself, as under Horovod: nothing is said."""
    options = CLIP_SETTINGS[which]
    for rank in (out[which] for out in clipped_under_delay):
        said = [w for w in rank["warnings"] if "skip_synchronize" in w]
        if not options or rank["rank"] == 1:
            assert said == [], said
            continue
        lagging = next(iter(options))
        line, = said
        assert line.startswith(f"hvd_dgc: {lagging}={options[lagging]} with synchronize()")
        assert "clip_norm=" in line and f"{lagging}=" in line.split("or use")[1]
        assert len(line) <= 250, line


def test_a_two_rank_keras_fit_says_one_short_line_and_one_density():
    """model.fit switched by one line (hvd_dgc's optimizer and callbacks, defaults): rank
    0 says one wrap-time line of at most 200 characters and, per epoch, DGCCallback's
    line, whose density is the one fit logs (dgc_density: the density in effect, not an
    average over the elements sent); rank 1 says nothing."""
    from harness.hvdrun import launch
    job = launch("tests.core.messages:keras_default", np=2, controller="gloo",
                 kwargs={"epochs": 2}, env={"TF_USE_LEGACY_KERAS": "0", "HVD_DGC_VERBOSE": ""},
                 timeout=300)
    assert job.returncode == 0 and sorted(job.results) == [0, 1], job.output()
    out, err = _by_rank(job, "stdout"), _by_rank(job, "stderr")
    wrap = [line for line in _ours(out[0]) if line.startswith("[hvd_dgc] tensorflow: ")]
    assert len(wrap) == 1 and len(wrap[0]) <= LINE_LIMIT and HINT in wrap[0], wrap
    assert "DGC warm-up" in wrap[0], wrap
    epochs = [line for line in _ours(out[0]) if line.startswith("[hvd_dgc] epoch ")]
    assert len(epochs) == 2 and len(_ours(out[0])) == 3, _ours(out[0])
    for rank in (0, 1):
        result = job.results[rank]
        assert result["logged"] == result["current"] == [0.25, 0.25], result
    for line in epochs:
        assert "density 0.25 now; sent " in line and " MB so far (" in line, line
    assert _ours(out[1]) == [] and _ours(err[1]) == [], (out[1], err[1])
    assert not [w for w in err[0] + err[1] if "Warning" in w], err
