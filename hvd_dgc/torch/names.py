"""What a parameter is called: in error messages, in the config every rank compares, and
in the planner (the same module, for variables, in hvd_dgc/tensorflow/names.py)."""

__all__ = ["tensor_names", "check_dtypes"]


def tensor_names(named_parameters, param_groups):
    """parameter -> its name: Horovod's ``named_parameters`` checked as Horovod checks
    them (tuples, unique, every parameter of the optimizer named), or Horovod's own
    ``allreduce.noname.{group}.{index}`` where the script passes none."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v)
                            for i, group in enumerate(param_groups)
                            for j, v in enumerate(group["params"])]
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         "Found duplicates: %s" % ", ".join(sorted(dups)))
    named_ids = {id(v) for _, v in named_parameters}
    unnamed = [p for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         "were not named (shapes: %s). Pass model.named_parameters() for the "
                         "whole model the optimizer holds."
                         % ", ".join(str(tuple(p.shape)) for p in unnamed))
    return {v: k for k, v in named_parameters}


def check_dtypes(params, names):
    """TypeError naming a trainable parameter that is not real floating point."""
    for p in params:
        if p.requires_grad and not (p.is_floating_point() and not p.is_complex()):
            raise TypeError(f"hvd_dgc: parameter '{names[p]}' has dtype {p.dtype}; DGC "
                            f"compresses real floating-point gradients only (float16, "
                            f"bfloat16, float32, float64). Leave it out of the optimizer "
                            f"or set requires_grad=False.")
