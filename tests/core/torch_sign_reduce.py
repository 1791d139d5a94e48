"""The sign's compressed allreduce (hvd_dgc/torch/quantize.py SignCompressor,
``collective="allreduce"``) on every rank under horovodrun, for
tests/core/test_sign_reduce.py: every rank's inputs are drawn from generators any process can
rebuild, so the test runs the NumPy reference (tests/reference.py ``sign_reduce``) on the
same inputs."""

import copy

import torch

import hvd_dgc.torch as hvd
from hvd_dgc.torch.collective import HorovodComm
from hvd_dgc.torch.compression import Compression
from hvd_dgc.torch.statistics import STATE_KEY
from tests.torch.torch_dgc import flat_params, loss_of, ranks_identical, wide_mlp

from tests.reference import SIGN_NUMELS as NUMELS, SIGN_STEPS as STEPS, sign_inputs as inputs


def steps(collective="allreduce"):
    """STEPS exchanges of NUMELS' tensors in one launch; each step's residuals are the
    step's inputs plus what the last left. Returns, per step, the averages, this rank's
    residuals after, each tensor's share of the bytes on the wire and its server errors
    (``{tensor: (start, error)}``), and a checkpoint's round trip."""
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    comp = Compression.sign(collective=collective)
    comm = HorovodComm(hvd.global_process_set)
    residuals = [torch.zeros(n) for n in NUMELS]
    out = []
    for step in range(STEPS):
        for v, x in zip(residuals, inputs(world, step)[rank]):
            v.add_(torch.from_numpy(x))
        before = [v.clone().numpy() for v in residuals]
        ex = comp.launch(residuals, list(range(len(NUMELS))), f"sign.{step}", comm)
        comp.advance(ex)
        averages = comp.collect(ex)
        out.append({"before": before, "averages": [a.numpy() for a in averages],
                    "residuals": [v.clone().numpy() for v in residuals],
                    "wire": comp.wire_shares([(n,) for n in NUMELS], world),
                    "errors": {k: (lo, e.numpy()) for k, (lo, e) in
                               comp.state_dict()["server_errors"].items()}})
    state = comp.state_dict()
    fresh = Compression.sign(collective=collective)
    fresh.load_state_dict(state, rank)
    other = Compression.sign(collective=collective)
    other.load_state_dict(state, rank + 1)  # another rank's chunks: not taken
    return {"steps": out, "reloaded": {k: (lo, e.numpy()) for k, (lo, e) in
                                       fresh.state_dict()["server_errors"].items()},
            "other_rank": len(other.state_dict()["server_errors"])}


def _steps(model, opt, start, stop, rank):
    for step in range(start, stop):
        opt.zero_grad()
        loss_of(model, step, rank, features=64, classes=10).backward()
        opt.step()


def _poisoned(grad):
    """A gradient hook (inside backward, before hvd_dgc's sees it): one NaN."""
    grad = grad.clone()
    grad.view(-1)[7] = float("nan")
    return grad


def adamw_default(collective=None):
    """AdamW with no option on 3 or more ranks: 0/1 Adam (exact to step 20, then the
    sign every 4th step), its sign as the compressed allreduce. Against the same run with
    ``collective="allgather"``; its bytes; a checkpoint between exchanges resumed bit
    for bit (server errors included: without them the run goes elsewhere); a
    non-finite gradient at an exchange skipped with the server errors left as they
    were."""
    hvd.init()
    rank, world = hvd.rank(), hvd.size()

    def make(tag, **options):
        if collective is not None and not options:
            options = dict(compression=hvd.Compression.sign(collective=collective), period=4)
        model = wide_mlp(6)
        return model, hvd.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            named_parameters=[(f"sr{tag}." + n, p) for n, p in model.named_parameters()],
            **options)

    def errors(opt):
        return {k: (lo, e.clone()) for k, (lo, e) in
                opt._resolved.compressor.state_dict()["server_errors"].items()}

    model, opt = make("a")
    gathered, gopt = make("b", compression=hvd.Compression.sign(collective="allgather"),
                          period=4)
    exchanges = []  # the steps whose exchange sends signs
    for step in range(32):
        if step == 25:  # between exchanges, without flush(), as a Horovod script saves
            saved = copy.deepcopy(opt.state_dict())
            weights = copy.deepcopy(model.state_dict())
        signs = opt.compression_stats()["paths"].get("sign", 0)
        _steps(model, opt, step, step + 1, rank)
        if opt.compression_stats()["paths"].get("sign", 0) > signs:
            exchanges.append(step)
    _steps(gathered, gopt, 0, 32, rank)
    final = flat_params(model).clone()
    opt.flush()
    gopt.flush()
    last = opt.compression_stats()["last_step"]["tensors"]
    out = {"paths": opt.compression_stats()["paths"],
           "bytes": {v["numel"]: v["bytes"] for v in last.values() if v["path"] == "sign"},
           "gathered_bytes": {v["numel"]: v["bytes"] for v in
                              gopt.compression_stats()["last_step"]["tensors"].values()
                              if v["path"] == "sign"},
           "compressor": [type(opt._resolved.compressor).__name__,
                          opt._resolved.compressor.collective]}
    out["identical"] = ranks_identical(model, "sr.a.flushed")
    for tag in ("resumed", "no_errors"):  # (the names the script saved with)
        again, aopt = make("a")
        again.load_state_dict(weights)
        state = copy.deepcopy(saved)
        if tag == "no_errors":
            state[STATE_KEY]["compressor"] = {}
        aopt.load_state_dict(state)
        _steps(again, aopt, 25, 32, rank)
        out[tag] = float((flat_params(again) - final).abs().max())
    out["apart_from_gathered"] = float((flat_params(model) - flat_params(gathered)).abs().max())
    out["exchanges"] = exchanges
    # delayed averaging (delay=1): the compressed allreduce's two rounds launched at one
    # step and collected at the next, the ranks equal after flush()
    delayed, dopt = make("d", delay=1)
    _steps(delayed, dopt, 0, 32, rank)
    dopt.flush()
    out["delayed"] = {
        "identical": ranks_identical(delayed, "sr.d.flushed"),
        "finite": bool(torch.isfinite(flat_params(delayed)).all()),
        "signs": dopt.compression_stats()["paths"].get("sign", 0),
        "bytes": {v["numel"]: v["bytes"] for v in
                  dopt.compression_stats()["last_step"]["tensors"].values()
                  if v["path"] == "sign"},
        "apart": float((flat_params(delayed) - final).abs().max())}
    # 1-bit Adam (the sign every step after the freeze): a NaN on rank 1 at step 24 is
    # skipped on every rank, the server errors left as they were
    at = 24
    bad, bopt = make("c", compression=hvd.Compression.sign(collective=collective or "auto"),
                     period=1)
    _steps(bad, bopt, 0, at, rank)
    before = errors(bopt)
    hook = next(bad.parameters()).register_hook(_poisoned) if rank == 1 else None
    _steps(bad, bopt, at, at + 1, rank)
    if hook is not None:
        hook.remove()
    after = errors(bopt)
    _steps(bad, bopt, at + 1, 32, rank)
    bopt.flush()
    out["skipped"] = bopt.compression_stats()["nonfinite_steps"]
    out["errors_kept"] = sorted(before) == sorted(after) and len(before) > 0 and all(
        before[k][0] == after[k][0] and torch.equal(before[k][1], after[k][1])
        for k in before)
    out["finite"] = bool(torch.isfinite(flat_params(bad)).all())
    out["bad_identical"] = ranks_identical(bad, "sr.c.flushed")
    return out
