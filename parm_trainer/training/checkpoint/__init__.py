"""Save and resume with megatron-core's dist_checkpointing, never leaving a half checkpoint.

The files on disk (Megatron-LM's layout, plus run.json and a tokenizer copy) are described in
files.py.

Every tensor is saved in its layout-free global shape (the model's by megatron-core; the
distributed optimizer's in megatron-core's `fully_reshardable` format, one state tensor per
parameter), so a checkpoint loads under any TP/EP/ESP/PP/DP. Loading is strict: before
anything is read, every rank checks the checkpoint's tensor names and shapes against the model's,
and all ranks raise the same error naming the first mismatch.

A save is written to `iter_XXXXXXX.tmp`, and only once every rank has finished is it renamed
and the tracker file replaced (os.replace is atomic). A crash mid-save leaves the previous
checkpoint marked latest and a stray .tmp directory (or a directory newer than the tracker)
that the next start names and the next save removes; a save that fails on any rank (a full
disk) fails on every rank with one line and leaves the previous checkpoint as it was. With
--ckpt-fallback a latest checkpoint that cannot be read gives way to the newest one that can.
With --async-save the shards are written in the background (async_save.py) and the same
verdict, rename and tracker follow at a later iteration, once every rank has written.

    files.py            the files on disk (the tracker, run.json, the tokenizer copy)
    state.py            what a checkpoint holds: the layout, the sharded state, run.json
    save.py, load.py    a save and a load
    async_save.py       --async-save's background writes
    optimizer_state.py  the optimizer's step and state, bridged to megatron-core's
"""

from parm_trainer.training.checkpoint.files import read_description, read_tracker
from parm_trainer.training.checkpoint.load import load_checkpoint
from parm_trainer.training.checkpoint.save import save_checkpoint

__all__ = ["load_checkpoint", "read_description", "read_tracker", "save_checkpoint"]
