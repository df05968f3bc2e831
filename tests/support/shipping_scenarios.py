"""Run as a script by tests/unit/runtime/test_shipping.py, under a chosen cloudpickle: rank
functions defined in a notebook cell, a nested closure, a module shipped by value and this script
fail or hang, and the script prints, as JSON, what the caller's errors say about where.

Every check is a source line that exists only where the function was defined: on disk for the
module and the script, only in the caller's linecache for the cells.
"""

import json
import linecache
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import cloudpickle

from dmlbook.launch import RankError, RankTimeoutError, run


def define_in_cell(source: str, number: int) -> dict:
    """Compile ``source`` as ipykernel does a cell: a made-up file name, lines in linecache only."""
    name = f"{tempfile.gettempdir()}/ipykernel_{number}/{number:012x}.py"
    assert not Path(name).exists()
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def script_level_fn():
    import torch.distributed as dist

    return {"x": 1}[("key", dist.get_rank())]  # script line that fails on every rank


def error_text(fn, *args, timeout=30):
    try:
        run(fn, 2, *args, timeout=timeout)
    except RankError as e:
        return str(e)
    except RankTimeoutError as e:
        return "\n".join(e.stacks.values())
    return "no error"


def main() -> None:
    cell = define_in_cell(
        textwrap.dedent("""\
            import time
            import torch.distributed as dist

            def cell_fn(scale):
                return scale / (dist.get_rank() - 1)  # cell line: rank 1 divides by zero

            def make_closure(offset):
                def closure_fn():
                    return [0][dist.get_rank() + offset]  # closure line: index out of range
                return closure_fn

            def cell_hang():
                if dist.get_rank() == 0:
                    time.sleep(600)  # cell line where rank 0 hangs
                dist.barrier()
        """),
        number=7,
    )
    module_dir = Path(tempfile.mkdtemp())
    (module_dir / "shipped_module.py").write_text(
        "def module_fn():\n    raise LookupError('from a module')  # module line\n"
    )
    sys.path.insert(0, str(module_dir))
    import shipped_module

    cloudpickle.register_pickle_by_value(shipped_module)  # sent by value, as a cell's code is
    sys.path.remove(str(module_dir))  # ... and the ranks could not import it anyway
    report = {
        "cloudpickle": cloudpickle.__version__,
        "cell": error_text(cell["cell_fn"], 2.0),
        "closure": error_text(cell["make_closure"](5)),
        "module": error_text(shipped_module.module_fn),
        "script": error_text(script_level_fn),
        "hang": error_text(cell["cell_hang"], timeout=4),
    }
    shutil.rmtree(module_dir)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
