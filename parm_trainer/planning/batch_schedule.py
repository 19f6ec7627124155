"""The global batch size iteration by iteration, as Megatron-LM schedules it: constant, or
ramped up (--rampup-batch-size START INCREMENT SAMPLES) by megatron-core's own
num_microbatches_calculator, read at each iteration from the samples consumed so far.

    problem(args)          what is wrong with a ramp-up under this layout (one line, or None)
    train_iters(args)      the iterations --train-samples gives (Megatron-LM's update_train_iters)
    planned_samples(args)  the training samples the run's --train-iters iterations take
    start(args, rank)      megatron-core's calculator for this process, for the training loop

args.global_batch_size and args.num_microbatches stay the full (final) sizes, as Megatron-LM
keeps them: evaluation and the start-up estimates use those; the training loop asks the
calculator (get_current_global_batch_size, get_num_microbatches) after
update_num_microbatches(consumed samples) at the start of each iteration.
"""

from __future__ import annotations

from typing import Iterator, Optional


def problem(args) -> Optional[str]:
    """What megatron-core's ramp-up calculator would assert, divide by zero on, or refuse
    mid-run (its consistency check at the iteration a size is reached), checked up front:
    every size START + k * INCREMENT up to --global-batch-size must be whole micro-batches on
    every data-parallel rank, which holds for all k exactly when it holds for START and
    INCREMENT (the interleaved schedule also wants a multiple of PP micro-batches)."""
    if getattr(args, "rampup_batch_size", None) is None:
        return None
    start, increment, _ = args.rampup_batch_size
    full = args.global_batch_size
    if start >= full:  # equal: megatron-core divides by zero increments
        return (f"--rampup-batch-size starts at {start}, which must be smaller than "
                f"--global-batch-size {full}")
    if (full - start) % increment:
        return (f"--rampup-batch-size increment {increment} does not divide --global-batch-size "
                f"{full} - start {start} = {full - start}")
    per_step = args.micro_batch_size * args.data_parallel_size
    pp = args.pipeline_model_parallel_size
    interleaved = getattr(args, "virtual_pipeline_model_parallel_size", None) is not None
    for name, size in (("start", start), ("increment", increment)):
        if size % per_step:
            return (f"--rampup-batch-size {name} {size} is not divisible by --micro-batch-size "
                    f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}")
        if interleaved and (size // per_step) % pp:
            return (f"the interleaved schedule needs the micro-batches of every iteration to be "
                    f"a multiple of --pipeline-model-parallel-size {pp}: --rampup-batch-size "
                    f"{name} {size} is {size // per_step} (--micro-batch-size "
                    f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size})")
    return None


def _batch_sizes(args) -> Iterator[int]:
    """Each iteration's global batch size from the first on, endlessly: from a calculator of
    its own (megatron-core's class, as the run's will be built), so that the process-wide one
    the loop reads is left alone."""
    if args.rampup_batch_size is None:
        while True:
            yield args.global_batch_size
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    ramp = RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False,
        -1, *args.rampup_batch_size)  # rank -1: megatron-core logs its changes on rank 0 only
    consumed = 0
    while True:
        ramp.update(consumed, consistency_check=False)
        size = ramp.get_current_global_batch_size()
        yield size
        consumed += size


def train_iters(args) -> int:
    """The iterations --train-samples gives, counted as Megatron-LM's update_train_iters
    counts them: during the ramp-up, iterations while the samples consumed before each are
    at most both the ramp-up's samples and --train-samples (so the last of them may take the
    run past --train-samples); after it, whole global batches within --train-samples."""
    full, samples = args.global_batch_size, args.train_samples
    if args.rampup_batch_size is None:
        return samples // full
    ramp_samples = args.rampup_batch_size[2]
    iterations = consumed = 0
    sizes = _batch_sizes(args)
    while consumed <= min(ramp_samples, samples):
        consumed += next(sizes)
        iterations += 1
    return iterations + max(0, samples - consumed) // full


def planned_samples(args) -> int:
    """The training samples the run's args.train_iters iterations consume: what the training
    dataset must hold at least (sample-based training may pass --train-samples by the last
    ramp-up iteration, see train_iters)."""
    total = 0
    for done, size in enumerate(_batch_sizes(args)):
        if done == args.train_iters:
            return total
        if size == args.global_batch_size:  # ramped up (or never ramping): constant from here
            return total + (args.train_iters - done) * size
        total += size


def start(args, rank: int) -> None:
    """megatron-core's process-wide calculator, as Megatron-LM's initialisation builds it
    (built anew where one process trains twice, as the tests do)."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)

    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, args.rampup_batch_size, args.global_batch_size,
                                     args.micro_batch_size, args.data_parallel_size)
