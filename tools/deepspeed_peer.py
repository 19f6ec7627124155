"""python -m torch.distributed.run --nproc-per-node 4 tools/deepspeed_peer.py --check

DeepSpeed's MoE layer (ep, dedup and ted modes) as a peer of Parm's schedules: checks each mode
against parm_trainer/moe/reference.py on every layout it can run, top-2 and top-1, one line per
mode and layout (parm_trainer/bench/peers/deepspeed_check.py). The adapters and their reasons
are in parm_trainer/bench/peers/deepspeed.py; bench_moe_layer runs them as its deepspeed-* rows.
Without DeepSpeed (pip install .[peers]) it says so and exits 0.
"""

from __future__ import annotations

import sys

from parm_trainer.bench.peers.deepspeed import available


def main(argv=None, leave=False) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--check"]:
        print(__doc__.split("\n\n")[1] + "\nusage: python -m torch.distributed.run "
              "--nproc-per-node 4 tools/deepspeed_peer.py --check", file=sys.stderr)
        return 2
    ok, reason = available()
    if not ok:
        print(f"deepspeed_peer --check: {reason}", flush=True)
        return 0
    from parm_trainer.bench import layout
    from parm_trainer.bench.peers.deepspeed_check import check

    status = check()
    if leave:  # skip the slow teardown of megatron's and DeepSpeed's gloo groups
        layout.leave(status)
    return status


if __name__ == "__main__":
    sys.exit(main(leave=True))
