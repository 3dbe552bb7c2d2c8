"""Resolve a MODEL argument: ``path/file.py:factory``, ``package.module:factory`` or a zoo name.

A factory returns ``(model, example_inputs)``; one that takes ``batch`` or ``seq_len`` arguments is
given those asked for. Every failure is a one-line ModelSpecError.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from torch import nn

from ..errors import GraphoptError, ModelSpecError


def load_model(spec: str | None, **zoo_kwargs):
    """Returns (model, example_inputs, display_name)."""
    from ..examples import zoo

    if spec is None:
        spec = zoo.DEFAULT
    if ":" not in spec:
        if spec in zoo.names():
            try:
                model, inputs = zoo.get(spec, **{k: v for k, v in zoo_kwargs.items() if v is not None})
            except (ValueError, TypeError) as e:  # bad --batch / --seq-len
                raise ModelSpecError(_line(e)) from None
            return model, inputs, spec
        if spec.endswith(".py"):
            raise ModelSpecError(f"'{spec}' names a file but no factory; write {spec}:make_model")
        raise ModelSpecError(f"unknown model '{spec}'; use FILE.py:FACTORY, package.module:FACTORY, "
                             f"or a zoo name ({', '.join(zoo.names())})")
    where, _, factory_name = spec.rpartition(":")
    if not factory_name.isidentifier():
        raise ModelSpecError(f"'{factory_name}' in '{spec}' is not a function name")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.exists():
            raise ModelSpecError(f"model file {where} does not exist")
        mod_name = f"_graphopt_model_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ModelSpecError(f"cannot import {where} as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            raise ModelSpecError(f"importing {where} failed: {type(e).__name__}: {_line(e)}") from None
    else:
        try:
            module = importlib.import_module(where)
        except (Exception, SystemExit) as e:
            raise ModelSpecError(f"cannot import module '{where}': {type(e).__name__}: {_line(e)}") from None
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ModelSpecError(f"{where} has no function '{factory_name}'")
    if not callable(factory):
        raise ModelSpecError(f"'{factory_name}' in {where} is not a function (it is {type(factory).__name__})")
    # a factory taking ``batch`` / ``seq_len`` gets the ones asked for (``graphopt bench --batch``)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {k: v for k, v in zoo_kwargs.items() if k in ("batch", "seq_len") and v is not None and k in params}
    try:
        result = factory(**kwargs)
    except GraphoptError:
        raise
    except (Exception, SystemExit) as e:
        raise ModelSpecError(f"factory {spec} raised {type(e).__name__}: {_line(e)}") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ModelSpecError(f"factory {spec} must return (model, example_inputs), got {got}")
    model, inputs = result
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"factory {spec} returned a {type(model).__name__} as the model; it must be a torch.nn.Module")
    return model, inputs, spec


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:240] if text else ""
