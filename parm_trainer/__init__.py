"""parm_trainer: Megatron-style MoE pretraining with Parm's dedicated communication schedules."""

import warnings

__version__ = "0.1.0"

# megatron-core and torch repeat these on every rank at every start; they describe optional
# speed-ups (Apex, Transformer Engine, CUDA_DEVICE_MAX_CONNECTIONS) or deprecations inside those
# libraries, never something a parm_trainer user can act on.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "When using sequence parallelism it is recommended to set the environment variable",
    r"`torch.distributed.all_gather_into_tensor` is deprecated",
    r"`torch.distributed.reduce_scatter_tensor` is deprecated",
    "full scope is deprecated",
    r"`load_state_dict` is deprecated",
    "Please use DTensor instead",
):
    warnings.filterwarnings("ignore", message=_message)
