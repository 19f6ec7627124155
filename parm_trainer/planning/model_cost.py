"""Whole-model cost model: the time and memory of every piece of a GPT-MoE on one rank.

One pricing with the MoE layer's (moe/cost_model.py): the same Profile (collectives per kind
and link class, GEMM alpha-beta, memory traffic when calibrated), the same byte formulas for
what one rank sends, and for an MoE MLP the plan cost of the schedule and depth auto picks.
A model is a sequence of pieces, each priced forward and backward per micro-batch:

    E  embedding: lookup (memory n*M), vocabulary-parallel reduction over MP (an AllReduce of
       n*M, a ReduceScatter under sequence parallelism)
    t  decoder layer = attention block + MLP (dense, or MoE where --moe-layer-freq puts one):
       attention GEMMs 2n*M*(M + 2*M*g/h)/T (QKV, g key-value groups of h heads) + 2n*M*M/T
       (projection) + 4*b*s^2*M/T (scores and values), softmax traffic b*(h/T)*s^2;
       dense MLP 2n*M*F*(3 with SwiGLU, else 2)/T; each block's MP collectives (AllGather in
       and ReduceScatter out under SP, else one AllReduce out); norms' traffic
    L  final norm, output GEMM 2n*M*V/T and the vocabulary-parallel cross entropy (traffic
       about 4 passes over n*V/T logits, three AllReduces of n values over MP)

n = micro-batch x sequence tokens, T = MP size; backward: twice the GEMMs and the traffic, the
collectives' duals. With args.layer_times (the pieces measured on this machine) those seconds
replace the compute prices (measured_cost.py). Memory per rank: parameters (dense / T,
experts / (EP x ESP)), their fp32 gradients and Adam state (12 bytes per parameter, over DP
with the distributed optimizer; plus a 4-byte fp32 copy under bf16), and the activations
autograd saves per micro-batch, counted from what this stack's modules keep (measured with
torch.autograd.graph.saved_tensors_hooks on the local spec; see activations()).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parm_trainer.mla_flags import attention_sizes
from parm_trainer.moe.cost_model import CHUNK_CHOICES, plan_cost, sent_bytes, shape_plan
from parm_trainer.moe.cost_profile import Profile
from parm_trainer.moe.grouped_experts import applies_to_run
from parm_trainer.moe.link_sharing import link_flows, tiled_groups
from parm_trainer import node_relay
from parm_trainer.planning import recompute_cost
from parm_trainer.planning.measured_cost import priced_with_times


@dataclass(frozen=True)
class Piece:
    """One piece of the model on one rank, per micro-batch."""
    kind: str           # "E", "t" (dense layer), "m" (MoE layer), "L"
    forward_s: float
    backward_s: float
    params: float       # parameters this rank holds for the piece
    expert_params: float  # of which in experts (reduced over the expert-DP group)
    activation_bytes: float  # saved for the backward, per micro-batch
    recompute_bytes: float = 0.0  # alive again while its recomputed parts' backward runs
    recompute_s: float = 0.0  # of backward_s: selective recompute's forward again

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def moe_layers(args) -> list:
    """Which decoder layers are MoE: --moe-layer-freq as parsed, an int (every N-th, from
    layer 0) or a list (1 = MoE)."""
    freq = getattr(args, "moe_layer_freq", 1)
    if not args.num_experts:
        return [False] * args.num_layers
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(args.num_layers)]
    return [bool(x) for x in freq]


class ModelCost:
    """Prices the pieces of args' model under args' layout with a Profile."""

    def __init__(self, args, profile: Profile, moe_schedule: tuple = None):
        self.args, self.profile = args, profile
        a = args
        self.tp, self.pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
        self.dp = a.world_size // (self.tp * self.pp)
        self.edp = a.world_size // (a.expert_model_parallel_size * a.expert_tensor_parallel_size
                                    * self.pp)  # the experts' data-parallel size
        self.e = 2 if a.bf16 or getattr(a, "fp16", False) else 4
        self.n = a.seq_length * a.micro_batch_size
        self.sp = a.sequence_parallel and self.tp > 1
        self.vocab = getattr(a, "padded_vocab_size", None) or getattr(a, "vocab_size", 32000)
        self.moe_schedule = moe_schedule  # (name, chunks); None: the cheaper of s1/s2, r 1..8
        self.moe_choice = None  # what moe_mlp picked: (name, "rN")
        # the pieces' seconds measured on this machine (schedule/layer_times.py), if any; a
        # profile given wins
        self.layer_times = None if getattr(a, "moe_parm_cost_profile", None) else \
            getattr(a, "layer_times", None)
        self.time_factor = 1.0

    # --- primitives ----------------------------------------------------------------------------
    def coll(self, kind: str, nbytes: float, size: int, stride: int = 1,
             groups: list = None, wait: bool = True) -> float:
        """One collective of a group of `size` at `stride` (all such groups at once), or of
        the explicit `groups` at once, plus (with `wait`) the profile's wait at a collective
        call (its layer s_per_call: ranks arriving after compute wait for the slowest, as
        the MoE layer's calls do in plan_cost)."""
        if size < 2:
            return 0.0
        alpha, beta = self.profile.rate(kind, size, stride, groups)
        return (alpha + sent_bytes(kind, int(nbytes), size) * beta
                + (self.profile.layer[3] if wait else 0.0))

    def gemm(self, flops: float, calls: int = 1) -> float:
        """`calls` GEMMs of `flops` in all (the backward runs twice as many)."""
        alpha, beta = self.profile.compute
        return calls * alpha + flops * beta

    def traffic(self, nbytes: float) -> float:
        if self.profile.memory is None:
            return 0.0
        alpha, beta = self.profile.memory
        return alpha + nbytes * beta

    def _mp_block(self, gemm_s: float, traffic_s: float) -> tuple:
        """(forward, backward) of a block with its MP collectives around it."""
        full = self.n * self.args.hidden_size * self.e
        if self.sp:
            comm = self.coll("allgather", full / self.tp, self.tp) + \
                self.coll("reducescatter", full, self.tp)
        else:
            comm = self.coll("allreduce", full, self.tp)
        return gemm_s + traffic_s + comm, 2 * (gemm_s + traffic_s) + comm

    # --- pieces ----------------------------------------------------------------------------------
    def embedding(self) -> Piece:
        n, M = self.n, self.args.hidden_size
        reduce = self.coll("reducescatter" if self.sp else "allreduce", n * M * self.e, self.tp)
        look = self.traffic(2 * n * M * self.e)
        return Piece("E", look + reduce, 2 * look + reduce, self.vocab * M / self.tp, 0.0,
                     self.activations("E"))

    def _widths(self) -> tuple:
        """(query width, key/value width): heads x channels, groups x channels."""
        a = self.args
        heads = a.num_attention_heads
        groups = a.num_query_groups if getattr(a, "group_query_attention", False) else heads
        channels = getattr(a, "kv_channels", None) or a.hidden_size // heads
        return heads * channels, groups * channels

    def _attention_extras(self) -> float:
        """An attention's parameters beside its projection weights and input norm on this rank:
        the biases and the query/key norms (multi-latent attention's latent norms are
        attention_sizes' own)."""
        a, M, T = self.args, self.args.hidden_size, self.tp
        heads, mla = a.num_attention_heads, getattr(a, "multi_latent_attention", False)
        q, kv = self._widths()
        params = 0.0
        bias = not getattr(a, "disable_bias_linear", True)
        if not mla and (getattr(a, "add_qkv_bias", False) or bias):
            params += (q + 2 * kv) / T  # --add-qkv-bias (all biases: the projection's too)
        if bias:
            params += M
        if mla:
            return params
        if getattr(a, "qk_layernorm_across_heads", False):
            params += (q + kv) / T  # a weight per channel of every head, split with the heads
        elif getattr(a, "qk_layernorm", False):  # one head's width each, on every rank
            params += 2 * q / heads * (1 if getattr(a, "normalization", "") == "RMSNorm" else 2)
        return params

    def attention(self) -> tuple:
        a, n, M, T = self.args, self.n, self.args.hidden_size, self.tp
        heads = a.num_attention_heads
        sizes = attention_sizes(a)  # multi-latent attention: its projections and head sizes
        core = 2 * a.micro_batch_size * a.seq_length ** 2 * (sizes["score"] + sizes["value"]) / T
        flops = 2 * n * sizes["split"] / T + core
        softmax = 3 * a.micro_batch_size * heads / T * a.seq_length ** 2 * self.e
        norm = 2 * n * M * self.e / (T if self.sp else 1)
        # QKV, scores, values, projection
        f, b = self._mp_block(self.gemm(flops, calls=4), self.traffic(softmax + norm))
        params = sizes["split"] / T + sizes["whole"] + M + self._attention_extras()
        return f, b, params

    def mlp(self) -> tuple:
        a, n, M = self.args, self.n, self.args.hidden_size
        mats = 3 if getattr(a, "swiglu", False) else 2
        flops = 2 * n * M * a.ffn_hidden_size * mats / self.tp
        norm = 2 * n * M * self.e / (self.tp if self.sp else 1)
        f, b = self._mp_block(self.gemm(flops, calls=2), self.traffic(norm))  # fc1, fc2
        return f, b, M * a.ffn_hidden_size * mats / self.tp + M

    def moe_mlp(self) -> tuple:
        """(forward, backward, expert params, router params) of the MoE MLP: the plan cost of
        the schedule auto would pick (the cheaper of s1 and s2 over depths 1-8) on this shape."""
        from parm_trainer.moe.cost_shape import layer_shape

        a = self.args
        shape = replace(layer_shape(a, per_node=self.profile.gpus_per_node),
                        bytes_per_element=self.e)
        options = ([self.moe_schedule] if self.moe_schedule else
                   [(s, r) for s in ("s1", "s2") for r in CHUNK_CHOICES])
        best = None
        for name, chunks in options:
            try:
                cost = plan_cost(shape_plan(name, replace(shape, chunks=chunks)),
                                 replace(shape, chunks=chunks), self.profile)
            except ValueError:
                continue
            if best is None or cost["total_s"] < best["total_s"]:
                best, self.moe_choice = cost, (name, f"r{chunks}")
        if best is None:
            raise ValueError("no Parm schedule can run this MoE layer")
        mats = 3 if getattr(a, "swiglu", False) else 2
        local = a.num_experts // a.expert_model_parallel_size
        experts = local * a.hidden_size * a.moe_ffn_hidden_size * mats / \
            a.expert_tensor_parallel_size
        forward, backward = best["forward_s"], best["backward_s"]
        dense = a.hidden_size * a.num_experts  # the router
        shared = getattr(a, "moe_shared_expert_intermediate_size", None)
        if shared:  # its weights (its time is in the plan's cost: shared_expert_s)
            dense += a.hidden_size * (shared * mats / self.tp + bool(a.moe_shared_expert_gate))
        return forward, backward, experts, dense

    def recomputed(self, kind: str) -> float:
        """The most piece `kind`'s selectively recomputed parts hold again during its backward
        (one part at a time: the MLP's backward is done before the attention's starts)."""
        modules = recompute_cost.selective(self.args)
        full = self.activations(kind, ())
        return max([full - self.activations(kind, (m,)) for m in modules], default=0.0)

    def activations(self, kind: str, modules: tuple = None) -> float:
        """Bytes autograd saves for one micro-batch in piece `kind` on this rank (the local
        spec, unfused): a norm keeps its input (RMSNorm its output too) and per-token
        statistics; each linear layer its input; core attention q, k, v, the softmax output
        (b x h x s x s) and the causal mask; RoPE the rotated q and k; dropout with p > 0 a
        mask per element (attention: the mask and the dropped probabilities); an MLP its fc1
        output and activation output (2 F per row; SwiGLU 5 F: the 2F-wide fc1 output and
        three F-wide products), on n rows (dense) or the expert rows n k ESP / MP of F / ESP
        (MoE: see expert_widths), whose input rows are kept too; the router its input and the
        routing; the output layer its input and the fp32 logits. Selective recompute's
        modules keep less (recompute_cost.py; modules: the run's when None)."""
        a, e, n, M, T = self.args, self.e, self.n, self.args.hidden_size, self.tp
        b, s, heads = a.micro_batch_size, a.seq_length, a.num_attention_heads
        modules = recompute_cost.selective(a) if modules is None else modules
        rms = getattr(a, "normalization", "LayerNorm") == "RMSNorm"
        boundary = n * M * e / (T if self.sp else 1)  # a tensor between MP blocks
        norm = boundary * (2 if rms else 1) + n * (4 if rms else 8)
        hidden_drop = boundary if getattr(a, "hidden_dropout", 0.0) > 0 else 0.0
        if kind == "E":
            return n * 8 + hidden_drop
        if kind == "L":
            return norm + n * M * e + n * self.vocab / T * 4 + n * 9
        probs = b * heads / T * s * s * e
        q, kv = self._widths()
        attention = (norm + n * M * e + 3 * n * q * e / T + probs + s * s + n * q * e / T
                     + hidden_drop)
        if getattr(a, "position_embedding_type", "") == "rope":
            attention += 2 * n * q * e / T
        if getattr(a, "qk_layernorm", False) and not getattr(a, "multi_latent_attention", False):
            # each norm's input (and RMSNorm's output)
            attention += (q + kv) * n * e / T * (2 if rms else 1) + n * heads / T * 8
        if getattr(a, "attention_dropout", 0.0) > 0:
            attention += 2 * probs
        attention -= recompute_cost.core_attention_saved(a, modules, probs, s)  # selective recompute
        widths = 5 if getattr(a, "swiglu", False) else 2
        # the experts' rows: megatron's MLP keeps one F more (the activation before the routing
        # weight scales it); its grouped form on CPU keeps fc1's output, the activation and the
        # scaled activation (moe/grouped_experts.py: SwiGLU 4 F, gelu 3 F)
        expert_widths = ((4 if widths == 5 else 3) if applies_to_run(a) else widths + 1)
        if kind == "t":
            mlp = recompute_cost.dense_mlp(
                modules, n * M * e + widths * n * a.ffn_hidden_size / T * e, boundary)
        else:
            esp, k = a.expert_tensor_parallel_size, a.moe_router_topk
            rows = n * k * esp / T
            router = n * M * e + n * (a.num_experts * 4 + k * 24 + 20)  # router and routing
            experts = (expert_widths * rows * a.moe_ffn_hidden_size / esp * e
                       + 2 * rows * M * e)
            shared = getattr(a, "moe_shared_expert_intermediate_size", None)
            # its fc1 input (gathered under SP) and fc1/activation outputs
            shared = n * M * e + widths * n * shared / T * e if shared else 0.0
            mlp = recompute_cost.moe_mlp(self, modules, router, experts, shared, boundary)
        return attention + norm + mlp + hidden_drop

    def layer(self, moe: bool) -> Piece:
        af, ab, attn_params = self.attention()
        kind = "m" if moe else "t"
        if not moe:
            mf, mb, mlp_params = self.mlp()
            again = recompute_cost.selective_s(self, moe)  # recomputed parts' forward again
            return Piece(kind, af + mf, ab + mb + again, attn_params + mlp_params, 0.0,
                         self.activations(kind), self.recomputed(kind), again)
        mf, mb, experts, router = self.moe_mlp()
        again = recompute_cost.selective_s(self, moe)
        return Piece(kind, af + mf, ab + mb + again, attn_params + experts + router +
                     self.args.hidden_size, experts, self.activations(kind),
                     self.recomputed(kind), again)

    def head(self) -> Piece:
        n, M, V, T = self.n, self.args.hidden_size, self.vocab, self.tp
        gather = self.coll("allgather", n * M * self.e / T, T) if self.sp else 0.0
        logits = self.traffic(4 * n * V / T * self.e)
        gemm = self.gemm(2 * n * M * V / T)
        ce = 3 * self.coll("allreduce", n * 4, T)
        # the output weight: the embedding's own where tied and on the same stage (stages.py)
        head = Piece("L", gather + gemm + logits + ce, gather + 2 * (gemm + logits) + ce,
                     M + V * M / T, 0.0, self.activations("L"))
        return self._with_mtp(head)

    def _with_mtp(self, head: Piece) -> Piece:
        """The loss piece with --mtp-num-layers' layers, which megatron puts on the loss's
        stage: each the last decoder layer's kind, its embedding lookup, enorm and hnorm,
        eh_proj (2M -> M) and final norm, and its own logits and loss through the output
        layer; with untied embeddings under pipelining the stage's copy of the embedding."""
        a, n, M, T, e = self.args, self.n, self.args.hidden_size, self.tp, self.e
        k = getattr(a, "mtp_num_layers", None) or 0
        if not k:
            return head
        layer = self.layer(moe_layers(a)[-1])
        proj = self.gemm(2 * n * 2 * M * M / T)
        rms = getattr(a, "normalization", "LayerNorm") == "RMSNorm"
        norm = n * M * e / (T if self.sp else 1) * (2 if rms else 1) + n * (4 if rms else 8)
        saved = n * 8 + 2 * norm + n * 2 * M * e + layer.activation_bytes + head.activation_bytes
        embedding = (self.vocab * M / T if a.untie_embeddings_and_output_weights
                     and a.pipeline_model_parallel_size > 1 else 0.0)
        return Piece("L", head.forward_s + k * (layer.forward_s + proj + head.forward_s),
                     head.backward_s + k * (layer.backward_s + 2 * proj + head.backward_s),
                     head.params + embedding + k * (layer.params + 2 * M * M / T + 3 * M),
                     k * layer.expert_params, head.activation_bytes + k * saved,
                     max(head.recompute_bytes, layer.recompute_bytes))

    def pieces(self) -> list:
        """[E, layer 0 .. layer N-1, L] on one rank."""
        moe = moe_layers(self.args)
        cache = {}
        for m in moe:  # each kind priced once
            if m not in cache:
                cache[m] = self.layer(m)
        layers = [cache[m] for m in moe]
        pieces = [self.embedding(), *layers, self.head()]
        return priced_with_times(self, pieces) if self.layer_times else pieces

    # --- per stage --------------------------------------------------------------------------
    def scaled(self, factor: float) -> "ModelCost":
        """This pricing with compute work `factor` times as long (Profile.scaled_compute), the
        MoE layers on the schedule and depth already chosen."""
        if factor == 1.0:
            return self
        schedule = self.moe_schedule or (self.moe_choice and
                                         (self.moe_choice[0], int(self.moe_choice[1][1:])))
        scaled = ModelCost(self.args, self.profile.scaled_compute(factor), schedule)
        scaled.time_factor = self.time_factor * factor
        return scaled

    def stage_pairs(self, a: int, b: int) -> list:
        """The rank pairs of pipeline ranks a and b (each position in the stage), which
        exchange at once."""
        size = self.args.world_size // self.pp
        return [[a * size + i, b * size + i] for i in range(size)]

    def p2p_s(self, a: int = 0, b: int = 1) -> float:
        """One activation (or its gradient) between pipeline ranks a and b, every pair of
        theirs at once; without the wait at a call: waiting on the other stage is the
        schedule's own dependency, which the pipeline steps price (stages.py). Across nodes,
        the pairs leaving a node share its link's burst (Profile.burst_bytes): transfers
        spaced by a stage's compute find the link idle."""
        nbytes = self.n * self.args.hidden_size * self.e / (self.tp if self.sp else 1)
        pairs = self.stage_pairs(a, b)
        flows = link_flows(pairs, self.profile.gpus_per_node)  # 0 inside a node
        if flows:
            nbytes = max(0.0, nbytes - self.profile.burst_bytes / flows)
        return self.coll("allgather", nbytes, 2, groups=pairs, wait=False)

    def embedding_sync_s(self) -> float:
        """megatron's all-reduce of the tied word embedding's fp32 gradient between the first
        and the last pipeline rank (their embedding group), after the DP reduction."""
        if self.pp < 2:
            return 0.0
        return self.coll("allreduce", self.vocab * self.args.hidden_size / self.tp * 4, 2,
                         groups=self.stage_pairs(0, self.pp - 1))

    def gradient_sync_s(self, params: float, expert_params: float) -> float:
        """The DP all-reduce of a stage's fp32 gradients (dense over DP, experts over the
        expert-data-parallel group), then the optimizer's pass over the parameters."""
        a = self.args
        dense = self.gradient_all_reduce_s((params - expert_params) * 4, self.dp, self.tp)
        experts = self.gradient_all_reduce_s(expert_params * 4, self.edp,
                                             a.expert_model_parallel_size
                                             * a.expert_tensor_parallel_size)
        optimizer = self.traffic(params * 32)  # fp32 weight, grad, two moments: read + write
        return dense + experts + optimizer

    def gradient_all_reduce_s(self, nbytes: float, size: int, stride: int) -> float:
        """The DP groups' all-reduce of nbytes: gloo's ring, or where it goes node by node
        (node_reduce.py: gloo, each group over N >= 2 nodes with R >= 2 ranks on each) an
        all-reduce inside each node (its AlltoAll and AllGather move a ring all-reduce's
        bytes) and one of nbytes / R across the nodes."""
        a, per_node = self.args, self.profile.gpus_per_node
        groups = tiled_groups(size, stride, per_node) if size > 1 else []
        by_node = (getattr(a, "distributed_backend", None) == "gloo"
                   and getattr(a, "grad_reduce_by_node", True) and groups
                   and node_relay.layout(groups, per_node))
        if not by_node:
            return self.coll("allreduce", nbytes, size, stride)
        nodes, per = by_node
        intra = [g[n * per:(n + 1) * per] for g in groups for n in range(nodes)]
        inter = [g[p::per] for g in groups for p in range(per)]
        return (self.coll("allreduce", nbytes, per, groups=intra)
                + self.coll("allreduce", nbytes / per, nodes, groups=inter))

    def state_parts(self, params: float, expert_params: float = 0.0) -> tuple:
        """(parameters and their fp32 gradients, optimizer state) of params (expert_params of
        them in experts) on this rank; the distributed optimizer shards the dense ones' state
        over DP, the experts' over the expert-data-parallel group."""
        optimizer = 12 if self.e == 2 else 8  # (fp32 copy of 16-bit weights) + two Adam moments
        dense, experts = params - expert_params, expert_params
        if getattr(self.args, "use_distributed_optimizer", False):
            dense, experts = dense / self.dp, experts / max(1, self.edp)
        return params * (self.e + 4), (dense + experts) * optimizer

    def state_bytes(self, params: float, expert_params: float = 0.0) -> float:
        """Parameters, gradients and optimizer state of params on this rank."""
        return sum(self.state_parts(params, expert_params))
