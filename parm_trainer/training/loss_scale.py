"""fp16's loss scaling, as Megatron-LM runs it on megatron-core's optimizer.

    torchrun --nproc-per-node 2 pretrain_gpt_moe.py --fp16 [--loss-scale S | --initial-loss-scale
        S --min-loss-scale M --loss-scale-window W --hysteresis H] ...

megatron-core builds the scaler from OptimizerConfig (a DynamicGradScaler with --fp16, a
ConstantGradScaler with --loss-scale), its pipeline schedules multiply the loss (and the MoE
router's auxiliary losses) by the scale, and optimizer.step() unscales the gradients and skips
the update, returning False, where any of them overflowed. Here: the flags as OptimizerConfig
takes them, one scaler for the dense and the expert optimizer (below), and the log's
`loss scale` and `number of skipped iterations`, Megatron-LM's.
"""

from __future__ import annotations

LOSS_SCALE = "loss scale"
SKIPPED = "number of skipped iterations"  # in the log interval so far (Megatron-LM's counter)


def optimizer_fields(args) -> dict:
    """OptimizerConfig's precision and loss-scaling fields, from Megatron-LM's flags."""
    return dict(fp16=args.fp16, loss_scale=args.loss_scale,
                initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis)


def dynamic(args) -> bool:
    """Whether megatron-core scales dynamically (--fp16 without a static --loss-scale; 0 is
    none, as Megatron-LM's `if config.loss_scale:` reads it)."""
    return bool(args.fp16 and not args.loss_scale)


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def scalers(optimizer) -> list:
    """The grad scalers of the optimizer's parts (none in fp32, nor in bf16 without
    --loss-scale)."""
    return [part.grad_scaler for part in _parts(optimizer)
            if getattr(part, "grad_scaler", None) is not None]


class _SharedScale:
    """One optimizer part's view of the shared scaler: its scale, and no update of its own."""

    def __init__(self, scaler):
        self.scaler = scaler

    @property
    def scale(self):
        return self.scaler.scale

    @property
    def inv_scale(self):
        return self.scaler.inv_scale

    def update(self, found_inf: bool) -> None:
        """The chained optimizer updates the shared scaler once per step (one_scaler)."""

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scaler.load_state_dict(state_dict)


def one_scaler(optimizer):
    """The optimizer, its parts made to share the first part's scaler, updated once per step
    with whether any part overflowed.

    With MoE layers megatron-core (0.16, get_megatron_optimizer) chains two optimizers, the
    dense parameters' and the experts', and gives each a scaler of its own, updated by its own
    overflow check. The loss is scaled by the first one's scale (ChainedOptimizer.
    get_loss_scale), while each part unscales by its own: once one part overflows and the
    other does not, the two scales part (the step is skipped for both, but only one scaler
    counts it), and from then on the experts' gradients are unscaled by the wrong factor. Each
    part's overflow flag is already the same on every rank (reduced over the dense, and the
    expert, tensor x pipeline group; the gradients are reduced over the data-parallel groups),
    so their OR is too."""
    shared = scalers(optimizer)
    if len(shared) < 2:
        return optimizer
    scaler = shared[0]
    for part in _parts(optimizer):
        if getattr(part, "grad_scaler", None) is not None:
            part.grad_scaler = _SharedScale(scaler)
    prepare_parts = optimizer.prepare_grads  # each part: unscale, check, update its "scaler"

    def prepare_grads() -> bool:
        found_inf = prepare_parts()
        scaler.update(found_inf)
        return found_inf

    optimizer.prepare_grads = prepare_grads  # what ChainedOptimizer.step calls
    return optimizer


class SkippedSteps:
    """Megatron-LM's `loss scale` and `number of skipped iterations` (those of the log interval
    so far), for the log line and the metrics, where the optimizer scales the loss."""

    def __init__(self, optimizer):
        self.enabled = bool(scalers(optimizer))
        self.skipped = 0

    def after_step(self, optimizer, update_successful: bool) -> dict:
        """The metrics of a step: the loss scale now (as Megatron-LM logs it, after the step's
        update of the scale) and the skipped steps of the interval, this one included."""
        if not self.enabled:
            return {}
        self.skipped += 0 if update_successful else 1
        return {LOSS_SCALE: optimizer.get_loss_scale().item(), SKIPPED: self.skipped}

    @staticmethod
    def text(metrics: dict) -> str:
        """The log line's part, as Megatron-LM prints them ("" without loss scaling)."""
        if LOSS_SCALE not in metrics:
            return ""
        return f" | {LOSS_SCALE} {metrics[LOSS_SCALE]:.1f} | {SKIPPED} {metrics[SKIPPED]:d}"

    def logged(self) -> None:
        """The interval was logged: count the next one's from zero."""
        self.skipped = 0
