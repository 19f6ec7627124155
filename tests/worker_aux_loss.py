"""The ranks' side of tests/test_aux_loss.py (run by conftest.run_rank_workers)."""
import torch
from megatron.core.transformer.moe import router
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from parm_trainer.bench import flags
from parm_trainer.bench.harness import build_layer
from parm_trainer.bench.layout import set_layout
from parm_trainer.bench.replica import clear_tracker, tracked_aux
from parm_trainer.compat import cpu
from parm_trainer.models.config import transformer_config
from parm_trainer.moe import aux_loss

HANG_S = 150
# (MP, EP, ESP, whether the EP x ESP group holds the MP group)
LAYOUTS = [(2, 2, 2, True), (2, 2, 1, True), (4, 2, 1, False)]
SEQ, MBS, HIDDEN = 16, 2, 32

calls = [0]
counted = router.get_tokens_per_expert_and_token_count


def counting(*args, **kwargs):
    calls[0] += 1
    return counted(*args, **kwargs)


def run(layer, x, g):
    """Forward and backward; (output, aux, input grad, {param: grad}, router count calls)."""
    layer.zero_grad()
    clear_tracker()
    calls[0] = 0
    x = x.clone().requires_grad_(True)
    out = layer(x)[0]
    in_forward = calls[0]
    (out * g).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), tracked_aux(x.device), x.grad.clone(), grads, in_forward


def close(a, b):
    return (a - b).abs().max().item() <= 1e-6 * max(b.abs().max().item(), 1e-12)


def main(report):
    cpu.apply()
    router.get_tokens_per_expert_and_token_count = counting  # the router's name for it
    for mp, ep, esp, nested in LAYOUTS:
        args = flags.parse(["--tensor-model-parallel-size", str(mp), "--sequence-parallel",
                            "--expert-model-parallel-size", str(ep),
                            "--expert-tensor-parallel-size", str(esp), "--num-experts", "4",
                            "--moe-router-topk", "2", "--hidden-size", str(HIDDEN),
                            "--moe-ffn-hidden-size", "64", "--seq-length", str(SEQ),
                            "--micro-batch-size", str(MBS), "--moe-aux-loss-coeff", "0.1",
                            "--schedules", "s1", "--moe-parm-chunks", "2"], world_size=4)
        args.moe_parm_schedule = "s1"
        set_layout(args)
        config = transformer_config(args)
        layer, twin = build_layer("s1", config, args), build_layer("s1", config, args)
        twin.load_state_dict(layer.state_dict())
        layer.train(), twin.train()
        twin.router.defer = False
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        case = f"MP {mp} EP {ep} ESP {esp}"
        assert isinstance(layer.router, aux_loss.DeferringRouter), case
        assert layer.router.defer == nested, (case, layer.aux_rows)
        generator = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        x = torch.randn(SEQ // mp, MBS, HIDDEN, generator=generator)
        g = torch.randn(SEQ // mp, MBS, HIDDEN, generator=generator)
        got, want = run(layer, x, g), run(twin, x, g)
        assert got[4] == (0 if nested else 1) and want[4] == 1, (case, got[4], want[4])
        assert want[1] is not None and want[1].item() > 0, (case, want[1])
        for what, a, b in (("output", got[0], want[0]), ("aux loss", got[1], want[1]),
                           ("input grad", got[2], want[2])):
            assert close(a, b), (case, what, (a - b).abs().max().item())
            report["checks"] += 1
        assert got[3].keys() == want[3].keys() and "router.weight" in got[3], case
        for name in want[3]:
            assert close(got[3][name], want[3][name]), (case, name)
            report["checks"] += 1


if __name__ == "__main__":
    import os.path
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: rank_main
    import rank_main

    rank_main.run(main, HANG_S)
