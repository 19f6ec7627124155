"""python tools/bench_moe_layer.py --nproc 4 --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2 --num-experts 4 --moe-router-topk 2 --hidden-size 64 --moe-ffn-hidden-size 128 --seq-length 64 --micro-batch-size 2 --schedules baseline,s1,s2,megatron --iters 10 --warmup 2 --json bench.json

One MoE layer, forward and backward, under several schedules in one launch: Parm's baseline
(DeepSpeed-MoE TED), s1 and s2 (ParmMoELayer; --moe-parm-chunks R pipelines them, 0 lets the
cost model choose R), auto (the cost model's choice of s1/s2, shown as auto=s1/r4), and
megatron-core's own MoELayer: "megatron" with --moe-token-dispatcher-type, or the peers
"megatron-alltoall" and "megatron-allgather"; DeepSpeed's deepspeed-ep, deepspeed-dedup and
deepspeed-ted (pip install .[peers]). --peers megatron-alltoall,megatron-allgather,deepspeed
adds the peers after Parm's rows. --ratio-to NAME sets the ratio column's divisor.
Every row gets the same full weights and the same data, and is checked against the
single-process reference (parm_trainer/moe/reference.py); it is timed, and its collectives'
bytes are read from parm_trainer.moe.comm.LEDGER.

With --nproc N the tool starts N ranks itself (torchrun, gloo on CPU, nccl on GPU); without it,
it is one rank of a job started by torchrun (so the same tool measures multi-node layouts).

Layer: router logits = x @ gate.T; each token picks its top-k logits and its routing
probabilities are the softmax over those k logits (megatron-core's default router); expert
e(x) = fc2[e] @ gelu(fc1[e] @ x), no biases; output = sum over the chosen experts of
probability * expert(x). Load-balancing loss: megatron-core's switch aux loss, coeff * E /
(k * T^2) * sum_e count_e * sum_t softmax(logits)[t, e]; the backward objective is
sum(out * output_grad) + coeff * aux.

The harness is parm_trainer/bench/: the data and weights (weights.py), the checks
(replica.py), the timing (timing.py), the bytes (ledger.py), the JSON and table (report.py)
are described there.
"""

from __future__ import annotations

import os
import sys
import warnings

# megatron-core warns about optional GPU extensions at import and about MP without sequence
# parallelism (which concerns its own dispatcher, reported here as a skip), torch about the
# names of collectives.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|is deprecated|sequence "
                                          "parallelism must be used|Disabling sequence parallel)")

from parm_trainer.bench import flags  # noqa: E402 (torch, not megatron-core)
from parm_trainer.lazy_imports import eager_fusions_without_cuda  # noqa: E402


def main(argv=None, leave=False) -> int:
    """The tool; with leave, a rank that ran the benchmark ends its process at once (every rank
    is past the final barrier: megatron's process groups need no slow teardown)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        args = flags.parse(argv, world_size=None)
    except flags.ToolError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.nproc and not under_torchrun:
        if args.nproc < 1:
            print("error: --nproc must be at least 1", file=sys.stderr)
            return 2
        from parm_trainer.launch import relaunch

        return relaunch(__file__, argv, args.nproc)  # this process never imports megatron-core
    eager_fusions_without_cuda()  # before megatron-core is imported (lazy_imports.py)
    from parm_trainer.bench import harness, layout, report

    runs, payload = harness.run(args)
    report.emit(runs, payload, args.json)
    if leave:
        layout.leave(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(leave=True))
