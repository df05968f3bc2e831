"""No public function or method of dmlbook takes more than 10 parameters (issue 24): a longer
signature wants a config object (``dp.TrainConfig``, ``ps.PSConfig``) instead."""

import dataclasses
import importlib
import inspect
import pkgutil

import dmlbook

LIMIT = 10
# Modules that need what a plain install may lack (a browser, a hub) or that start a program.
SKIP = ("dmlbook.__main__", "dmlbook.book.__main__", "dmlbook.bench.__main__")


def _modules():
    for info in pkgutil.walk_packages(dmlbook.__path__, "dmlbook."):
        if info.name in SKIP or any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # an optional extra that is not installed: nothing to walk
            continue


def _public_callables():
    seen = set()
    for module in _modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) and id(obj) not in seen:
                seen.add(id(obj))
                yield f"{module.__name__}.{name}", obj
            elif inspect.isclass(obj) and id(obj) not in seen:
                seen.add(id(obj))
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr != "__init__":
                        continue
                    if attr == "__init__" and dataclasses.is_dataclass(obj):
                        continue  # a config object's fields: what the limit sends callers to
                    member = getattr(member, "__func__", member)  # static and class methods
                    if inspect.isfunction(member):
                        yield f"{module.__name__}.{name}.{attr}", member


def _count(fn) -> int:
    """Parameters a caller may pass (``self`` and ``cls`` are not the caller's to pass)."""
    params = list(inspect.signature(fn).parameters)
    return len([p for p in params if p not in ("self", "cls")])


def test_no_public_function_takes_more_than_ten_parameters():
    walked = list(_public_callables())
    assert len(walked) > 300  # the walk reached the package, not an empty corner of it
    offenders = sorted(f"{name}: {_count(fn)}" for name, fn in walked if _count(fn) > LIMIT)
    assert not offenders, "over 10 parameters:\n" + "\n".join(offenders)
