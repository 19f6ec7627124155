"""Activation recomputation: Megatron-LM's flags (megatron-core's TransformerConfig fields of the
same names, core_v0.16.1) and their checks, each problem one line.

    --recompute-granularity full      every layer's input kept, the layer recomputed in the
                                      backward (--recompute-method, --recompute-num-layers)
    --recompute-granularity selective the submodules of --recompute-modules recomputed
    --recompute-activations           Megatron-LM's short form of granularity selective
    --moe-layer-recompute             Megatron-LM's deprecated form of selective + "moe"

Under Parm's schedules "moe" keeps what the exchange received and recomputes only the local
experts (docs/exchange.md, "Recomputation"); under --moe-parm-schedule megatron it is
megatron-core's module recompute, which repeats the exchange.
"""

from __future__ import annotations

from typing import Optional

# megatron-core's recompute_modules choices, in its order
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def add_flags(parser) -> None:
    g = parser.add_argument_group("activation recomputation (Megatron-LM's flags)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: keep each recomputed layer's input and recompute the layer in "
                        "the backward; selective: recompute the submodules of "
                        "--recompute-modules (default: nothing recomputed).")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="With granularity full: uniform recomputes every layer of a pipeline "
                        "stage in units of --recompute-num-layers layers; block recomputes the "
                        "first --recompute-num-layers layers of each stage (model chunk).")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="Layers per recomputed unit (uniform) or recomputed per stage (block).")
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help=f"With granularity selective: the submodules recomputed, of "
                        f"{', '.join(MODULES)} (default core_attn). moe under Parm's schedules "
                        "recomputes the experts from the tokens the exchange received, without "
                        "exchanging them again; under --moe-parm-schedule megatron, the whole "
                        "MoE layer, its exchange included.")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's short form of --recompute-granularity selective.")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Megatron-LM's (deprecated) form of --recompute-granularity selective "
                        "with moe added to --recompute-modules.")


def settle(args) -> None:
    """Megatron-LM's rewrites: --recompute-activations is granularity selective (arguments.py);
    --moe-layer-recompute adds moe to the modules (TransformerConfig.__post_init__), which
    default to core_attn. Run after problem()."""
    if getattr(args, "recompute_activations", False):
        args.recompute_granularity = "selective"
    if args.recompute_modules is None:
        args.recompute_modules = ["core_attn"]
    if args.moe_layer_recompute:
        args.recompute_granularity = "selective"
        if "moe" not in args.recompute_modules:
            args.recompute_modules = [*args.recompute_modules, "moe"]


def problem(args) -> Optional[str]:
    """The first impossible recompute setting, as one line (Megatron-LM's validate_args and
    megatron-core's TransformerConfig checks); None if none."""
    granularity = args.recompute_granularity
    if granularity is None and (args.moe_layer_recompute
                                or getattr(args, "recompute_activations", False)):
        granularity = "selective"
    method, layers, modules = (args.recompute_method, args.recompute_num_layers,
                               args.recompute_modules)
    if args.moe_layer_recompute and granularity == "full":
        return ("--moe-layer-recompute with --recompute-granularity full: the full "
                "recompute already recomputes the MoE layers; give one of them")
    if method is not None and granularity != "full":
        return (f"--recompute-method {method} needs --recompute-granularity full (selective "
                f"recompute takes every layer)")
    if granularity == "full":
        if method is None:
            return ("--recompute-granularity full needs --recompute-method uniform or block")
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        if layers is None or not 1 <= layers <= per_stage:
            given = "is missing" if layers is None else f"{layers} is out of range"
            return (f"--recompute-num-layers {given}: with --recompute-granularity full it "
                    f"must be between 1 and the layers per pipeline stage, {per_stage}")
    elif layers is not None:
        return (f"--recompute-num-layers {layers} needs --recompute-granularity full "
                f"(selective recompute takes every layer)")
    unknown = [m for m in modules or () if m not in MODULES]
    if unknown:
        return (f"--recompute-modules {' '.join(unknown)}: unknown; choose from "
                f"{', '.join(MODULES)}")
    if granularity != "selective" and modules is not None:
        return ("--recompute-modules needs --recompute-granularity selective (full recompute "
                "recomputes whole layers)")
    return _modules_problem(args, modules or ())


def _modules_problem(args, modules) -> Optional[str]:
    if "moe_act" in modules and not getattr(args, "moe_grouped_gemm", False):
        return ("--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core recomputes "
                "the activation of its grouped experts only)")
    if "mla_up_proj" in modules and not getattr(args, "multi_latent_attention", False):
        return ("--recompute-modules mla_up_proj needs multi-latent attention "
                "(--multi-latent-attention), as in megatron-core")
    if "mla_up_proj" in modules:
        return ("--recompute-modules mla_up_proj is not built yet for this stack's multi-latent "
                "attention; leave it out (core_attn recomputes the attention itself)")
    if ("shared_experts" in modules and args.moe_shared_expert_intermediate_size is not None
            and args.moe_shared_expert_overlap):
        return ("--recompute-modules shared_experts cannot work with "
                "--moe-shared-expert-overlap (as in megatron-core); leave one out")
    return None
