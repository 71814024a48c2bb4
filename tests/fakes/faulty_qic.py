"""A FAKE `qic` for fault-injection tests: the real CLI with faults patched in from FAULTY_* variables, so that
qic itself reads no test hooks from anyone's environment.

    FAULTY_SHARD_DELAY=S     pause S seconds after each checkpoint tensor the shard stage reads
    FAULTY_FAIL_GRAPH=NAME   a graph whose name contains NAME fails after compiling, before it is sealed

Run it as `python tests/fakes/faulty_qic.py ARGS...` (one process: `qic warm --jobs 1`, `qic build`).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import qic.builder.compile as compile_stage  # noqa: E402
import qic.builder.shard as shard_stage  # noqa: E402
from qic.cli import main  # noqa: E402

delay = float(os.environ.get("FAULTY_SHARD_DELAY", "0"))
if delay:
    real_merge = shard_stage.merge

    def slow_merge(*args, **kwargs):
        out = real_merge(*args, **kwargs)
        time.sleep(delay)
        return out

    shard_stage.merge = slow_merge

failing = os.environ.get("FAULTY_FAIL_GRAPH", "")
if failing:
    real_seal = compile_stage._seal

    def failing_seal(tmp, gdef, *args, **kwargs):
        if failing in gdef.name:
            raise RuntimeError(f"injected compile failure for {gdef.name} (FAULTY_FAIL_GRAPH)")
        return real_seal(tmp, gdef, *args, **kwargs)

    compile_stage._seal = failing_seal

if __name__ == "__main__":
    sys.argv[0] = "qic"
    main()
