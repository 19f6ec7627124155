"""Start-up shared by the entry scripts: flags, checks, CPU compatibility, process groups (the
one-line errors for bad input, and the flag checks the entry scripts make first: user_errors.py).

Checks that need no communication (layout, files) run before torch.distributed starts, on every
rank, so bad input ends every rank at once instead of hanging in a collective.
--pipeline-model-parallel-layout auto with no cost profile is split twice: before, priced by
the built-in profile (a split that cannot fit the memory limit is refused there), and, once the
groups exist and the MoE schedule is settled, by the model's pieces measured on them
(schedule/layer_times.py): that split is the run's.
"""

from __future__ import annotations

import os

from parm_trainer.arguments import parse_args
from parm_trainer.compat import cpu, cpu_allocator
from parm_trainer.data import input_files
from parm_trainer.data.tokenizer import tokenizer_from_args
from parm_trainer.errors import InputError, LayoutError
from parm_trainer.models.config import padded_vocab_size
from parm_trainer.parallel import initialize_distributed, record_stages
from parm_trainer.planning import layout as pipeline_layout
from parm_trainer.planning import recompute_choice
from parm_trainer.planning.checks import validate_layout
from parm_trainer.schedule import layer_times
from parm_trainer.schedule.auto import resolve_auto_schedule
from parm_trainer.schedule.tune import tune_at_startup
from parm_trainer.training import checkpoint_args, faults
from parm_trainer.training.user_errors import rank as _rank




def _check_inputs(args) -> None:
    """check_flags_first's file checks again (a run with --use-checkpoint-args skipped them),
    then each data set's index as megatron-core reads it and --load's tracker."""
    input_files.check_inputs(args)
    from parm_trainer.data.gpt_datasets import check_indexed_dataset, parse_data_path

    prefixes, _ = parse_data_path(args.data_path) if args.data_path else ([], None)
    for prefix in prefixes:  # corrupt or truncated files fail here, on every rank
        check_indexed_dataset(prefix)
    if args.load and os.path.isdir(args.load):
        from parm_trainer.training.checkpoint.files import CheckpointError, read_tracker

        try:  # now, on every rank alike, rather than after the model is built
            read_tracker(args.load)
        except CheckpointError as error:
            raise InputError(f"--load {args.load}: {error}") from None


def initialize(argv=None, extra_args_provider=None, check_inputs=None):
    """Parse flags, check them, build the tokenizer (args.tokenizer, args.padded_vocab_size),
    apply the CPU layer if needed, start the process groups. check_inputs(args): the entry
    point's own checks, run with the tokenizer built and before any communication."""
    args = parse_args(argv, extra_args_provider, override=checkpoint_args.apply)
    for line in args.start_notes:  # Megatron-LM flags with no effect here, and the like
        _print_rank_0(line)
    faults.configure()
    resolve_auto_schedule(args, log=_print_rank_0)
    validate_layout(args)
    _check_inputs(args)
    args.tokenizer = tokenizer_from_args(args)
    args.padded_vocab_size = padded_vocab_size(args.tokenizer.vocab_size,
                                               args.tensor_model_parallel_size,
                                               args.make_vocab_size_divisible_by)
    measured = layer_times.wanted(args)  # auto stages priced by measured pieces, later
    if measured:  # a split priced by the profile for now: one that cannot fit ends here
        wanted = args.num_virtual_stages_per_pipeline_rank
        given = {name: getattr(args, name, None) for name in recompute_choice.FIELDS}
        pipeline_layout.resolve_auto(args, lambda line: None)
        vars(args).update(given)  # a recompute it chose is chosen again, on measured prices
    else:
        _settle_stages(args)
    if check_inputs is not None:
        check_inputs(args)
    cpu.apply()
    cpu_allocator.tune()
    initialize_distributed(args, stages=pipeline_layout.recorded_stages(args))
    _report_modules(args)
    _report_relay()
    _report_groups(args)
    tune_at_startup(args, log=_print_rank_0)
    if measured:  # the pieces measured on the groups, with the MoE schedule settled
        args.layer_times = layer_times.measured_layer_times(args, log=_print_rank_0)
        args.pipeline_model_parallel_layout = "auto"
        args.num_virtual_stages_per_pipeline_rank = wanted
        pipeline_layout.check_pipeline(args)
        _settle_stages(args)
        record_stages(pipeline_layout.recorded_stages(args))
    return args


def _settle_stages(args) -> None:
    """--pipeline-model-parallel-layout auto's split (needs the vocabulary's size), the stages'
    lines, the memory estimate."""
    pipeline_layout.resolve_auto(args, _print_rank_0)
    if args.pipeline_model_parallel_size > 1:
        for line in pipeline_layout.describe(args):
            _print_rank_0(line)
    report_memory(args)


def _report_modules(args) -> None:
    if _rank() == 0:
        from parm_trainer.models.config import transformer_config
        from parm_trainer.models.gpt import describe_modules

        _print_rank_0(describe_modules(args, transformer_config(args)))


def _report_relay() -> None:
    from parm_trainer import node_relay

    relay = node_relay.current()
    if relay is not None:
        _print_rank_0(f"MoE exchange relayed through {relay.nodes} nodes of {relay.per_node} EP "
                      f"ranks ({node_relay.ranks_per_node()} ranks per node): each token crosses"
                      " the node link once per destination node (--moe-parm-exchange direct: "
                      "one hop to each EP rank)")


def _report_groups(args) -> None:
    from parm_trainer import node_relay

    note = node_relay.group_limit_note(args, node_relay.ranks_per_node())
    if note is not None:
        _print_rank_0(note)


def report_memory(args) -> None:
    """The start-up memory estimate per pipeline rank (args.memory_estimate:
    memory_estimate.estimate's entries), checked against --memory-gb on every rank before any
    communication."""
    from parm_trainer.moe.cost_profile import load_profile, profile_source
    from parm_trainer.planning.memory_estimate import describe, describe_times, estimate

    profile = load_profile(args)
    ranks, iteration_s = estimate(args, profile)
    for line in describe(ranks):
        _print_rank_0(line)
    _print_rank_0(describe_times(ranks, iteration_s, profile_source(args, profile)))
    args.memory_estimate = ranks
    if args.memory_gb:
        worst = max(range(len(ranks)), key=lambda r: ranks[r]["total"])
        need = ranks[worst]["total"] / 2**30
        if need > args.memory_gb:
            raise LayoutError(
                f"--memory-gb {args.memory_gb:g}: this layout needs an estimated {need:.2f} GiB "
                f"on pipeline rank {worst} (see the memory estimate above); use more model, "
                "expert or pipeline parallelism, a smaller micro-batch, "
                "--use-distributed-optimizer, or --pipeline-model-parallel-layout auto")


def _print_rank_0(line: str) -> None:
    if _rank() == 0:
        print(line, flush=True)
