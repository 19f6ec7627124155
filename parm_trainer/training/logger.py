"""Metrics to the console, tensorboard (--tensorboard-dir) and wandb (--wandb-project).

Only the last rank writes (it holds the loss under pipeline parallelism, as in Megatron-LM).
wandb runs offline unless WANDB_MODE says otherwise or an API key is configured, so a machine
without network still keeps the run under --wandb-save-dir for a later `wandb sync`.
"""

from __future__ import annotations

import json
import os
import sys

import torch


def is_last_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _write_line(message: str) -> None:
    # one write per line, so lines from several ranks sharing a pipe do not interleave
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        _write_line(message)


def print_rank_last(message: str) -> None:
    if not torch.distributed.is_initialized() or is_last_rank():
        _write_line(message)


def _wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = os.path.expanduser("~/.netrc")
    has_key = os.environ.get("WANDB_API_KEY") or (
        os.path.isfile(netrc) and "api.wandb.ai" in open(netrc).read())
    return "online" if has_key else "offline"


class MetricsLogger:
    def __init__(self, args, resumed_at: int = 0):
        """resumed_at: the iteration the run starts after; --log-losses-json keeps what an
        earlier attempt wrote up to it (a restarted job's file covers every iteration)."""
        self.enabled = is_last_rank()
        self.tensorboard = None
        self.wandb = None
        self.history: list[dict] = []
        self.json_path = args.log_losses_json
        if not self.enabled:
            return
        if self.json_path and resumed_at and os.path.isfile(self.json_path):
            with open(self.json_path) as f:
                self.history = [row for row in json.load(f) if row["iteration"] <= resumed_at]
        if args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=100)
        if args.wandb_project:
            import wandb

            save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            # wandb keeps its runs in DIR/wandb/: a save directory named wandb is that folder
            if os.path.basename(os.path.normpath(save_dir)) == "wandb":
                save_dir = os.path.dirname(os.path.normpath(save_dir)) or "."
            config = {k: v for k, v in vars(args).items()
                      if isinstance(v, (int, float, str, bool, list, type(None)))}
            self.wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name,
                                    dir=save_dir, config=config, mode=_wandb_mode())

    def scalars(self, iteration: int, values: dict, prefix: str = "") -> None:
        if not self.enabled:
            return
        named = {f"{prefix}{k}": float(v) for k, v in values.items() if v is not None}
        if self.tensorboard is not None:
            for key, value in named.items():
                self.tensorboard.add_scalar(key, value, iteration)
        if self.wandb is not None:
            self.wandb.log(named, step=iteration)

    def record(self, iteration: int, values: dict) -> None:
        """Keep every iteration's losses for --log-losses-json (tests compare layouts with it);
        a tensor value (the tokens per expert) is kept as nested lists."""
        if self.enabled and self.json_path:
            self.history.append({"iteration": iteration, **{
                k: v.tolist() if torch.is_tensor(v) else float(v) for k, v in values.items()}})

    def write_json(self) -> None:
        """--log-losses-json as recorded so far, replaced atomically."""
        if self.enabled and self.json_path:
            with open(self.json_path + ".tmp", "w") as f:
                json.dump(self.history, f, indent=1)
            os.replace(self.json_path + ".tmp", self.json_path)

    def close(self) -> None:
        if not self.enabled:
            return
        self.write_json()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        sys.stdout.flush()
