"""The stage builder's default path: with no --moe-parm-cost-profile, the model's own pieces
measured on this machine, once, and cached.

Every rank builds the pieces of args' model as the run builds them, from megatron-core's
GPTModel on the real process groups: the embedding (E), a dense decoder layer (t), an MoE layer
on the schedule and depth the run settled (m), and the final norm, output layer and cross
entropy (L); then times the forward and the backward of each on random tokens of the run's
micro-batch, in interleaved rounds (tune.interleaved_times): per piece the median, the max
over ranks, so every rank splits alike. The stage builder prices those pieces with these
seconds (planning/measured_cost.py); the P2P transfers between stages and the gradient
reduction still come from the profile. The result is cached in the MoE schedule's cache file
(tune.cache_path) under its own key, naming the cluster and the model's shape, and reused; the
log says which: measured now, cached, or the profile. tools/plan_layout.py measures the same
way on one rank of its own (a one-rank process group).
"""

from __future__ import annotations

import copy
import json
import statistics
import time

import torch

from parm_trainer import moe_flags
from parm_trainer.parallel import rank_device
from parm_trainer.planning.model_cost import moe_layers
from parm_trainer.schedule import tune

WARMUP, ROUNDS = 1, 4
KINDS = ("E", "t", "m", "L")
SHAPE_FLAGS = (  # the model as its pieces run it: the cache key's model part
    "tensor_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "sequence_parallel", "seq_length", "micro_batch_size", "hidden_size", "ffn_hidden_size",
    "num_attention_heads", "group_query_attention", "num_query_groups", "kv_channels",
    "padded_vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_expert_capacity_factor", "moe_router_pre_softmax", "moe_grouped_gemm",
    "moe_token_dispatcher_type", "moe_parm_schedule", "moe_parm_chunks", "moe_parm_exchange",
    "moe_parm_local_first", "moe_shared_expert_overlap", "bf16", "fp16", "normalization",
    "swiglu", "position_embedding_type", "disable_bias_linear", "add_qkv_bias", "qk_layernorm",
    "qk_layernorm_across_heads", "multi_latent_attention", "hidden_dropout",
    "attention_dropout", "transformer_impl")


def wanted(args) -> bool:
    """Whether start-up measures the pieces: --pipeline-model-parallel-layout auto over
    several stages, no cost profile, a GPT (BERT's heads are not these pieces: it keeps the
    profile's prices)."""
    return (getattr(args, "pipeline_model_parallel_layout", None) == "auto"
            and args.pipeline_model_parallel_size > 1
            and not getattr(args, "moe_parm_cost_profile", None)
            and not hasattr(args, "bert_binary_head"))


def decoder_kinds(args) -> list:
    """The decoder layer kinds the model holds, in order: "t" (dense), "m" (MoE)."""
    pattern = moe_layers(args)
    return [k for k, there in (("t", not all(pattern)), ("m", any(pattern))) if there]


def _key(args) -> str:
    shape = {name: getattr(args, name, None) for name in SHAPE_FLAGS}
    return json.dumps({"what": "layer times", **tune.cluster_key(args), "shape": shape,
                       "kinds": decoder_kinds(args), "blocks": moe_flags.config_fields(args),
                       "timing": f"{WARMUP}+{ROUNDS} interleaved, median, max over ranks"},
                      sort_keys=True, default=str)


def _valid(entry) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("seconds"), dict) and all(
        isinstance(v, list) and len(v) == 2 for v in entry["seconds"].values())


def _trial(args, kinds: list):
    """args with one decoder layer of each kind, on one pipeline stage (the model holds every
    piece), the output weight its own (tied or not, the output layer runs the same GEMMs)."""
    trial = copy.copy(args)
    trial.num_layers = len(kinds)
    trial.moe_layer_freq = [int(k == "m") for k in kinds]
    trial.pipeline_model_parallel_size = 1
    for name in ("pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size"):
        setattr(trial, name, None)
    trial.untie_embeddings_and_output_weights = True
    # measured without recomputation: the cost model adds what each recompute setting re-runs
    # (planning/recompute_cost.py), so one measurement prices every setting
    trial.recompute_granularity = trial.recompute_method = trial.recompute_num_layers = None
    trial.recompute_modules, trial.moe_layer_recompute = None, False
    return trial


def _pieces(args, kinds: list):
    """(run(kind) -> (forward s, backward s), the model) for every piece of the model."""
    from parm_trainer.models.config import transformer_config
    from parm_trainer.models.gpt import build_gpt_moe

    trial = _trial(args, kinds)
    device = torch.device(rank_device())
    model = build_gpt_moe(trial, transformer_config(trial), args.padded_vocab_size).to(
        device).to(args.params_dtype)
    b, s = args.micro_batch_size, args.seq_length
    gen = torch.Generator().manual_seed(1234 + torch.distributed.get_rank())
    tokens = torch.randint(0, args.padded_vocab_size, (b, s), generator=gen).to(device)
    positions = torch.arange(s).unsqueeze(0).expand(b, s).to(device)
    with torch.no_grad():
        first = model._preprocess(input_ids=tokens, position_ids=positions)
    hidden, rope = first[0].detach(), first[1]
    layers = dict(zip(kinds, model.decoder.layers))

    def embedding():
        return model._preprocess(input_ids=tokens, position_ids=positions)[0]

    def layer(kind):
        return lambda x: layers[kind](hidden_states=x, attention_mask=None,
                                      rotary_pos_emb=rope)[0]

    def head(x):  # the output layer and loss, after the MTP layers where the model has them
        x = model.decoder.final_layernorm(x)
        return model._postprocess(hidden_states=x, input_ids=tokens, position_ids=positions,
                                  labels=tokens, rotary_pos_emb=rope, rotary_pos_cos=None,
                                  rotary_pos_sin=None,
                                  mtp_in_postprocess=model.mtp_process).float().sum()

    def run(kind) -> tuple:
        x = hidden.clone().requires_grad_()
        torch.distributed.barrier()
        start = time.perf_counter()
        out = embedding() if kind == "E" else head(x) if kind == "L" else layer(kind)(x)
        tune.sync_device()
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        tune.sync_device()
        return middle - start, time.perf_counter() - middle

    return run, model


def measure(args) -> dict:
    """{kind: [forward s, backward s]} of E, each decoder layer kind and L: the medians of
    ROUNDS interleaved passes after WARMUP, max over ranks. Collective."""
    kinds = decoder_kinds(args)
    with tune.timing_layers(args):
        run, _ = _pieces(args, kinds)
        pieces = ["E", *kinds, "L"]
        times = tune.interleaved_times(pieces, run, WARMUP, ROUNDS)
    medians = [statistics.median(t[d] for t in times[p]) for p in pieces for d in (0, 1)]
    worst = tune.max_over_ranks(medians)
    return {p: worst[2 * i:2 * i + 2] for i, p in enumerate(pieces)}


def layout_of(args) -> dict:
    """The layout the pieces were measured under (planning/measured_cost.py scales them to
    another)."""
    return {"tp": args.tensor_model_parallel_size, "ep": args.expert_model_parallel_size,
            "esp": args.expert_tensor_parallel_size,
            "sp": bool(args.sequence_parallel and args.tensor_model_parallel_size > 1)}


def measured_layer_times(args, log=print) -> dict:
    """args.layer_times for the stage builder: {"seconds": {kind: [forward, backward]},
    "layout", "source"}, from the cache or measured now and cached. Collective: every rank
    calls it, with the process groups up and the MoE schedule settled."""
    entry, source = tune.cached_or_measured(
        tune.cache_path(args), _key(args),
        lambda: {"seconds": measure(args), "layout": layout_of(args),
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}, _valid)
    times = ", ".join(f"{k} {f * 1e3:.2f}+{b * 1e3:.2f}" for k, (f, b) in entry["seconds"].items())
    log(f"layer times for the stage builder, forward+backward ms per micro-batch: {times} "
        f"({source})")
    return {**entry, "source": f"layer times {source}"}


ONE_RANK = dict(tensor_model_parallel_size=1, expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, pipeline_model_parallel_size=1,
                sequence_parallel=False, world_size=1)


def one_rank_layer_times(args, log=print) -> dict:
    """measured_layer_times for a process of no ranks (tools/plan_layout.py): on a one-rank
    gloo group of its own under TP = EP = 1 (megatron's groups too, unless they are up), gone
    afterwards, on one CPU thread as a rank under torchrun; an MoE schedule or depth left to
    auto runs as s1 at depth 1 (at EP 1 nothing is exchanged)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from parm_trainer.compat import cpu
    from parm_trainer.parallel import reset_model_parallel

    trial = copy.copy(args)
    for name, value in ONE_RANK.items():
        setattr(trial, name, value)
    if trial.moe_parm_schedule == "auto":
        trial.moe_parm_schedule = "s1"
    trial.moe_parm_chunks = trial.moe_parm_chunks or 1
    cpu.apply()
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():  # as a rank computes: torchrun's one thread per rank
        torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = not parallel_state.model_parallel_is_initialized()
    if groups:
        parallel_state.initialize_model_parallel()
    try:
        return measured_layer_times(trial, log)
    finally:
        torch.set_num_threads(threads)
        if groups:
            reset_model_parallel()
        if created:
            dist.destroy_process_group()
