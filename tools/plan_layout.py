"""python tools/plan_layout.py --nodes N --gpus-per-node G [--memory-gb M] [--profile P] MODEL FLAGS

Every layout of the model on that cluster (TP inside a node, EP, ESP, PP, virtual stages, DP,
the MoE schedule and depth, the stages), ranked by the whole-model cost model's predicted time
per iteration (parm_trainer/planning/); under --memory-gb per rank, a layout over it takes the
activation recomputation of least predicted time that fits (none: left out). Prints the best
--top (ms/iter, tokens/s, peak memory per rank, what most of the iteration goes to, the
recompute chosen) and the best one's flags. MODEL FLAGS are pretrain_gpt_moe.py's model and
batch flags. Prices come from --profile (tools/calibrate_comm.py on the cluster); without one,
the model's pieces (embedding, each kind of decoder layer, output layer and loss) are first
measured on this machine, one rank at TP = EP = 1, and cached
(parm_trainer/schedule/layer_times.py): their compute is priced from those seconds, scaled to
each layout, and the communication from the built-in default profile (assumed A100 figures,
not measurements); --no-measure skips the measurement. For example:

    python tools/plan_layout.py --nodes 2 --gpus-per-node 4 --profile profile.json -- \\
        --num-layers 8 --hidden-size 128 --num-attention-heads 4 --seq-length 256 \\
        --num-experts 4 --moe-layer-freq 2 --micro-batch-size 2 --global-batch-size 16
"""

from __future__ import annotations

import argparse
import json
import sys

from parm_trainer.process_exit import end
from parm_trainer.lazy_imports import eager_fusions_without_cuda

eager_fusions_without_cuda()  # as the entry points run on CPU: before megatron-core is imported

from parm_trainer.arguments import ArgumentsError, parse_args
from parm_trainer.data.tokenizer import TokenizerError, build_tokenizer
from parm_trainer.errors import ProfileError
from parm_trainer.models.config import padded_vocab_size
from parm_trainer.moe.cost_profile import DEFAULT_PROFILE, Profile
from parm_trainer.planning.search import candidates
from parm_trainer.schedule.layer_times import one_rank_layer_times


def _tokenizer_vocab(model):
    if not getattr(model, "tokenizer_model", None):
        return None
    return build_tokenizer(model.tokenizer_type, model.tokenizer_model).vocab_size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--memory-gb", type=float, default=None, help="per-rank memory limit")
    p.add_argument("--profile", default=None, help="a cost profile (calibrate_comm.py)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="before padding (default: --tokenizer-model's, else 32000)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", default=None, help="write every ranked layout here")
    p.add_argument("--flags-only", action="store_true",
                   help="print only the best layout's flags (for launchers: LAYOUT=auto)")
    p.add_argument("--no-measure", action="store_false", dest="measure",
                   help="without --profile, price the pieces' compute by the default profile "
                        "too instead of measuring them here first (one layer of each kind at "
                        "full size on one rank: seconds for a small model, slow or out of "
                        "memory for a large one; cached after the first time)")
    args, model_argv = p.parse_known_args(argv)
    model_argv = [a for a in model_argv if a != "--"]
    if args.nodes < 1 or args.gpus_per_node < 1:
        p.error("--nodes and --gpus-per-node must be at least 1")
    try:
        profile = Profile.from_json(args.profile) if args.profile else DEFAULT_PROFILE
        model = parse_args(model_argv, world_size=1)
        vocab = args.vocab_size or _tokenizer_vocab(model) or 32000
    except (ProfileError, ArgumentsError, TokenizerError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    limit = args.memory_gb * 2**30 if args.memory_gb else None
    if args.measure and not args.profile:
        model.padded_vocab_size = padded_vocab_size(vocab, 1)
        log = (lambda line: None) if args.flags_only else print
        model.layer_times = one_rank_layer_times(model, log=log)
    ranked = candidates(model, profile, args.nodes, args.gpus_per_node, vocab, limit)
    if not ranked:
        print(f"error: no layout runs this model on {args.nodes} x {args.gpus_per_node} ranks"
              + (f" within --memory-gb {args.memory_gb:g}" if limit else ""), file=sys.stderr)
        return 1
    if args.flags_only:
        print(" ".join(ranked[0].flags()))
        return 0
    priced = args.profile or ("the built-in default profile: assumed A100 figures, not this "
                              "machine's (measure them with tools/calibrate_comm.py, then "
                              "--profile)")
    if getattr(model, "layer_times", None):
        priced = f"{model.layer_times['source']} (one rank), communication from {priced}"
    print(f"{len(ranked)} layouts on {args.nodes} nodes x {args.gpus_per_node}, priced with "
          f"{priced}; the best {min(args.top, len(ranked))}:")
    print(f"{'TP':>3} {'EP':>3} {'ESP':>3} {'PP':>3} {'VP':>3} {'DP':>3} {'MoE':>8}  "
          f"{'ms/iter':>9} {'tokens/s':>10} {'MiB/rank':>9}  {'main cost':<32} "
          f"{'recompute':<20} layout")
    for c in ranked[:args.top]:
        recompute = " ".join(f for f in c.recompute if not f.startswith("--")) or "-"
        print(f"{c.tp:>3} {c.ep:>3} {c.esp:>3} {c.pp:>3} {c.vp:>3} {c.dp:>3} {c.schedule:>8}  "
              f"{c.iteration_s * 1e3:>9.2f} {c.tokens_per_s:>10.0f} "
              f"{c.memory_bytes / 2**20:>9.1f}  {c.main_cost:<32} {recompute:<20} {c.layout}")
    print("best: " + " ".join(ranked[0].flags()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**vars(c), "flags": c.flags()} for c in ranked], f, indent=1)
    return 0


if __name__ == "__main__":
    end(main())
