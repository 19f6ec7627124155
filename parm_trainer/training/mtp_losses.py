"""The multi-token prediction losses of an iteration, as Megatron-LM logs them.

megatron-core's GPTModel adds each MTP layer's loss (its mean over the micro-batch's tokens)
to MTPLossLoggingHelper's tracker on the stage that holds the MTP layers; Megatron-LM's
training_log averages it over the data-parallel ranks (reduce_loss_in_tracker), divides by the
micro-batches (track_mtp_metrics' loss_scale) and names it "mtp_1 loss", "mtp_2 loss", ...
Here the same, and shared over the pipeline so that every rank holds the values (the log line
is the last rank's, the losses JSON rank 0's).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from parm_trainer.parallel import rank_device


def names(mtp_num_layers: int) -> list:
    return [f"mtp_{i + 1} loss" for i in range(mtp_num_layers)]


def collect(mtp_num_layers: int, num_microbatches: int) -> dict:
    """{"mtp_k loss": value} for this iteration, then the tracker cleared. Collective over the
    data-parallel and pipeline groups: every rank calls it."""
    tracker = MTPLossLoggingHelper.tracker
    values = torch.zeros(mtp_num_layers, device=rank_device())
    if "values" in tracker:  # the stage with the MTP layers
        MTPLossLoggingHelper.reduce_loss_in_tracker()
        values += tracker["values"].to(values.device)
    pipeline = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(pipeline) > 1:
        torch.distributed.all_reduce(values, group=pipeline)  # the other stages add zeros
    clear()
    return dict(zip(names(mtp_num_layers), (values / num_microbatches).tolist()))


def clear() -> None:
    """Forget the tracked MTP losses (an iteration not reported, an evaluation)."""
    if "values" in MTPLossLoggingHelper.tracker:
        MTPLossLoggingHelper.clean_loss_in_tracker()
