"""Adam and AdamW taken over (hvd_dgc/adam.py has the maths and the papers).

Before the freeze the wrapped Adam steps on dense averages, untouched. At the end of
step ``freeze - 1`` its second moment becomes a fixed scale ``(1 - beta1) P`` per
parameter (kept in the optimizer's state, so checkpoints and Horovod's elastic state
carry it), and its first moment moves into DGC's memory as ``u = P m``. From then on
the memory applies ``beta1`` as momentum (and Adam's L2 weight decay) to the scaled
gradient, and this step applies what arrives: AdamW's decoupled decay, then
``x -= lr / (1 - beta1^t) * average``.

With ``refresh_variance``, Adam's ``exp_avg_sq`` goes on after the freeze as this rank's
estimate of exact Adam's (``observe``: from the local gradient at each launch and the
one before), and at a refresh step the ranks average it; the scale and the memory move
to it (``_refresh``).
"""

import math

import torch

from hvd_dgc.adam import NEVER, VARIANCE_FLOOR, observed_weights, refresh_count, refreshes_at
from hvd_dgc.lagging import StepSize
from hvd_dgc.torch.update import step_at_records

__all__ = ["AdamTakeOver", "PREVIOUS_KEY", "SCALE_KEY", "check_adam"]

#: The frozen scale (1 - beta1) / (sqrt(v_T / (1 - beta2^T)) + eps), in state[p].
SCALE_KEY = "hvd_dgc_frozen_scale"

#: This rank's previous gradient of p, in state[p], once refreshing (``observe``).
PREVIOUS_KEY = "hvd_dgc_previous_gradient"


def check_adam(optimizer):
    """What the take-over cannot honour, refused with the fix (at wrap time)."""
    for i, group in enumerate(optimizer.param_groups):
        if group.get("maximize", False):
            raise ValueError(f"hvd_dgc: {type(optimizer).__name__}(maximize=True) (param group "
                             f"{i}) cannot be taken over (the frozen-variance update "
                             f"minimises). Negate the loss instead, or pass "
                             f"freeze_variance=False (Adam's own update on error feedback).")


class AdamTakeOver:
    """The hyper-parameters and scale the memory applies for each parameter, and the
    step that applies the average once the variance is frozen. ``freeze``: the step at
    which the take-over starts; ``step()``: the optimizer's step count now;
    ``seed(p, u)``: start ``p``'s memory momentum at ``u`` (``p``'s shape)."""

    def __init__(self, optimizer, freeze, step, seed, refresh=False, rescale=None,
                 average=None):
        self.optimizer, self.freeze = optimizer, int(freeze)
        self._step, self._seed = step, seed
        self._group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
        # refresh_variance: when; the memory's rescale(p, ratio) (ratio: p's shape); the
        # ranks' average of a list of tensors, in place (it counts the bytes sent)
        self.refresh, self._rescale, self._average = refresh, rescale, average
        self.declined = False
        self._log_decay = {}  # id(group): the sum of log(1 - lr wd) of its AdamW decays

    def freeze_at(self, step):
        """Freeze at ``step`` (plan.py ``adam_freeze``: later than planned where every
        tensor goes dense before it on this link), or never (None: exact Adam throughout,
        as with Horovod)."""
        if step is None:
            self.declined, self.freeze = True, NEVER
        else:
            self.freeze = int(step)

    @property
    def frozen(self):
        return self._step() >= self.freeze

    def phase(self):
        """In words, for ``compression_stats()``."""
        if self.declined:
            return "exact Adam (not taken over: every tensor dense on this link)"
        return "frozen variance" if self.frozen else "exact Adam"

    def stats(self):
        """What ``compression_stats()`` says of the take-over."""
        out = {"adam_phase": self.phase(), "adam_freeze": None if self.declined
               else self.freeze}
        if self.refresh is not False and not self.declined:
            out.update(adam_refresh=self.refresh,
                       adam_refreshes=refresh_count(self._step(), self.freeze, self.refresh))
        return out

    def observe(self, params, scale=None, world=1):
        """This rank's ``v`` moves on with the local gradients of ``params`` (dense; in
        the space ``unscale_`` gives: GradScaler's ``scale`` divided out), once frozen
        and refreshing: by ``g^2 / world + (1 - 1/world) g g_previous``, whose average
        over the ``world`` ranks estimates exact Adam's (hvd_dgc/adam.py
        ``observed_weights``). Adam's L2 decay counts, as in its own ``v``."""
        if self.refresh is False or not self.frozen:
            return
        by_group = {}
        for p in params:
            if p.grad is not None and not p.grad.is_sparse and \
                    "exp_avg_sq" in self.optimizer.state[p]:
                by_group.setdefault(id(self._group_of[p]), []).append(p)
        with torch.no_grad():
            for members in by_group.values():
                group = self._group_of[members[0]]
                beta2 = float(group["betas"][1])
                sqs = [self.optimizer.state[p]["exp_avg_sq"] for p in members]
                grads = [p.grad for p in members]
                if scale is not None:  # (a tensor on the device: not read back)
                    grads = torch._foreach_div(grads, scale)
                l2 = 0.0 if group.get("decoupled_weight_decay", False) else \
                    float(group["weight_decay"])
                if l2:
                    grads = torch._foreach_add(grads, members, alpha=l2)
                square, cross = observed_weights(world)
                torch._foreach_mul_(sqs, beta2)
                torch._foreach_addcmul_(sqs, grads, grads, value=(1.0 - beta2) * square)
                if cross:  # (one rank: its own square is the average's; nothing kept)
                    previous = [self._previous(p) for p in members]
                    torch._foreach_addcmul_(sqs, grads, previous, value=(1.0 - beta2) * cross)
                    torch._foreach_copy_(previous, grads)

    def _previous(self, p):
        """This rank's gradient of ``p`` at the last step observed (zeros before)."""
        state = self.optimizer.state[p]
        if PREVIOUS_KEY not in state:
            state[PREVIOUS_KEY] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state[PREVIOUS_KEY]

    def hyper(self, p):
        """``(momentum, nesterov, weight_decay)`` the memory applies for ``p``: Adam's
        beta1 and its L2 weight decay once frozen (AdamW's decay is this step's)."""
        if not self.frozen:
            return 0.0, False, 0.0
        group = self._group_of[p]
        l2 = 0.0 if group.get("decoupled_weight_decay", False) else group["weight_decay"]
        return float(group["betas"][0]), False, float(l2)

    def scale(self, p):
        """The memory's gradient is ``scale * g`` (None: as it is)."""
        if not self.frozen:
            return None
        state = self.optimizer.state[p]
        if SCALE_KEY not in state:  # a checkpoint from before the take-over: freeze now
            self._freeze_one(p, seed=False, typical=self._typical())
        return state[SCALE_KEY]

    def step_sizes(self, ahead=True):
        """``{param: StepSize}``: what the frozen step multiplies ``p.grad`` by, ``lr / (1 -
        beta1^t)``, and AdamW's decays so far (delayed averaging takes each own step back
        at the size it was applied with: hvd_dgc/lagging.py); ``ahead``: the coming
        step's (its count, its decay), else a flush's (the count now, as ``correct``)."""
        if not self.frozen:
            return None
        sizes, state = {}, self.optimizer.state
        for group in self.optimizer.param_groups:
            lr, beta1 = float(group["lr"]), float(group["betas"][0])
            decay = self._log_decay.get(id(group), 0.0)
            if ahead:
                decay += _log_decay(group)
            for p in group["params"]:
                step = state[p].get("step") if p in state else None
                t = (0.0 if step is None else float(step)) + (1.0 if ahead else 0.0)
                sizes[p] = StepSize(lr / (1.0 - beta1 ** max(t, 1.0)), decay)
        return sizes

    def correct(self, base_step):
        """Apply the corrections in ``p.grad`` (a flush, which is not a step): ``lr /
        (1 - beta1^t) * correction`` at Adam's count now, no decay."""
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                self._apply(group, params, advance=False)

    def step(self, base_step, closure, sparse, updates=()):
        if not self.frozen:
            loss = base_step(closure)
            if self._step() + 1 == self.freeze:
                typical = self._typical()
                for p in self._group_of:
                    self._freeze_one(p, seed=True, typical=typical)
            return loss
        loss = self._frozen_step(closure, sparse, updates)
        if refreshes_at(self._step() + 1, self.freeze, self.refresh):
            self._refresh()
        return loss

    def _frozen_step(self, closure, sparse, updates):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            alphas = {}
            for group in self.optimizer.param_groups:
                alphas.update(self._advance(group, [p for p in group["params"]
                                                    if p.grad is not None and p not in sparse]))
            # (a closure's backward may have written the gradients again: all of them)
            self._add(alphas, updates if closure is None else ())
        return loss

    def _refresh(self):
        """The ranks' ``v`` averaged (every rank goes on from the average), each scale
        recomputed from it, and the memory's momentum and residual moved to the new
        scale (``new / old``): they hold scaled gradients."""
        params = [p for p in self._group_of if SCALE_KEY in self.optimizer.state[p]
                  and "exp_avg_sq" in self.optimizer.state[p]]
        with torch.no_grad():
            self._average([self.optimizer.state[p]["exp_avg_sq"] for p in params])
            for p in params:
                state, group = self.optimizer.state[p], self._group_of[p]
                v = state["exp_avg_sq"]
                finite = torch.isfinite(v)
                if not bool(finite.all()):  # a rank's overflow step: the tensor's mean
                    v.copy_(torch.where(finite, v, v[finite].mean() if bool(finite.any())
                                        else torch.ones((), dtype=v.dtype, device=v.device)))
                v.clamp_(min=0.0)  # (the estimate below zero: observe)
                if group.get("amsgrad", False):
                    torch.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
                if not bool(v.any()):  # (no gradient since the freeze: kept as it is)
                    continue
                old = state[SCALE_KEY]
                new = self._precondition(*self._second_moment(p), group["eps"]).mul_(
                    1.0 - float(group["betas"][0]))
                self._rescale(p, new / old)
                old.copy_(new)

    def _apply(self, group, params, advance=True):
        """``x (1 - lr wd) - lr / (1 - beta1^t) * p.grad``; ``advance``: a step (Adam's
        count t moves on, AdamW's decay applies), else a correction."""
        self._add(self._advance(group, params, advance))

    def _advance(self, group, params, advance=True):
        """A step's AdamW decay and Adam's count moved on (``advance``); each
        parameter's step size ``-lr / (1 - beta1^t)``."""
        if not params:
            return {}
        lr, beta1 = float(group["lr"]), float(group["betas"][0])
        if advance and _log_decay(group):
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
            self._log_decay[id(group)] = self._log_decay.get(id(group), 0.0) + \
                _log_decay(group)
        alphas = {}
        for p in params:
            state = self.optimizer.state[p]
            step = state.get("step")
            step = torch.zeros((), dtype=torch.float32) if step is None else step
            if advance:
                step = state["step"] = step + 1
            alphas[p] = -lr / (1.0 - beta1 ** max(float(step), 1.0))
        return alphas

    @staticmethod
    def _add(alphas, updates=()):
        """``p += alpha * p.grad``: where the average came as records into a ViewUpdate,
        at their positions only (update.step_at_records); else one foreach per step
        size (all alike but for a late tensor)."""
        stepped = step_at_records(updates, alphas) if updates else set()
        by_alpha = {}
        for p, alpha in alphas.items():
            if p not in stepped:
                by_alpha.setdefault(alpha, []).append(p)
        for alpha, params in by_alpha.items():
            torch._foreach_add_(params, [p.grad for p in params], alpha=alpha)

    def _second_moment(self, p):
        """Adam's ``v`` of ``p`` and its bias correction ``1 - beta2^t``, or None."""
        state, group = self.optimizer.state[p], self._group_of[p]
        if "exp_avg_sq" not in state:
            return None
        v = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        return v, 1.0 - float(group["betas"][1]) ** float(state["step"])

    def _typical(self):
        """The mean bias-corrected ``v`` over the tensors Adam stepped: what a tensor
        without a gradient in the warm-up is given (1.0 if none had one)."""
        means = [_row_major_mean(v) / c for v, c in filter(None, map(self._second_moment,
                                                                  self._group_of))]
        means = [m for m in means if m > 0]
        return sum(means) / len(means) if means else 1.0

    def _freeze_one(self, p, seed, typical):
        """``p``'s scale from Adam's state now, and (``seed``) its first moment into the
        memory, in the preconditioned space. A tensor with no gradient in the warm-up
        (``v`` absent or 0) gets the ``typical`` v, not a scale of 1/eps."""
        state, group = self.optimizer.state[p], self._group_of[p]
        beta1 = float(group["betas"][0])
        moment = self._second_moment(p)
        if moment is None or not bool(moment[0].any()):  # (zero gradients: the exchange
            # gives a tensor whose hook did not fire zeros, so every rank joins)
            state[SCALE_KEY] = torch.full_like(
                p, (1.0 - beta1) / (typical ** 0.5 + group["eps"]),
                memory_format=torch.contiguous_format)
            return
        precondition = self._precondition(*moment, group["eps"])
        state[SCALE_KEY] = precondition.mul(1.0 - beta1).contiguous()
        if seed:
            self._seed(p, precondition * state["exp_avg"])

    @staticmethod
    def _precondition(v, correction, eps):
        """P from the bias-corrected ``v``, floored at VARIANCE_FLOOR times its mean
        (hvd_dgc/adam.py)."""
        v = v.clamp(min=_row_major_mean(v) * VARIANCE_FLOOR)
        return (v.sqrt() / correction ** 0.5).add_(eps).reciprocal_()


def _log_decay(group):
    """``log(1 - lr wd)`` of one AdamW step's decoupled decay (0 for Adam's L2 decay,
    which is in the gradient)."""
    if not (group.get("decoupled_weight_decay", False) and group["weight_decay"]):
        return 0.0
    return math.log1p(-float(group["lr"]) * float(group["weight_decay"]))


def _row_major_mean(v):
    """``v``'s mean, summed in row-major order: a channels_last ``v`` summed in its memory
    order rounds apart from the row-major model's (1 ulp, on an H100), and the floor, so
    every value under it, moves with it. A copy at a freeze or refresh only."""
    return float(v.contiguous().mean())
