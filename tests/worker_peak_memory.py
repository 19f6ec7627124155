"""The peak resident memory (VmHWM) of a conversion, or of the same process without one.

    python tests/worker_peak_memory.py convert MODULES -- [tools/checkpoint/convert.py flags]
    python tests/worker_peak_memory.py baseline MODULES

convert: runs tools/checkpoint/convert.py's main in this process, writes the names of the
modules it had imported to MODULES and prints `peak_kib N` (and exits with its status).
baseline: imports the modules MODULES names (the conversion's imports, done) and builds no
model, then prints `peak_kib N`. Both reset the high-water mark first (/proc/self/clear_refs),
so a process forked from one that held more starts from what it holds now.
"""

import importlib
import importlib.util
import json
import os
import re
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def main() -> int:
    mode, modules = sys.argv[1], sys.argv[2]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    warnings.filterwarnings("ignore")
    status = 0
    if mode == "convert":
        spec = importlib.util.spec_from_file_location(
            "convert_tool", os.path.join(ROOT, "tools", "checkpoint", "convert.py"))
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        status = tool.main(sys.argv[4:])
        with open(modules, "w") as f:
            json.dump([name for name in sys.modules if not name.startswith("convert_tool")], f)
    else:
        for name in json.load(open(modules)):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module only its importer can import
                pass
    print(f"peak_kib {peak_kib()}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
