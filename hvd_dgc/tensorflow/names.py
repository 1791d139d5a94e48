"""What a variable is called: in error messages, in the config every rank compares, and
in the planner (the same module, for parameters, in hvd_dgc/torch/names.py)."""

__all__ = ["tensor_names", "variable_name"]


def variable_name(var, i):
    """What error messages and the config check call a variable (Keras 3: its path;
    else its name; else ``var{i}``, ``i`` its index)."""
    return getattr(var, "path", None) or getattr(var, "name", None) or f"var{i}"


def tensor_names(variables):
    """Each of ``variables``' names, in order."""
    return [variable_name(v, i) for i, v in enumerate(variables)]
