"""Pipeline stages: which decoder layers, the embedding (E) and the loss (L) each stage holds.

    --pipeline-model-parallel-layout "Et|(tt|)*2,ttL"   megatron-core's own layout string
    --decoder-first-pipeline-num-layers 3               uneven first (and/or last) stage
    --num-virtual-stages-per-pipeline-rank 2            interleaved 1F1B: 2 model chunks per rank

Megatron-LM's flags, with its meanings. megatron-core builds each stage itself from the
TransformerConfig fields Megatron-LM fills from them (pipeline_model_parallel_layout,
num_layers_in_first/last_pipeline_stage, virtual_pipeline_model_parallel_size); this module
checks the flags first, on every rank and before any communication, with one line naming the
flag where megatron-core would assert (or build a stage its schedule cannot run), and works out
the same placement for the start-up log and the checkpoints' record of the layout.
tests/test_units.py checks that placement against megatron-core's own get_num_layers_to_build
and get_transformer_layer_offset.

A layout string lists the P x V model chunks in megatron's order: virtual stage 0 of pipeline
ranks 0..P-1, then virtual stage 1, ...; chunk c runs on rank c mod P. E must open the first
chunk and L close the last one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

from parm_trainer.layer_pattern import moe_layer_pattern
from parm_trainer.errors import LayoutError

LAYOUT = "--pipeline-model-parallel-layout"
FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
VIRTUAL = "--num-virtual-stages-per-pipeline-rank"
LAYERS_PER_VIRTUAL = "--num-layers-per-virtual-pipeline-stage"
PP = "--pipeline-model-parallel-size"


@dataclass(frozen=True)
class Chunk:
    """What pipeline rank `rank` builds as its virtual stage `virtual`."""
    rank: int
    virtual: int
    layers: tuple  # decoder layers, 0-based
    embedding: bool = False
    loss: bool = False
    mtp: int = 0  # multi-token prediction layers (the last chunk's, before the loss)

    @property
    def code(self) -> str:
        """This chunk in megatron's letters: E, one t per decoder layer, one m per MTP
        layer, L."""
        return ("E" * self.embedding + "t" * len(self.layers) + "m" * self.mtp
                + "L" * self.loss)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise LayoutError(message)


STAGE_FLAGS = ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "num_virtual_stages_per_pipeline_rank",
               "num_layers_per_virtual_pipeline_stage")


def _flags(args) -> dict:
    return {name: getattr(args, name, None) for name in STAGE_FLAGS}


def check_pipeline(args: argparse.Namespace) -> None:
    """Check the stage flags against the model and PP; set args.pipeline_stages (the placement
    as a plain layout string, every stage spelt out; None while the layout is still `auto`) and
    args.virtual_pipeline_model_parallel_size (V, or None without interleaving, as megatron-core
    wants it)."""
    f = _flags(args)
    layout, first, last = (f["pipeline_model_parallel_layout"],
                           f["decoder_first_pipeline_num_layers"],
                           f["decoder_last_pipeline_num_layers"])
    virtual, per_virtual = (f["num_virtual_stages_per_pipeline_rank"],
                            f["num_layers_per_virtual_pipeline_stage"])
    pp = args.pipeline_model_parallel_size
    given = [flag for flag, value in ((LAYOUT, layout), (VIRTUAL, virtual),
                                      (LAYERS_PER_VIRTUAL, per_virtual)) if value is not None]
    # Megatron-LM: at most one of the three, except that `auto` is told V by the other
    _require(len(given) <= 1 or (given == [LAYOUT, VIRTUAL] and layout == "auto"),
             f"{' and '.join(given)} exclude each other: a layout string gives the virtual "
             f"stages itself (its stages / {PP})")
    for flag, value in ((FIRST, first), (LAST, last)):
        _require(value is None or layout is None,
                 f"{flag} and {LAYOUT} exclude each other (the layout places every layer)")
        _require(value is None or value >= 1, f"{flag} must be at least 1, got {value}")
        _require(value is None or pp > 1, f"{flag} needs {PP} > 1")
    for flag, value in ((VIRTUAL, virtual), (LAYERS_PER_VIRTUAL, per_virtual)):
        _require(value is None or value >= 1, f"{flag} must be at least 1, got {value}")
    _require(per_virtual is None or (first is None and last is None),
             f"{LAYERS_PER_VIRTUAL} cannot be used with uneven first or last stages; give "
             f"{VIRTUAL} instead")
    if layout == "auto":
        args.pipeline_stages = None
        args.virtual_pipeline_model_parallel_size = virtual if (virtual or 1) > 1 else None
        return
    chunks = (_from_layout(layout, args) if layout is not None else
              _split(args, first, last, virtual, per_virtual))
    stages_per_rank = len(chunks) // pp
    args.pipeline_stages = layout_string(chunks)
    args.virtual_pipeline_model_parallel_size = stages_per_rank if stages_per_rank > 1 else None
    if stages_per_rank > 1:
        where = LAYOUT if layout is not None else VIRTUAL if virtual else LAYERS_PER_VIRTUAL
        _require(pp > 1, f"{where}: {stages_per_rank} virtual stages per rank (interleaving) "
                         f"need {PP} > 1")
        _require(pp > 2 or getattr(args, "overlap_p2p_comm", True),
                 f"{where} with --no-overlap-p2p-communication needs {PP} > 2: with two "
                 f"ranks, batched sends both ways between them mix up (Megatron-LM's rule)")


def _from_layout(layout: str, args) -> list:
    """The chunks a layout string names, or a refusal saying what does not fit."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout

    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    shown = f"{LAYOUT} {layout!r}"
    try:
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except (AssertionError, ValueError, OverflowError, MemoryError) as error:
        bad = str(error).split(" (")[0]
        raise LayoutError(f"{shown}: {bad}; use E (embedding), t (decoder layer), L (loss), "
                          f"| between stages, (...)*n and x*n to repeat") from None
    codes = ["".join(_LETTER[kind.name] for kind in stage) for stage in stages]
    flat = "".join(codes)
    _require(len(codes) % pp == 0,
             f"{shown} has {len(codes)} stages, not a multiple of {PP} {pp}")
    _require(flat.count("t") == layers,
             f"{shown} has {flat.count('t')} decoder layers (t), --num-layers is {layers}")
    _require(flat.count("E") == 1 and codes[0].startswith("E"),
             f"{shown}: E (the embedding) must come first in the first stage, once")
    _require(flat.count("L") == 1 and codes[-1].endswith("L"),
             f"{shown}: L (the loss) must come last in the last stage, once")
    mtp = getattr(args, "mtp_num_layers", None) or 0
    # megatron-core places them on any stage after the decoder; this stack, as its default
    # placement, on the last one (their embedding copy's gradient is then the loss stage's)
    _require(flat.count("m") == mtp and codes[-1].endswith("m" * mtp + "L"),
             f"{shown} has {flat.count('m')} multi-token prediction layers (m); with "
             f"--mtp-num-layers {mtp or 'none'} put {mtp} m right before L in the last stage")
    for index, code in enumerate(codes):
        # megatron builds an empty stage, but it would hold a rank only to pass activations on
        _require(bool(code), f"{shown}: stage {index} is empty; every stage needs a decoder "
                             f"layer, E or L")
    return chunks_of("|".join(codes), pp)


_LETTER = {"embedding": "E", "decoder": "t", "loss": "L", "mtp": "m"}


def _split(args, first, last, virtual, per_virtual) -> list:
    """megatron-core's placement without a layout string: --decoder-first/last-pipeline-num-
    layers on the end stages, the other layers split evenly over the others, each rank's
    layers in V equal chunks laid out virtual stage after virtual stage."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    ends = [n for n in (first, last) if n is not None]
    middle_stages, middle_layers = pp - len(ends), layers - sum(ends)
    if ends:
        named = " + ".join(f"{flag} {n}" for flag, n in ((FIRST, first), (LAST, last))
                           if n is not None)
        _require(middle_layers >= 0, f"{named} add up to more than --num-layers {layers}")
        others = f"{middle_stages} other stage{'s' * (middle_stages > 1)} of {PP} {pp}"
        _require(middle_layers >= middle_stages and (middle_layers == 0) == (middle_stages == 0),
                 f"{named} leave {middle_layers} of --num-layers {layers} for the {others}: "
                 f"each stage needs at least one layer" if middle_stages else
                 f"{named} leave {middle_layers} of --num-layers {layers} for no other stage "
                 f"({PP} {pp})")
        _require(middle_stages == 0 or middle_layers % middle_stages == 0,
                 f"{named} leave {middle_layers} of --num-layers {layers}, not divisible by the "
                 f"{others}")
    else:
        _require(layers % pp == 0, f"--num-layers {layers} is not divisible by {PP} {pp} "
                                   f"(or give {FIRST}/{LAST} or {LAYOUT})")
    even = middle_layers // middle_stages if middle_stages else 0
    counts = [even] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if per_virtual is not None:
        _require(counts[0] % per_virtual == 0,
                 f"{LAYERS_PER_VIRTUAL} {per_virtual} does not divide the {counts[0]} layers "
                 f"of each pipeline stage")
        virtual = counts[0] // per_virtual
    virtual = virtual or 1
    for rank, count in enumerate(counts):
        what = (FIRST if rank == 0 and first is not None else
                LAST if rank == pp - 1 and last is not None else "each stage's layers")
        _require(count % virtual == 0,
                 f"{VIRTUAL} {virtual} does not divide {what} ({count}, layers per stage on "
                 f"rank {rank})")
    chunks, next_layer = [], 0
    for v in range(virtual):
        for rank in range(pp):
            size = counts[rank] // virtual
            chunks.append(Chunk(rank, v, tuple(range(next_layer, next_layer + size)),
                                embedding=rank == 0 and v == 0,
                                loss=rank == pp - 1 and v == virtual - 1,
                                mtp=(getattr(args, "mtp_num_layers", None) or 0)
                                * (rank == pp - 1 and v == virtual - 1)))
            next_layer += size
    return chunks


def check_interleaved_batch(args) -> None:
    """megatron's interleaved schedule runs the micro-batches in groups of P
    (microbatch_group_size_per_vp_stage) and refuses a count that is not a multiple of P."""
    if args.virtual_pipeline_model_parallel_size is None:
        return
    pp, micro = args.pipeline_model_parallel_size, args.num_microbatches
    _require(micro % pp == 0,
             f"the interleaved schedule ({args.virtual_pipeline_model_parallel_size} virtual "
             f"stages per rank) needs the micro-batches per iteration ({micro} = "
             f"--global-batch-size {args.global_batch_size} / (--micro-batch-size "
             f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size})) to be a "
             f"multiple of {PP} {pp}")


def layout_string(chunks: list) -> str:
    """megatron-core's pipeline_model_parallel_layout for the placement."""
    return "|".join(chunk.code for chunk in chunks)


def chunks_of(stages: str, pp: int) -> list:
    """The chunks of a plain layout string (args.pipeline_stages: no repetitions)."""
    chunks, next_layer = [], 0
    for index, code in enumerate(stages.split("|")):
        count = code.count("t")
        chunks.append(Chunk(index % pp, index // pp, tuple(range(next_layer, next_layer + count)),
                            "E" in code, "L" in code, code.count("m")))
        next_layer += count
    return chunks


def recorded_stages(args) -> Optional[str]:
    """The placement as a checkpoint records it: its layout string, or None where it is
    megatron's even split (so a default run's layout reads as before)."""
    stages = getattr(args, "pipeline_stages", None)
    if not stages or "|" not in stages:
        return None
    even = argparse.Namespace(pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              num_layers=args.num_layers,
                              mtp_num_layers=getattr(args, "mtp_num_layers", None))
    try:
        default = layout_string(_split(even, None, None, None, None))
    except LayoutError:
        default = None
    return None if stages == default else stages


def _layer_kinds(args) -> list:
    if not args.num_experts:
        return ["dense"] * args.num_layers
    return ["MoE" if moe else "dense"
            for moe in moe_layer_pattern(args.moe_layer_freq, args.num_layers)]


def describe(args) -> list:
    """Lines for the start-up log: the layout string, then each chunk's embedding, decoder
    layers (1-based, as megatron numbers them, MoE or dense) and loss."""
    chunks = chunks_of(args.pipeline_stages, args.pipeline_model_parallel_size)
    virtual = args.virtual_pipeline_model_parallel_size or 1
    kinds = _layer_kinds(args)
    lines = [f"pipeline layout {args.pipeline_stages} ({args.pipeline_model_parallel_size} "
             f"stages" + (f" x {virtual} virtual stages per rank, interleaved 1F1B)"
                          if virtual > 1 else ")")]
    for chunk in sorted(chunks, key=lambda c: (c.rank, c.virtual)):
        parts = ["embedding"] if chunk.embedding else []
        if chunk.layers:
            first, last = chunk.layers[0] + 1, chunk.layers[-1] + 1
            span = f"layer {first}" if first == last else f"layers {first}-{last}"
            parts.append(f"{span} ({', '.join(kinds[i] for i in chunk.layers)})")
        parts += [f"{chunk.mtp} MTP layer{'s' * (chunk.mtp > 1)}"] if chunk.mtp else []
        parts += ["loss"] if chunk.loss else []
        where = f"PP rank {chunk.rank}" + (f", virtual stage {chunk.virtual}" if virtual > 1
                                           else "")
        lines.append(f"  {where}: {', '.join(parts) or 'nothing'}")
    return lines


def resolve_auto(args, log: Callable[[str], None]) -> None:
    """--pipeline-model-parallel-layout auto: the stage builder's layout string
    (parm_trainer.planning.stages.auto_layout), checked like one given by hand."""
    if getattr(args, "pipeline_model_parallel_layout", None) != "auto":
        return
    from parm_trainer.planning.stages import NoSplitFits, auto_layout

    try:
        layout = auto_layout(args, log=log)
    except NoSplitFits as error:
        raise LayoutError(f"{LAYOUT} auto: {error}") from None
    wanted = args.virtual_pipeline_model_parallel_size
    args.pipeline_model_parallel_layout, args.num_virtual_stages_per_pipeline_rank = layout, None
    try:
        check_pipeline(args)
    except LayoutError as error:
        raise LayoutError(f"{LAYOUT} auto chose {layout!r}, which does not fit: {error}") from None
    _require(args.virtual_pipeline_model_parallel_size == wanted,
             f"{LAYOUT} auto chose {layout!r}, with {args.virtual_pipeline_model_parallel_size or 1} "
             f"virtual stages per rank; {VIRTUAL} asked for {wanted or 1}")
    check_interleaved_batch(args)
