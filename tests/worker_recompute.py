"""Rank worker of tests/test_recompute.py: one training run per case, in this process.

argv[1]/cases.json: {"runs": [{"name", "model": "gpt"|"bert", "argv": [...]}]}. Each run is the
entry point's own start-up (parm_trainer.training.initialize) and Trainer on its flags, the
process groups reset between runs, and reports per run: each iteration's lm loss and grad
norm and seconds, the peak bytes of saved activations over the first iteration (memory_probe's
SavedActivations) and the start-up estimate of them (planning/memory_estimate.py), the bytes the MoE layers' collectives sent per iteration (Parm's ledger,
comm.LEDGER), and the bytes of every all_to_all_single over the expert-parallel group (the
EP exchange of Parm's layer and of megatron-core's alltoall dispatcher alike); and what the
start-up chose (the recompute fields and stages, its "--memory-gb" log lines) and this rank's
parameter, gradient and optimizer bytes (memory_probe.state_bytes).
"""

import contextlib
import functools
import io
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the entry points; rank_main

HANG_S = 900
_EP_A2A = {"bytes": 0}


class _Tee(io.StringIO):
    """Keeps what is printed and passes it on."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def write(self, text):
        self.out.write(text)
        return super().write(text)


def _count_ep_all_to_all():
    """Count the input bytes of every all_to_all_single over the EP group (installed once)."""
    from megatron.core import parallel_state

    original = torch.distributed.all_to_all_single

    def counted(output, input, *args, **kwargs):
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        if (parallel_state.model_parallel_is_initialized()
                and group is parallel_state.get_expert_model_parallel_group()):
            _EP_A2A["bytes"] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)

    torch.distributed.all_to_all_single = counted


def _train(run, entries):
    from parm_trainer.moe.comm import LEDGER
    from parm_trainer.parallel import reset_model_parallel
    from parm_trainer.training import watchdog
    from parm_trainer.training.initialize import initialize
    from parm_trainer.training.loop import Trainer
    from parm_trainer.training.memory_probe import SavedActivations, state_bytes

    entry, bert = entries[run["model"]], run["model"] == "bert"
    extra = (entry.add_bert_args, entry.check_bert_inputs) if bert else ()
    said = _Tee(sys.stdout)
    with contextlib.redirect_stdout(said):
        args = initialize(run["argv"], *extra)
    forward_step, names = entry.forward_step, ("lm loss",)
    if bert:
        forward_step = functools.partial(forward_step, binary_head=args.bert_binary_head)
        names = ("lm loss", "sop loss") if args.bert_binary_head else names
    seen = {"lm loss": [], "grad norm": [], "peak": None, "seconds": []}

    class Recording(Trainer):
        def train_step(self, iterator, report_moe=True):
            start = time.perf_counter()
            probe = SavedActivations(self.model) if seen["peak"] is None else None
            if probe is not None:
                with probe:
                    metrics = super().train_step(iterator, report_moe)
                seen["peak"] = probe.peak_bytes
            else:
                metrics = super().train_step(iterator, report_moe)
            seen["seconds"].append(time.perf_counter() - start)
            for name in ("lm loss", "grad norm"):
                seen[name].append(float(metrics[name]))
            return metrics

    LEDGER.reset()
    _EP_A2A["bytes"] = 0
    trainer = Recording(args, entry.model_provider, entry.datasets_provider, forward_step, names)
    trainer.train()
    iterations = len(seen["lm loss"])
    from megatron.core import parallel_state

    stage = parallel_state.get_pipeline_model_parallel_rank()
    seen["estimate"] = args.memory_estimate[stage]["activations"]  # the start-up estimate
    seen["ledger"] = {key: row["sent"] / iterations
                      for key, row in LEDGER.totals(per_phase=True).items()}
    seen["ep_a2a"] = _EP_A2A["bytes"] / iterations
    seen["state"] = sum(state_bytes(trainer.model, trainer.optimizer))
    seen["recompute"] = [getattr(args, f"recompute_{name}")
                         for name in ("granularity", "method", "num_layers", "modules")]
    seen["stages"] = args.pipeline_stages
    seen["said"] = [line for line in said.getvalue().splitlines()
                    if line.startswith("--memory-gb")]
    watchdog.stop()
    del trainer
    torch.distributed.barrier()
    reset_model_parallel()
    return seen


def main(report):
    import importlib

    cases = json.loads((Path(sys.argv[1]) / "cases.json").read_text())
    entries = {"gpt": importlib.import_module("pretrain_gpt_moe"),
               "bert": importlib.import_module("pretrain_bert_moe")}
    _count_ep_all_to_all()
    runs = report["runs"] = {}
    for run in cases["runs"]:
        runs[run["name"]] = _train(run, entries)
        report["checks"] += 1


if __name__ == "__main__":
    import rank_main

    rank_main.run(main, HANG_S)
