"""The ranks' side of tests/test_moe_comm.py (run by conftest.run_rank_workers)."""
import faulthandler, json, os, sys, traceback
# a rank still running after 150 s (the launch's timeout is 180) writes every thread's stack
# and ends, so a hang fails the test with where each rank stood
STACKS = open(os.path.join(sys.argv[1], f"stacks{os.environ['RANK']}.txt"), "w")
faulthandler.dump_traceback_later(150, exit=True, file=STACKS)
import torch
import torch.distributed as dist
from parm_trainer.moe import comm
from parm_trainer.moe.comm import LEDGER

dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
PARTS = {"pairs": [[0, 1], [2, 3]], "cross": [[0, 2], [1, 3]], "all4": [[0, 1, 2, 3]],
         "single": [[0], [1], [2], [3]], "none": [[0], [1], [2], [3]]}
GROUPS = {name: dist.new_subgroups_by_enumeration(part)[0]
          for name, part in PARTS.items() if name != "none"}
GROUPS["none"] = None
failures, checks, seed = [], 0, [0]


def expect(ok, what):
    global checks
    checks += 1
    if not ok:
        failures.append(what)


def data(shape):
    """Integer-valued floats from a fresh seed that every rank draws in the same order."""
    seed[0] += 1
    gen = torch.Generator().manual_seed(seed[0])
    return torch.randint(-8, 9, tuple(shape), generator=gen).float()


def members_of(part):
    return next(m for m in PARTS[part] if RANK in m)


def per_member(xs, part, fn):
    """Reference outputs by global rank: fn(inputs of the group's members, member index)."""
    out = [None] * WORLD
    for members in PARTS[part]:
        inputs = [xs[r] for r in members]
        for i, r in enumerate(members):
            out[r] = fn(inputs, i)
    return out


REF = {
    "all_to_all": lambda xs, p: per_member(xs, p, lambda g, i: torch.cat(
        [x.chunk(len(g), 0)[i] for x in g], 0)),
    "all_gather": lambda xs, p, d: per_member(xs, p, lambda g, i: torch.cat(g, d)),
    "reduce_scatter": lambda xs, p, d: per_member(xs, p, lambda g, i: sum(g).chunk(len(g), d)[i]),
    "all_reduce": lambda xs, p: per_member(xs, p, lambda g, i: sum(g)),
    "split": lambda xs, p, d: per_member(xs, p, lambda g, i: g[i].chunk(len(g), d)[i]),
    "copy_to": lambda xs, p: per_member(xs, p, lambda g, i: g[i]),
}
REF["gather"] = REF["all_gather"]
# op: (replicated input, replicated output, takes a dim, forward kind, backward kind)
OPS = {
    "all_to_all": (False, False, False, "alltoall", "alltoall"),
    "all_gather": (False, False, True, "allgather", "reducescatter"),
    "reduce_scatter": (False, False, True, "reducescatter", "allgather"),
    "all_reduce": (False, True, False, "allreduce", None),
    "split": (True, False, True, None, "allgather"),
    "gather": (False, True, True, "allgather", None),
    "copy_to": (True, False, False, None, "allreduce"),
}


def volume(kind, tensor, world):
    """The ledger formulas, with tensor the collective's input."""
    b = tensor.numel() * tensor.element_size()
    return {"alltoall": b * (world - 1) // world, "allgather": b * (world - 1),
            "reducescatter": b * (world - 1) // world,
            "allreduce": 2 * b * (world - 1) // world}[kind]


def rows(world, *entries):
    """Expected ledger rows from (kind, group name, input tensor) entries."""
    out = {}
    for kind, name, tensor in entries:
        if kind is not None and world[name] > 1:
            n = volume(kind, tensor, world[name])
            out[f"{kind}/{name}"] = {"sent": n, "received": n, "calls": 1}
    return out


def reference(ref, shape, replicated_in, replicated_out, part):
    """Inputs, outputs, upstream grads and input grads of ref by global rank, computed with
    single-process autograd; part is the group layout of replicated inputs/outputs."""
    if replicated_in:  # one tensor per group, shared by its members
        leaf = {tuple(m): data(shape).requires_grad_() for m in PARTS[part]}
        xs = [leaf[tuple(m)] for r in range(WORLD) for m in PARTS[part] if r in m]
    else:
        xs = [data(shape).requires_grad_() for _ in range(WORLD)]
    outs = ref(xs)
    ups = [data(o.shape) for o in outs]
    if replicated_out:  # one upstream grad per group; count each group's output once
        firsts = [m[0] for m in PARTS[part]]
        ups = [ups[next(m[0] for m in PARTS[part] if r in m)] for r in range(WORLD)]
        loss = sum((outs[r] * ups[r]).sum() for r in firsts)
    else:
        loss = sum((o * u).sum() for o, u in zip(outs, ups))
    loss.backward()
    return [x.detach() for x in xs], outs, ups, [x.grad for x in xs]


def run_dist(fn, x, up):
    """fn on this rank's input; returns output, input grad, forward and backward ledger rows."""
    x = x.clone().requires_grad_()
    LEDGER.reset()
    out = fn(x)
    forward = LEDGER.totals(phase="forward")
    (out * up).sum().backward()
    return out.detach(), x.grad, forward, LEDGER.totals(phase="backward")


def check_op(op, part, dim, shape):
    rep_in, rep_out, _, fwd_kind, bwd_kind = OPS[op]
    args = (dim,) if dim is not None else ()
    xs, outs, ups, grads = reference(lambda t: REF[op](t, part, *args), shape, rep_in, rep_out,
                                     part)
    run = lambda x: getattr(comm, op)(x, GROUPS[part], part, *args)
    out, grad, fwd, bwd = run_dist(run, xs[RANK], ups[RANK])
    tag = f"{op} {part} dim={dim}"
    world = {part: len(members_of(part))}
    expect(torch.equal(out, outs[RANK].detach()), f"{tag}: forward")
    expect(torch.equal(grad, grads[RANK]), f"{tag}: backward")
    expect(fwd == rows(world, (fwd_kind, part, xs[RANK])), f"{tag}: forward bytes {fwd}")
    expect(bwd == rows(world, (bwd_kind, part, ups[RANK])), f"{tag}: backward bytes {bwd}")


def check_start_finish(part):
    """comm.start/finish equal the blocking op in both directions, for every kind; and once
    the backward is done nothing of the pair stays alive (its handle, which holds its output,
    would hold the autograd graph through C++, out of the garbage collector's sight)."""
    import gc, time, weakref
    group = GROUPS[part]
    for kind, op in (("alltoall", "all_to_all"), ("allgather", "all_gather"),
                     ("reducescatter", "reduce_scatter"), ("gather", "gather")):
        dims = () if kind == "alltoall" else (1,)
        xs, outs, ups, grads = reference(lambda t: REF[op](t, part, *dims), (8, 12, 3),
                                         False, kind == "gather", part)
        pendings = []

        def pair(x):
            started = comm.start(kind, x, group, part, *dims)
            pendings.append(weakref.ref(started[1]) if started[1] is not None else None)
            return comm.finish(started)
        out, grad, _, _ = run_dist(pair, xs[RANK], ups[RANK])
        expect(torch.equal(out, outs[RANK].detach()), f"start/finish {kind} {part}: forward")
        expect(torch.equal(grad, grads[RANK]), f"start/finish {kind} {part}: backward")
        for _ in range(25):  # gloo's worker thread lets go of a finished work a moment later
            gc.collect()
            if all(ref is None or ref() is None for ref in pendings):
                break
            time.sleep(0.02)
        expect(all(ref is None or ref() is None for ref in pendings),
               f"start/finish {kind} {part}: the pending pair outlives its backward")


try:
    for part in ("pairs", "cross", "all4", "single"):
        check_start_finish(part)
    for part in PARTS:
        for op, (_, _, takes_dim, _, _) in OPS.items():
            for dim in ((0, 1, -1) if takes_dim else (None,)):
                divides = op not in ("reduce_scatter", "split") or dim != -1
                if divides:
                    check_op(op, part, dim, (8, 12, 3))
    crashed = False
except Exception:
    failures.append(traceback.format_exc())
    crashed = True
with open(os.path.join(sys.argv[1], f"rank{RANK}.json"), "w") as f:
    json.dump({"rank": RANK, "checks": checks, "failures": failures}, f)
if crashed:  # the other ranks may be blocked in a collective: let torchrun stop them now
    os._exit(1)
faulthandler.cancel_dump_traceback_later()
dist.destroy_process_group()
