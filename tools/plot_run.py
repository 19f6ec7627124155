"""python tools/plot_run.py RUN_DIR [--tensorboard-dir DIR] [--out-dir DIR]

Draws a training run as PNGs (parm_trainer/plots.py): loss, throughput and memory, each MoE
layer's expert load over time, and the step-time breakdown of --timing-log-level 1 or 2.
RUN_DIR is the folder the training scripts write (scripts/train_gpt_moe.sh RUN_DIR=...): the
scalars are read from RUN_DIR/tensorboard, the pictures go to RUN_DIR/plots. Prints each path.
"""

from __future__ import annotations

import argparse
import os
import sys

from parm_trainer.plots import RunDataError, plot_run, read_scalars


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="the run's folder (holding tensorboard/)")
    p.add_argument("--tensorboard-dir", default=None, help="default RUN_DIR/tensorboard")
    p.add_argument("--out-dir", default=None, help="default RUN_DIR/plots")
    args = p.parse_args(argv)
    try:
        scalars = read_scalars(args.tensorboard_dir or os.path.join(args.run_dir, "tensorboard"))
        paths = plot_run(scalars, args.out_dir or os.path.join(args.run_dir, "plots"))
    except RunDataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
