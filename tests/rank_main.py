"""The end of a multi-rank test worker (tests/worker_*.py, run by conftest.run_rank_workers on
every rank): main(report) runs under a hang watch (after hang_s seconds every thread's stack goes
to stacks<R>.txt in argv[1] and the rank exits), and its report goes to rank<R>.json there, with
the traceback of what it raised."""

import faulthandler
import json
import os
import sys
import traceback


def run(main, hang_s: float) -> None:
    rank = int(os.environ["RANK"])
    stacks = open(os.path.join(sys.argv[1], f"stacks{rank}.txt"), "w")
    faulthandler.dump_traceback_later(hang_s, exit=True, file=stacks)
    report = {"rank": rank, "checks": 0, "failures": []}
    try:
        main(report)
    except Exception:
        report["failures"].append(traceback.format_exc())
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if report["failures"]:
        os._exit(1)  # the other ranks may be blocked in a collective: let torchrun stop them
    faulthandler.cancel_dump_traceback_later()
