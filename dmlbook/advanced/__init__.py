"""Advanced paradigms: several parallelisms at once, and training beyond one cluster (ch. 9-13).

One folder per strategy:

* ``tensor_parallel``: Megatron column / row linears, parallel MLP and attention, the
  vocabulary-parallel embedding and loss (chapter 9), sequence parallelism (chapter 13), and one
  ``comm`` module with every conjugate operator of both
* ``context_parallel``: ring attention, the zigzag split, and its plan styles (chapter 13)
* ``expert_parallel``: a mixture-of-experts layer and its experts spread by all-to-all (chapter 13)
* ``zero``: ZeRO stages 1-3 on flat shards, and ``zero.sharded_optimizer``: ZeRO-1 on whole
  parameters around any ``torch.optim`` optimizer (chapter 9b, beyond the book)
* ``composition``: the ``Layout`` of degrees, plans of styles, the one ``compose`` function in
  the order stated once, chapter 9's mesh and DP x TP training, chapter 13's five-dimensional
  training and its planner
* ``federated``: FedAvg, non-IID splits, secure aggregation (chapter 10)
* ``elastic``: elastic training under torchrun, an adaptive parameter server, an autoscaled
  serving pool (chapter 11)
* ``speedups``: profiling compute against communication, job multiplexing and migration,
  heterogeneous workers (chapter 12)

The flat modules these folders replaced still import (:data:`OLD_MODULES`): ``import
dmlbook.advanced.layout`` gives :mod:`dmlbook.advanced.composition.layout` itself, and an old
module whose names now live in several places (``parallelize``, ``mesh``, ``composed``) is a
module holding all of them, each under its old name (:data:`RENAMED`). No file stands in for
them: :class:`_OldModuleFinder` maps the names on import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

__all__ = [
    "OLD_MODULES",
    "composition",
    "context_parallel",
    "elastic",
    "expert_parallel",
    "federated",
    "speedups",
    "tensor_parallel",
    "zero",
]

# Each old flat module of dmlbook.advanced: the modules its names live in now. One entry: the old
# name is that module. Several: a module made of each one's public names. ``renamed``: old name
# -> (module, new name), for names that meant a second thing.
OLD_MODULES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_comm": ("tensor_parallel.comm",),
    "vocab_parallel": ("tensor_parallel.vocab_parallel",),
    "sequence_parallel": ("tensor_parallel.sequence_parallel",),
    "context_parallel_styles": ("context_parallel.styles",),
    "moe": ("expert_parallel.moe",),
    "sharded_optimizer": ("zero.sharded_optimizer",),
    "layout": ("composition.layout",),
    "composed": ("composition.training",),
    "planner": ("composition.planner",),
    "parallelize": ("composition.plan", "composition.compose"),
    "mesh": ("composition.mesh",),
}
RENAMED: dict[tuple[str, str], tuple[str, str]] = {
    ("parallelize", "apply_tensor_parallel"): ("composition.plan", "apply_plan"),
    # the one single-process reference (returns the loop's state: .losses, .model)
    ("mesh", "train_reference"): ("dmlbook.data_parallel.loop", "train_reference"),
    ("composed", "train_reference"): ("dmlbook.data_parallel.loop", "train_reference"),
}


def _full(name: str) -> str:
    return name if name.startswith("dmlbook.") else f"{__name__}.{name}"


class _OldModuleLoader(importlib.abc.Loader):
    """Loads an old flat name: the new module itself, or a module of the new modules' names."""

    def __init__(self, old: str) -> None:
        self.old = old

    def create_module(self, spec):
        modules = [importlib.import_module(_full(m)) for m in OLD_MODULES[self.old]]
        if len(modules) == 1 and not any(old == self.old for old, _ in RENAMED):
            self.real_spec = modules[0].__spec__  # the import system sets it; put it back after
            return modules[0]
        self.real_spec = None
        merged = types.ModuleType(spec.name, f"The old {spec.name}: the names of {modules}.")
        names = []
        for module in modules:
            for name in module.__all__:
                setattr(merged, name, getattr(module, name))
                names.append(name)
        for (old, name), (where, new) in RENAMED.items():
            if old == self.old:
                setattr(merged, name, getattr(importlib.import_module(_full(where)), new))
                names.append(name)
        merged.__all__ = names
        return merged

    def exec_module(self, module) -> None:
        if self.real_spec is not None:  # the new module keeps its own name and spec
            module.__spec__, module.__loader__ = self.real_spec, self.real_spec.loader


class _OldModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``dmlbook.advanced.<old flat module>`` for :class:`_OldModuleLoader`."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, old = fullname.rpartition(".")
        if package != __name__ or old not in OLD_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, _OldModuleLoader(old))


if not any(isinstance(f, _OldModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_OldModuleFinder())
