"""One specification of hvd_dgc's options (hvd_dgc/config.py) for the PyTorch optimizer,
the TensorFlow tape and the Keras optimizer: the same mistake gets the same message in
each, an unknown option is refused everywhere, and what TensorFlow does not run yet is
said, not ignored."""

import dataclasses
import json

import pytest
import tensorflow as tf
import torch

import hvd_dgc.tensorflow as hvd_tf
import hvd_dgc.tensorflow.keras as hvd_keras
import hvd_dgc.torch as hvd_torch
from hvd_dgc import CostModel, DensitySchedule, consistency
from hvd_dgc.config import DGCConfig
from hvd_dgc.tensorflow.compression import Compression as TFCompression
from hvd_dgc.torch.compression import Compression as TorchCompression


def _torch(**options):
    model = torch.nn.Linear(4, 2)
    return hvd_torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                          named_parameters=model.named_parameters(), **options)


def _tape(**options):
    return hvd_tf.DistributedGradientTape(tf.GradientTape(), **options)


def _keras(**options):
    return hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **options)


WRAPPERS = {"torch": _torch, "tape": _tape, "keras": _keras}

BAD = {  # option -> (value, what the message must say)
    "min_compress_size": (-1, "min_compress_size must be an int >= 0"),
    "clip_norm": (0, "clip_norm must be a number > 0"),
    "momentum_masking": ("sometimes", "momentum_masking must be True"),
    "delay": (-2, "delay must be an int >= 0"),
    "period": (0, "period must be an int >= 1"),
    "skip_nonfinite": ("yes", "skip_nonfinite must be True or False"),
    "aggregation": ("ring", "aggregation must be one of"),
    "fusion_threshold": (-5, "fusion_threshold must be an int >= 0"),
    "log_every": (-1, "log_every must be an int >= 0"),
    "verbose": ("yes", "verbose must be True"),
    "freeze_variance": (0, "freeze_variance must be 'auto', a number of steps >= 1"),
    "refresh_variance": (True, "refresh_variance must be False (the variance frozen once)"),
    "density": (1.5, "density must be in (0, 1]"),
    "warmup_unit": ("hour", "warmup unit must be 'epoch' or 'step'"),
    "cost_model": ("fast", "cost_model must be a hvd_dgc.CostModel"),
}


def _error(wrap, **options):
    with pytest.raises((TypeError, ValueError)) as info:
        wrap(**options)
    return info.type, str(info.value)


@pytest.mark.parametrize("option", sorted(BAD))
def test_the_same_mistake_gets_the_same_message_in_every_framework(option):
    value, says = BAD[option]
    errors = {name: _error(wrap, **{option: value}) for name, wrap in WRAPPERS.items()}
    assert says in errors["torch"][1] and repr(value) in errors["torch"][1], errors
    assert len(set(errors.values())) == 1, errors


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_an_unknown_option_is_refused_with_the_closest_name(name):
    kind, message = _error(WRAPPERS[name], densty=0.01)
    assert kind is TypeError
    assert "'densty' (did you mean 'density'?)" in message
    assert "DistributedGradientTape()" in message if name == "tape" else \
        "DistributedOptimizer()" in message
    assert "min_compress_size" in message  # the list of options


@pytest.mark.parametrize("option,value", [("aggregation", "hierarchical"),
                                          ("fusion_threshold", 1024), ("log_every", 10)])
def test_tensorflow_takes_the_options_pytorch_does(option, value):
    """Once PyTorch-only (refused in TF with what to pass instead): now accepted at wrap
    time by the tape and the Keras optimizer, and kept in their config (the multi-rank
    tests run them: tests/tensorflow/test_hierarchical.py, test_tf.py)."""
    assert getattr(_tape(**{option: value})._dgc_options["config"], option) == value
    opt = _keras(**{option: value})
    assert getattr(opt._hvd_dgc.config, option) == value


def test_freeze_variance_on_a_tape_is_refused():
    """A tape does not know the optimizer: nothing to freeze, said rather than ignored."""
    kind, message = _error(_tape, freeze_variance=100)
    assert kind is ValueError
    assert "freeze_variance=100 applies to Adam/AdamW" in message, message
    assert "hvd_dgc.tensorflow.keras.DistributedOptimizer" in message, message
    _tape(freeze_variance="auto")  # the default, accepted


def test_refresh_variance_without_a_frozen_adam_is_refused():
    """Nothing to refresh with SGD, or with Adam on error feedback: said, not ignored."""
    kind, message = _error(_torch, refresh_variance="auto")
    assert kind is ValueError
    assert "refresh_variance='auto' refreshes Adam's frozen variance" in message, message
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="Pass no refresh_variance"):
        hvd_torch.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       freeze_variance=False, refresh_variance=100)


def test_delayed_averaging_needs_a_linear_update_in_torch_and_keras_alike():
    model = torch.nn.Linear(4, 2)
    _, in_torch = _error(lambda **o: hvd_torch.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(), **o),
        delay=2, freeze_variance=False)
    _, in_keras = _error(lambda **o: hvd_keras.DistributedOptimizer(
        tf.keras.optimizers.Adam(0.1), **o), delay=2, freeze_variance=False)
    for message, kind in ((in_torch, "torch.optim.SGD or Adam/AdamW with its variance "
                                     "frozen (freeze_variance)"),
                          (in_keras, "a Keras SGD optimizer")):
        assert message.startswith(f"delay=2 needs {kind}"), message
        assert "Adam is not. Use delay=0" in message, message


def test_adam_take_over_refuses_what_it_cannot_honour():
    model = torch.nn.Linear(4, 2)
    wrap = lambda **o: hvd_torch.DistributedOptimizer(  # noqa: E731
        torch.optim.Adam(model.parameters(), maximize=True),
        named_parameters=model.named_parameters(), **o)
    kind, message = _error(wrap)
    assert kind is ValueError
    assert "Adam(maximize=True) (param group 0) cannot be taken over" in message, message
    assert "freeze_variance=False" in message, message
    # with freeze_variance=False nothing is taken over: past the check (to Horovod's own)
    assert "maximize" not in _error(wrap, freeze_variance=False)[1]
    for bad in (0, -3, 2.5, True, "always"):
        kind, message = _error(_torch, freeze_variance=bad)
        assert kind is ValueError and f"freeze_variance must be 'auto', a number of steps " \
            f">= 1" in message and repr(bad) in message, (bad, message)


def test_horovod_arguments_are_checked_alike():
    for wrap in WRAPPERS.values():
        assert "op must be hvd.Average or hvd.Sum" in _error(wrap, op=7)[1]
        assert "gradient_predivide_factor not supported" in _error(
            wrap, op=hvd_torch.Sum, gradient_predivide_factor=2.0)[1]
    assert "backward_passes_per_step must be an int > 0" in _error(
        _torch, backward_passes_per_step=0)[1]
    assert "backward_passes_per_step must be an int > 0" in _error(
        _keras, backward_passes_per_step=0)[1]


def test_config_is_frozen_and_serialises_equal_options_equally():
    def schedule(step, epoch):
        return 0.01

    a = DGCConfig(density=schedule, warmup_densities=[0.5], cost_model=CostModel(alpha=0.1))
    b = DGCConfig(density=schedule, warmup_densities=(0.5,), cost_model=CostModel(alpha=0.1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.delay = 3
    assert a.to_dict() == b.to_dict() and a.key() == b.key()
    assert json.loads(json.dumps(a.to_dict())) == a.to_dict()  # what ranks exchange
    assert a.to_dict()["density"].endswith("schedule")  # a callable's name, not its address
    assert a.to_dict()["warmup_densities"] == [0.5]
    assert a.replace(delay=3).delay == 3 and a.delay == 0
    # log_every may differ per rank (rank 0 prints); the rest must agree
    assert "log_every" not in a.replace(log_every=5).to_dict(shared=True)
    assert a.replace(log_every=5).to_dict(shared=True) == a.to_dict(shared=True)
    with pytest.raises(ValueError, match=r"density: rank 0=0\.01, rank 1=0\.02"):
        consistency.check_same([DGCConfig(density=0.01).to_dict(shared=True),
                                DGCConfig(density=0.02).to_dict(shared=True)], [0, 1], "x")
    schedule_cfg = DGCConfig(density=DensitySchedule(0.01, warmup=2, unit="step"))
    assert "DensitySchedule" in schedule_cfg.to_dict()["density"]


def test_lagging_options_in_words():
    assert DGCConfig().lagging == ""
    assert DGCConfig(delay=4, period=2).lagging == "delay=4 and period=2"
    assert DGCConfig(delay=4, period=2).undo_lagging == "delay=0 and period=1"
    assert DGCConfig(delay="auto").lagging == "delay=auto"
    assert DGCConfig(delay="auto").fixed_delay is None
    assert DGCConfig(delay="auto").auto_delay.max_delay == 8


@pytest.mark.parametrize("compression", [TorchCompression.dgc, TFCompression.dgc])
def test_compressors_refuse_options_they_do_not_have(compression):
    with pytest.raises(TypeError, match=r"Compression.dgc has no option\(s\) \['windw'\]"):
        compression(windw=(0.5, 2.0))
    copy = compression(sample_ratio=0.05)
    assert copy.sample_ratio == 0.05 and copy != compression
    assert copy == compression(sample_ratio=0.05) and hash(copy) == hash(
        compression(sample_ratio=0.05))


def test_keras_backward_passes_with_delay_are_taken_together():
    """Both, as in PyTorch (their maths: tests/tensorflow/test_tf.py, on two ranks)."""
    opt = _keras(backward_passes_per_step=2, delay=2)
    assert opt._hvd_dgc_passes.passes == 2 and opt._hvd_dgc.delay == 2


def _same_words(message, framework, compression):
    """A message with the framework's own words (its compressor's repr, its namespace)
    put aside: what must read the same in every framework."""
    return message.replace(repr(compression), "<compression>").replace(
        f"hvd_dgc.{framework}.", "hvd_dgc.<framework>.")


@pytest.mark.parametrize("name", ["sign", "qsgd", "bf16", "powersgd"])
def test_compressors_running_their_own_collectives_refuse_what_they_cannot_alike(name):
    """Refused in DGCConfig.resolve for every wrapper: the same words in torch, the
    tape and Keras (only the compressor's own name differs)."""
    compressors = {"torch": getattr(TorchCompression, name),
                   "tape": getattr(TFCompression, name), "keras": getattr(TFCompression, name)}
    frameworks = {"torch": "torch", "tape": "tensorflow", "keras": "tensorflow"}

    def errors(**options):
        out = set()
        for wrapper, wrap in WRAPPERS.items():
            kind, message = _error(wrap, compression=compressors[wrapper], **options)
            out.add((kind, _same_words(message, frameworks[wrapper], compressors[wrapper])))
        return out

    if name == "powersgd":  # two rounds: its own contribution is known too late
        (kind, message), = errors(delay=2)
        assert kind is ValueError and "known only after its first collective" in message
        assert message.startswith("delay=2 does not work with compression=<compression>")
    else:  # one round: delayed averaging takes it
        for wrapper in ("tape", "keras"):
            WRAPPERS[wrapper](compression=compressors[wrapper], delay=2)
    (kind, message), = errors(density=0.01)
    assert kind is ValueError and "density/warmup apply to sparse compressors" in message
    assert "Use compression=hvd_dgc.<framework>.Compression.dgc to sparsify" in message


def test_keras_adaptive_optimizers_get_the_longer_default_warm_up_and_quantisers_none():
    from hvd_dgc.adam import DEFAULT_FREEZE, FrozenAdamSchedule
    from hvd_dgc.schedule import ADAPTIVE_SENDS, DEFAULT_SENDS
    # Adam with no option: 0/1 Adam (the sign from the freeze, an exchange every 4th step)
    adam = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3))
    assert adam._hvd_dgc.resolved.zero_one and adam._hvd_dgc.period == 4
    assert type(adam._hvd_dgc.compression).__name__ == "SignCompressor"
    assert adam._hvd_dgc.resolved.freeze == DEFAULT_FREEZE
    # with DGC's top-k asked for, taken over (its variance frozen): exact Adam, then SGD's
    # stages from the freeze, every step
    adam = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3),
                                          compression=TFCompression.dgc)
    assert adam._hvd_dgc.schedule.config() == FrozenAdamSchedule.default(
        DEFAULT_FREEZE, "auto").config()
    assert not adam._hvd_dgc.resolved.zero_one and adam._hvd_dgc.period == 1
    # not taken over: error feedback on Adam's raw gradient, the longer stages
    adam = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3),
                                          freeze_variance=False)
    sgd = _keras()
    assert adam._hvd_dgc.schedule.config() == DensitySchedule.coverage(
        0.001, ADAPTIVE_SENDS).config()
    assert sgd._hvd_dgc.schedule.config() == DensitySchedule.coverage(
        0.001, DEFAULT_SENDS).config()
    # a quantiser has no density: Adam with Compression.sign is taken over all the same
    # (1-bit Adam: exact Adam to the freeze, then the quantiser on the linear update)
    signed = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3),
                                            compression=TFCompression.sign)
    assert signed._hvd_dgc.schedule.density == 1.0
    assert signed._hvd_dgc.resolved.freeze == DEFAULT_FREEZE
    assert not signed._hvd_dgc.resolved.taken_over.lost
    raw = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(1e-3), freeze_variance=False,
                                         compression=TFCompression.sign)
    assert raw._hvd_dgc.resolved.freeze is None and raw._hvd_dgc.resolved.taken_over.lost


def test_an_optimizer_not_taken_over_is_said_on_the_line_and_warned(capsys, monkeypatch):
    """NAdam (torch), RMSprop (Keras): error feedback on the raw gradient, said in the
    rank-0 line (the full plan: verbose) and warned with what is lost and what is taken
    over; SGD and Adam not."""
    import warnings
    from hvd_dgc import say
    monkeypatch.setenv("HVD_DGC_VERBOSE", "1")
    say.reset()  # (each warning is said once a process: hvd_dgc/say.py)
    hvd_torch.init()
    hvd_tf.init()
    model = torch.nn.Linear(64, 32)

    def wrap(make):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        lost = [str(w.message) for w in caught if "not taken over" in str(w.message)]
        return lost, capsys.readouterr().out

    for cls, taken in ((torch.optim.NAdam, False), (torch.optim.SGD, True),
                       (torch.optim.Adam, True)):
        lost, line = wrap(lambda: hvd_torch.DistributedOptimizer(
            cls(model.parameters(), lr=0.1), named_parameters=[
                (f"{cls.__name__}.{n}", p) for n, p in model.named_parameters()]))
        if taken:
            assert not lost and "not taken over" not in line, cls
        else:
            assert lost == [lost[0]] and "NAdam is not taken over" in lost[0] and \
                "no momentum correction" in lost[0] and "delay and period" in lost[0] and \
                "torch.optim.SGD, Adam and AdamW" in lost[0], lost
            assert "; NAdam not taken over: error feedback on its raw gradient." in line
    lost, line = wrap(lambda: hvd_keras.DistributedOptimizer(
        tf.keras.optimizers.RMSprop(0.1)).apply_gradients(
            [(tf.ones((64, 32)), tf.Variable(tf.zeros((64, 32))))]))
    assert len(lost) == 1 and "RMSprop is not taken over" in lost[0] and \
        "Keras' SGD, Adam and AdamW" in lost[0], lost
    assert "; RMSprop not taken over" in line
    # density=1.0: nothing is sparsified, nothing to say
    lost, line = wrap(lambda: hvd_torch.DistributedOptimizer(
        torch.optim.NAdam(model.parameters()), named_parameters=[
            (f"dense.{n}", p) for n, p in model.named_parameters()], density=1.0))
    assert not lost and "not taken over" not in line


def test_the_default_freeze_is_early_and_refreshed_a_chosen_one_frozen_once():
    """No option: exact Adam to step 20, the variance refreshed at 40, 80, ...; with
    refresh_variance=False the former default (200, frozen once); a freeze_variance=N the
    script chose is frozen once unless it asks for refreshes too. Both frameworks."""
    from hvd_dgc.adam import DEFAULT_FREEZE, FROZEN_ONCE_FREEZE

    def torch_adam(**options):  # DistributedOptimizer's resolution, without Horovod's init
        from horovod.torch.mpi_ops import Adasum, Average, Sum
        from hvd_dgc.resolve import HorovodArguments
        from hvd_dgc.torch.optimizer import TORCH
        return DGCConfig.from_options(options, "torch", "DistributedOptimizer").resolve(
            TORCH, TorchCompression.dgc, HorovodArguments(Average, 1.0, 1, None,
                                                          (Average, Sum, Adasum)),
            (False, "AdamW", True))

    def keras_adam(**options):
        return hvd_keras.DistributedOptimizer(tf.keras.optimizers.AdamW(1e-3), **options)

    assert (DEFAULT_FREEZE, FROZEN_ONCE_FREEZE) == (20, 200)
    for make, resolved in ((torch_adam, lambda o: o),
                           (keras_adam, lambda o: o._hvd_dgc.resolved)):
        cases = {(): (20, "auto"), (("refresh_variance", False),): (200, False),
                 (("freeze_variance", 50),): (50, False),
                 (("freeze_variance", 50), ("refresh_variance", 100)): (50, 100)}
        for options, (freeze, refresh) in cases.items():
            got = resolved(make(**dict(options)))
            assert (got.freeze, got.refresh, got.schedule.refresh) == \
                (freeze, refresh, refresh), (make.__name__, options, got.freeze, got.refresh)
        said = resolved(make()).schedule.describe()
        assert "exact Adam (dense) to step 20, then its second moment frozen, refreshed " \
               "at steps 40, 80, 160, ... (0/1 Adam)" in said, said
