"""glibc's malloc before and after cpu_allocator.tune(), in a process of its own
(tests/test_grouped_experts.py): prints JSON {tuned, before, after}, each with the bytes a
block added to the mmapped regions (hblkhd) and, once freed, to the heap's free space
(fordblks), from mallinfo2. Before: 16 MiB, which also raises glibc's dynamic threshold to
16 MiB; after: 24 MiB, above that threshold and below the tuned one (32 MiB)."""

import ctypes
import json

from parm_trainer.compat import cpu_allocator

MIB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = _Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)


def block(size: int) -> dict:
    """A block allocated, written, freed: where it was, and what freeing it left."""
    start = libc.mallinfo2()
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    held = libc.mallinfo2()
    libc.free(pointer)
    freed = libc.mallinfo2()
    return {"mmapped": held.hblkhd - start.hblkhd, "kept_free": freed.fordblks - start.fordblks}


before = block(16 * MIB)
tuned = cpu_allocator.tune() and cpu_allocator.tune()  # a second call changes nothing
print(json.dumps({"tuned": tuned, "before": before, "after": block(24 * MIB)}))
