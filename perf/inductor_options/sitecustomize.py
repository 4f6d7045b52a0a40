"""Sets torch._inductor options process-wide from ``TRAINBENCH_INDUCTOR_OPTIONS`` ("triton.tile_reductions=1,
coordinate_descent_tuning=1": 1 and 0 are True and False, anything else is kept as a string), so that a
measurement can compare Inductor's choices without a change to trainbench's code. Python imports it at start-up
when this folder is on PYTHONPATH: ``INDUCTOR=... perf/bench_figures.sh llm`` puts it there. It replaces any other
``sitecustomize`` of the environment for that process. Options a compiled function names itself (the decoder
blocks' ``BLOCK_COMPILE_OPTIONS``) override these while it compiles."""

import os
import sys

_OPTIONS = os.environ.get("TRAINBENCH_INDUCTOR_OPTIONS", "")
if _OPTIONS:
    import torch._inductor.config as _config

    _known = _config.get_config_copy()
    for _item in _OPTIONS.split(","):
        _key, _sep, _value = _item.partition("=")
        if not _sep or _key not in _known:
            _why = f"{_item!r} is not key=value with a key of torch._inductor.config"
            print(f"error: TRAINBENCH_INDUCTOR_OPTIONS: {_why}", file=sys.stderr, flush=True)
            os._exit(2)  # an exception here would end in the interpreter's own start-up traceback
        _config.patch({_key: {"1": True, "0": False}.get(_value, _value)}).__enter__()
    print(f"torch._inductor options set for this process: {_OPTIONS}", file=sys.stderr, flush=True)
