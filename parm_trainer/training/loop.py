"""pretrain(): the Megatron-LM training loop on megatron-core, for any MoE model provider.

    torchrun --nproc-per-node 4 pretrain_gpt_moe.py --tensor-model-parallel-size 2 ...

One iteration runs megatron's pipeline schedule (no pipelining, 1F1B with
--pipeline-model-parallel-size > 1, interleaved 1F1B over the model chunks of a rank with
virtual stages) over the global batch's micro-batches, finalises gradients
(DP all-reduce, sequence-parallel norms, tied embeddings), checks the loss is finite on every
rank, then steps the optimizer and the LR schedule (neither, under --fp16, where the gradients
overflowed: loss_scale.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size, get_num_microbatches, update_num_microbatches)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import moe_utils

from parm_trainer import mtp_flags
from parm_trainer.errors import NonFiniteLossError
from parm_trainer.models.config import pattern_with_mtp, transformer_config
from parm_trainer.parallel import destroy_distributed, rank_device
from parm_trainer.planning import batch_schedule
from parm_trainer.planning.paired_microbatches import not_applied as pairs_not_applied
from parm_trainer.training import (checkpoint, faults, loss_scale, manual_gc, memory,
                                   memory_probe, microbatch_overlap, mtp_losses, param_gather,
                                   watchdog)
from parm_trainer.training.checkpoint import async_save
from parm_trainer.training import timers as run_timers
from parm_trainer.training.data import cycle, micro_batch_iterator
from parm_trainer.training.exit_request import ExitRequest
from parm_trainer.training.expert_tokens import ExpertTokenCounter, format_expert_tokens
from parm_trainer.training.flops import flops_per_iteration
from parm_trainer.training.logger import MetricsLogger, print_rank_0, print_rank_last
from parm_trainer.training.setup import build_model, build_optimizer, wire_config

MOE_LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss",
                  "global_load_balancing_loss", "z_loss")
PER_LAYER = "moe losses per layer"  # --moe-per-layer-logging: {name: [each layer's value]}
LOSS_SCALE_KEYS = (loss_scale.LOSS_SCALE, loss_scale.SKIPPED)  # their own place on the line




def _reduce_losses(losses: list, names: tuple) -> dict:
    """Sum each named (sum, count) pair over micro-batches and data-parallel ranks -> mean.

    Only the last pipeline stage has losses; the result is broadcast to every rank so that all
    of them see the same value (and the same NaN check)."""
    total = torch.zeros(len(names), 2, dtype=torch.float64, device=rank_device())
    for item in losses:
        for row, name in enumerate(names):
            if name in item:
                total[row] += item[name].detach().double().to(total.device)
    if parallel_state.is_pipeline_last_stage():
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    # Other stages hold zeros: a sum over the pipeline gives every rank the last stage's value.
    torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    total = total.cpu()
    return {name: (total[row, 0] / total[row, 1]).item() if total[row, 1] > 0 else float("nan")
            for row, name in enumerate(names)}


def _moe_loss_names() -> list:
    """The router losses tracked on any pipeline stage, the same list on every rank (asked
    once): a stage without MoE layers tracks none, yet megatron's reduction all-reduces each
    one over the pipeline, so that stage must join in with zeros."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    local = [name for name in MOE_LOSS_NAMES if name in tracker]
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return local
    gathered = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local, group=group)
    return [name for name in MOE_LOSS_NAMES if any(name in names for names in gathered)]


def _moe_losses(num_microbatches: int, moe_layers: int, names: list, num_layers: int,
                per_layer: bool = False) -> dict:
    """Mean over MoE layers of megatron's tracked router losses (unscaled by their coeffs);
    with per_layer also each layer's (0 for dense layers), under PER_LAYER."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    device = rank_device()
    for name in names:  # this stage's share of a loss only other stages' layers have: zeros
        tracker.setdefault(name, {"values": torch.zeros(num_layers, device=device)})
    if not names:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    out = {name: (tracker[name]["values"].sum() / num_microbatches / moe_layers).item()
           for name in names}
    if per_layer:
        out[PER_LAYER] = {name: (tracker[name]["values"] / num_microbatches).tolist()
                          for name in names}
    moe_utils.clear_aux_losses_tracker()
    return out


class Trainer:
    def __init__(self, args, model_provider: Callable, datasets_provider: Callable,
                 forward_step: Callable, loss_names: tuple = ("lm loss",)):
        self.args = args
        self.forward_step = forward_step
        self.loss_names = loss_names  # what the loss function reports; "lm loss" first
        torch.manual_seed(args.seed)
        model_parallel_cuda_manual_seed(args.seed)
        watchdog.start(args)
        self.exit_request = ExitRequest.of(args, rank_device())
        self.config = transformer_config(args)
        self.timers = run_timers.build_timers(args)  # None at --timing-log-level 0
        self.config.timers, self.config.barrier_with_L1_time = (self.timers,
                                                                args.barrier_with_L1_time)
        self.memory_before = memory.local_peak_bytes()  # the libraries, the process groups
        batch_schedule.start(args, torch.distributed.get_rank())
        self.model = build_model(args, self.config, model_provider)
        self.optimizer, self.scheduler = build_optimizer(args, self.model, self.timers)
        wire_config(self.config, self.model, self.optimizer)
        manual_gc.freeze_startup()  # saves and loads collect only what came after
        if param_gather.overlapped(self.model):  # read from megatron-core's DDP itself
            print_rank_0("--overlap-param-gather: the updated parameters are gathered bucket by "
                         "bucket in the next forward pass (megatron-core DDP's pre-hooks)")
        self.skipped_steps = loss_scale.SkippedSteps(self.optimizer)
        self.iteration, self.consumed, self.probed = 0, 0, False
        self.background_saves = (async_save.BackgroundSaves(self._saved, print_rank_0)
                                 if args.async_save and args.save else None)
        if args.load:
            self._load()
        self.datasets = datasets_provider(args, self._num_samples())
        self.logger = MetricsLogger(args, resumed_at=self.iteration)
        # the decoder's layers, then the MTP layers (megatron numbers them on: the trackers)
        self.layer_pattern = pattern_with_mtp(args)
        self.num_moe_layers = sum(self.layer_pattern)
        self.mtp_layers = mtp_flags.num_layers(args)
        self.moe_loss_names = None  # _moe_loss_names(), once the routers have run
        self.expert_tokens = (ExpertTokenCounter(self.model, len(self.layer_pattern),
                                                 args.num_experts)
                              if self.num_moe_layers else None)
        self.flops_per_sample = flops_per_iteration(args, batch_size=1)
        why = pairs_not_applied(args)
        if args.overlap_moe_expert_parallel_comm and why:
            print_rank_0(f"--overlap-moe-expert-parallel-comm: one micro-batch at a time here: "
                         f"{why}")
        estimate = getattr(args, "memory_estimate", None)  # initialize.report_memory's
        self._estimate = (f"estimate {max(r['total'] for r in estimate) / 2**20:.1f} MiB"
                          if estimate else "no estimate")

    def _load(self):
        args = self.args
        if checkpoint.read_tracker(args.load) is None:
            print_rank_0(f"no checkpoint in --load {args.load}: starting from scratch")
            return
        self.iteration, self.consumed, notes = checkpoint.load_checkpoint(
            args.load, self.model, self.optimizer, self.scheduler,
            load_optimizer=not (args.no_load_optim or args.finetune),
            load_rng=not (args.no_load_rng or args.finetune), fallback=args.ckpt_fallback)
        for note in notes:
            print_rank_0(note)
        if args.finetune:
            print_rank_0(f"finetuning from the weights of {args.load} (iteration "
                         f"{self.iteration}), starting at iteration 0")
            self.iteration, self.consumed, self.probed = 0, 0, False
        else:
            print_rank_0(f"resumed from {args.load} at iteration {self.iteration}")

    def _num_samples(self):
        """Samples per split, as Megatron-LM asks (evaluation in full global batches), the
        training split at least what the iterations take (a ramp-up may pass
        --train-samples)."""
        a = self.args
        evals = a.train_iters // a.eval_interval + 1
        train = max(a.train_samples or 0, batch_schedule.planned_samples(a))
        return (train, evals * a.eval_iters * a.global_batch_size,
                a.eval_iters * a.global_batch_size)

    def _run_schedule(self, iterator, forward_only: bool, probe=None):
        """iterator: one per model chunk (a list) under interleaved 1F1B. probe: the memory
        probe around this call, whose hooks the overlapped micro-batches' threads enter too."""
        a = self.args  # training: this iteration's micro-batches (ramp-up); evaluation: all
        micro = a.num_microbatches if forward_only else get_num_microbatches()
        if microbatch_overlap.usable(a, forward_only, micro):
            schedule = functools.partial(microbatch_overlap.forward_backward_overlapped,
                                         around=probe.hooks if probe is not None else None)
        else:
            schedule = get_forward_backward_func()
        return schedule(
            forward_step_func=self.forward_step, data_iterator=iterator, model=self.model,
            num_microbatches=micro, seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size, forward_only=forward_only)

    def train_step(self, iterator, report_moe: bool = True) -> dict:
        """One iteration. report_moe: reduce the routers' losses over the ranks for the
        metrics (a few collectives); otherwise they are only cleared."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        faults.at_iteration(self.iteration + 1)
        watchdog.beat(self.iteration + 1, "forward-backward")
        probe = (memory_probe.SavedActivations(self.model)
                 if self.args.memory_probe and not self.probed else None)
        with probe or contextlib.nullcontext():
            schedule_losses = self._run_schedule(iterator, forward_only=False, probe=probe)
        losses = _reduce_losses(schedule_losses, self.loss_names)
        if faults.nan_at(self.iteration + 1):
            losses["lm loss"] = float("nan")
        watchdog.beat(self.iteration + 1, "optimizer step")
        # Megatron-LM: under dynamic loss scaling a non-finite loss is the scaler's to handle
        # (its gradients overflow: the step is skipped, the scale lowered), not an error
        checked = {} if loss_scale.dynamic(self.args) else losses
        for name, loss in checked.items():
            if not math.isfinite(loss):
                self._finish_saves()  # every rank stops here: the save out is recorded first
                raise NonFiniteLossError(
                    f"{'loss' if name == 'lm loss' else name} is {loss} at iteration "
                    f"{self.iteration + 1}; no update was applied "
                    f"(last checkpoint: {self.args.save or 'none'})")
        if self.timers is not None:
            self.timers("optimizer", log_level=1).start(barrier=self.args.barrier_with_L1_time)
        updated, grad_norm, _ = self.optimizer.step()  # not updated: fp16 gradients overflowed
        if self.timers is not None:
            self.timers("optimizer").stop()
        if updated:  # as Megatron-LM's train_step, a skipped step leaves the LR schedule alone
            self.scheduler.step(increment=get_current_global_batch_size())  # counts samples
        if self.args.memory_probe and not self.probed:
            self.probed = True
            for line in memory_probe.report(self.args, self.model, self.optimizer,
                                            probe.peak_bytes):
                print_rank_0(line)
        metrics = {**losses, "lr": self.scheduler.get_lr(self.optimizer.param_groups[0]),
                   "grad norm": grad_norm if grad_norm is not None else float("nan"),
                   **self.skipped_steps.after_step(self.optimizer, updated)}
        if self.num_moe_layers and report_moe:
            if self.moe_loss_names is None:
                self.moe_loss_names = _moe_loss_names()
            metrics.update(_moe_losses(get_num_microbatches(), self.num_moe_layers,
                                       self.moe_loss_names, len(self.layer_pattern),
                                       getattr(self.args, "moe_per_layer_logging", False)))
            metrics["tokens per expert"] = self.expert_tokens.collect()
        elif self.num_moe_layers:
            moe_utils.clear_aux_losses_tracker()
            self.expert_tokens.reset()
        if self.mtp_layers and report_moe:  # Megatron-LM's "mtp_1 loss", ...
            metrics.update(mtp_losses.collect(self.mtp_layers, get_num_microbatches()))
        elif self.mtp_layers:
            mtp_losses.clear()
        return metrics

    def evaluate(self, iterator) -> dict:
        watchdog.beat(self.iteration, "evaluation")
        for chunk in self.model:
            chunk.eval()
        losses = []
        self.config.timers = None  # the timing report covers training iterations only
        with torch.no_grad(), param_gather.gathered(self.model), \
                manual_gc.around_evaluation(self.args):
            for _ in range(self.args.eval_iters):
                losses.extend(self._run_schedule(iterator, forward_only=True))
        self.config.timers = self.timers
        for chunk in self.model:
            chunk.train()
        if self.num_moe_layers:
            moe_utils.clear_aux_losses_tracker()
        result = _reduce_losses(losses, self.loss_names)
        return {**result, "ppl": math.exp(min(20.0, result["lm loss"]))}

    def save(self):
        if self.args.save:
            with param_gather.gathered(self.model):  # the weights the last step made
                path, seconds = checkpoint.save_checkpoint(
                    self.args.save, self.iteration, self.model, self.optimizer,
                    self.scheduler, self.consumed, self.args, background=self.background_saves)
            if self.background_saves is None:
                print_rank_0(f"saved checkpoint {path} in {seconds:.2f} s")
            else:
                print_rank_0(f"saving checkpoint {path} in the background (training went on "
                             f"after {seconds:.2f} s)")

    def _saved(self, path: str, seconds: float, held: float, iteration: int):
        print_rank_0(f"saved checkpoint {path} in {seconds:.2f} s (in the background, finalised "
                     f"at iteration {iteration}; training waited {held:.2f} s)")

    def _finish_saves(self):
        """--async-save: wait for the save out and finalise it (every rank calls this)."""
        if self.background_saves is not None:
            self.background_saves.wait(self.iteration)

    def _log(self, metrics: dict, seconds_per_iter: float, iterations: int):
        a = self.args
        peak_mib, grown = memory.peak_mib(self.memory_before)  # collective, like the timings
        report = (run_timers.interval_report(self.timers, iterations)
                  if self.timers is not None else {})
        batch = (self.consumed - self.logged_consumed) / iterations  # mean over a ramp-up
        self.logged_consumed = self.consumed
        tokens_per_s = batch * a.seq_length / seconds_per_iter
        tflops = self.flops_per_sample * batch / seconds_per_iter / a.world_size / 1e12
        eta = (a.train_iters - self.iteration) * seconds_per_iter
        per_layer = metrics.get(PER_LAYER, {})
        scalars = {k: v for k, v in metrics.items() if k not in ("tokens per expert", PER_LAYER)}
        extra = "".join(f" | {k} {v:.4f}" for k, v in scalars.items()
                        if k not in ("lm loss", "lr", "grad norm", "global batch size",
                                     *LOSS_SCALE_KEYS))
        throughput = (f" | throughput per GPU (TFLOP/s/GPU): {tflops:.1f}"  # Megatron-LM's words
                      if a.log_throughput else "")
        ramp = (f" | global batch size {metrics['global batch size']}"
                if "global batch size" in metrics else "")
        print_rank_last(
            f"iteration {self.iteration:6d}/{a.train_iters} | lm loss {metrics['lm loss']:.6f} | "
            f"lr {metrics['lr']:.3e}{ramp} | grad norm {metrics['grad norm']:.3f}"
            f"{self.skipped_steps.text(metrics)}{extra} | "
            f"ms/iter {seconds_per_iter * 1e3:.1f} | tokens/s {tokens_per_s:.0f} | "
            f"TFLOP/s/device {tflops:.4f}{throughput} | ETA {eta / 60:.1f} min | "
            f"peak {memory.KIND} {peak_mib:.1f} MiB (of it {grown:.1f} since the model was "
            f"built: {self._estimate})")
        if report:
            print_rank_last(run_timers.format_report(report, a.timing_log_option))
        if per_layer:  # Megatron-LM's names: moe/<loss>_layer_<n>
            layers = [i for i, moe in enumerate(self.layer_pattern) if moe]
            print_rank_last(f"router losses per MoE layer at iteration {self.iteration} | "
                            + " | ".join(f"layer {i + 1}: " + ", ".join(
                                f"{name} {values[i]:.4f}" for name, values in per_layer.items())
                                for i in layers))
            scalars.update({f"moe/{name}_layer_{i + 1}": values[i]
                            for name, values in per_layer.items() for i in layers})
        if "tokens per expert" in metrics:
            table = metrics["tokens per expert"]
            print_rank_last(f"tokens per expert at iteration {self.iteration} | "
                            f"{format_expert_tokens(table)}")
            scalars.update({f"tokens_per_expert/layer{layer + 1}/expert{expert}": count
                            for layer, row in enumerate(table.tolist()) if any(row)
                            for expert, count in enumerate(row)})
        if a.log_throughput:
            self.logger.scalars(self.iteration, {"throughput": tflops})  # Megatron-LM's tag
        self.logger.scalars(self.iteration, {**scalars, "tokens_per_s": tokens_per_s,
                                             "tflops_per_device": tflops,
                                             "peak_memory_mib": peak_mib}, prefix="train/")
        self.logger.scalars(self.iteration, run_timers.max_over_ranks(report), prefix="time_ms/")
        self.logger.write_json()
        self.skipped_steps.logged()

    def _validate(self, valid_iterator, label="validation"):
        result = self.evaluate(valid_iterator)
        print_rank_last(f"{label} at iteration {self.iteration} | "
                        + " | ".join(f"{k} {v:.6f}" if k != "ppl" else f"ppl {v:.3f}"
                                     for k, v in result.items()))
        self.logger.scalars(self.iteration, result, prefix="valid/")
        self.last_validation = result
        return result

    def _logs_at(self, iteration: int) -> bool:
        return iteration % self.args.log_interval == 0 or iteration == self.args.train_iters

    def _per_chunk(self, make):
        """An iterator for the schedule: make()'s, or under interleaved 1F1B one per model
        chunk, each the same sequence of micro-batches (every chunk's forward step reads the
        micro-batch it runs, in order)."""
        iterators = [make() for _ in self.model]
        return iterators if len(iterators) > 1 else iterators[0]

    def train(self):
        a = self.args
        train_ds, valid_ds, _ = self.datasets

        def train_batches():
            batches = micro_batch_iterator(train_ds, self.consumed, a.micro_batch_size,
                                           a.num_workers)
            if self.timers is not None:
                batches = run_timers.TimedIterator(batches, self.timers)
            return batches

        train_iterator = self._per_chunk(train_batches)
        valid_iterator = self._per_chunk(
            lambda: cycle(lambda: micro_batch_iterator(valid_ds, 0, a.micro_batch_size)))
        first = self._validate(valid_iterator, "validation (start)") if a.eval_iters else None
        manual_gc.start(a)
        self.logged_consumed = self.consumed  # the samples of each log window: tokens/s
        window_start, window_iters = time.perf_counter(), 0
        stop = None  # why the run ends early (ExitRequest), if it does
        while self.iteration < a.train_iters:
            update_num_microbatches(self.consumed, consistency_check=True)  # ramp-up's size
            logs_now = self._logs_at(self.iteration + 1)
            # every rank takes the same branch: the MoE metrics are reduced collectively
            metrics = self.train_step(train_iterator,
                                      report_moe=logs_now or bool(self.logger.json_path))
            self.iteration += 1
            self.consumed += get_current_global_batch_size()
            if a.rampup_batch_size is not None:  # the log line's, as Megatron-LM's
                metrics["global batch size"] = get_current_global_batch_size()
            manual_gc.after_iteration(a, self.iteration)
            window_iters += 1
            self.logger.record(self.iteration, {k: v for k, v in metrics.items()
                                                if k != PER_LAYER})
            if logs_now:
                now = time.perf_counter()
                self._log(metrics, (now - window_start) / window_iters, window_iters)
                window_start, window_iters = now, 0
            paused = time.perf_counter()  # evaluation and saves are not training time
            if self.background_saves is not None:
                self.background_saves.poll(self.iteration)  # finalise a save all have written
            if a.eval_iters and self.iteration % a.eval_interval == 0:
                self._validate(valid_iterator)
            if a.save_interval and self.iteration % a.save_interval == 0:
                self.save()
            window_start += time.perf_counter() - paused
            if a.exit_interval and self.iteration % a.exit_interval == 0:
                break
            stop = self.exit_request.due() if self.exit_request else None
            if stop:
                print_rank_0(f"exiting after iteration {self.iteration}: {stop}"
                             + (", saving a checkpoint here" if a.save else ""))
                break
        last = None
        if a.eval_iters and not stop:
            validated_now = self.iteration % a.eval_interval == 0
            last = self.last_validation if validated_now else self._validate(
                valid_iterator, "validation (end)")
        if a.save and not (a.save_interval and self.iteration % a.save_interval == 0):
            self.save()
        self._finish_saves()
        param_gather.finish(self.model)
        manual_gc.end(a)
        if self.exit_request:
            self.exit_request.release()
        if first and last:
            print_rank_last(f"validation lm loss: start {first['lm loss']:.4f} -> "
                            f"end {last['lm loss']:.4f}")
        self.logger.close()


def pretrain(args, model_provider: Callable, datasets_provider: Callable,
             forward_step: Callable, loss_names: tuple = ("lm loss",)) -> None:
    """Set up from the parsed flags (distributed state must be initialised) and train.
    forward_step's loss function reports a (sum, count) pair under each of loss_names."""
    trainer = Trainer(args, model_provider, datasets_provider, forward_step, loss_names)
    trainer.train()
    watchdog.stop()
    # Orderly shutdown: a process group left to the interpreter's exit can abort a rank
    # ("terminate called without an active exception") while gloo's threads are torn down.
    del trainer
    torch.distributed.barrier()
    destroy_distributed()
