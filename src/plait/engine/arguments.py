"""The Trainer's arguments, checked when it is made (before any health check, model or directory): each of the
kind it takes, or an ArgumentError naming it and what it takes."""

from __future__ import annotations

from torch import nn

from plait.core.errors import ArgumentError, ConfigError
from plait.engine.callbacks import Callback
from plait.parallel import DistEnv


def check_arguments(model, parallelize, loss, data, val_data, callbacks, env) -> list[Callback]:
    """The Trainer's arguments, each of the kind it takes (ArgumentError naming it and what it takes); the
    callbacks as a list. Checked when the Trainer is made: before any health check, model or directory."""
    if isinstance(model, nn.Module):
        raise ArgumentError(
            f"model= takes what builds the model (its class, or a function returning it): plait builds it on the "
            f"meta device and materialises each rank's shard; got a built {type(model).__name__}: pass "
            f"{type(model).__name__} (or lambda: {type(model).__name__}(...))"
        )
    if isinstance(model, type) and not issubclass(model, nn.Module):
        raise ArgumentError(f"model={model.__name__} is not an nn.Module class; give a class or function building one")
    for name, value in (("model", model), ("parallelize", parallelize), ("loss", loss)):
        if value is not None and not callable(value):
            raise ArgumentError(f"{name}= takes a function (or class), got {_kind(value)}")
    if parallelize is not None and model is None:
        raise ConfigError("parallelize= is the plan for your own model: give model= too")
    if val_data is not None and data is None:
        raise ConfigError("val_data= goes with your own data=; plait's data has its own validation split")
    for name, value in (("data", data), ("val_data", val_data)):
        if value is None:
            continue
        if isinstance(value, str | bytes | dict) or not (hasattr(value, "__iter__") or hasattr(value, "__getitem__")):
            hint = "; for a prepared corpus set cfg.data.source instead" if isinstance(value, str) else ""
            raise ArgumentError(
                f"{name}= takes a sequence or iterable of samples (token lists, 1-D tensors, or dicts with "
                f"'input_ids'), got {_kind(value)}{hint}"
            )
        if hasattr(value, "__len__") and len(value) == 0:
            raise ArgumentError(f"{name}= is empty; give at least one global batch of samples")
    if isinstance(callbacks, str | bytes | Callback) or not hasattr(callbacks, "__iter__"):
        one = isinstance(callbacks, Callback)
        hint = f"; put it in a list: callbacks=[{type(callbacks).__name__}()]" if one else ""
        raise ArgumentError(f"callbacks= takes a list of plait.Callback instances, got {_kind(callbacks)}{hint}")
    callbacks = list(callbacks)
    for i, c in enumerate(callbacks):
        if isinstance(c, type) and issubclass(c, Callback):
            raise ArgumentError(f"callbacks[{i}] is the class {c.__name__}: give an instance, {c.__name__}()")
        if not isinstance(c, Callback):
            raise ArgumentError(f"callbacks[{i}] is {_kind(c)}, not a plait.Callback: subclass plait.Callback")
    if env is not None and not isinstance(env, DistEnv):
        raise ArgumentError(f"env= takes a plait.parallel.DistEnv (a process group set up) or None, got {_kind(env)}")
    return callbacks


def _kind(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
