"""--moe-router-force-load-balancing in Parm's layer: the router routes on random logits.

megatron-core draws them from its expert-parallel RNG stream, which differs between the ranks
of one MP group; where Parm gates every MP rank's whole token set (baseline, s2) those ranks
must route alike. Here each layer draws from a generator of its own seeded by the layer number
and the data-parallel rank, so the ranks of one MP group draw the same numbers call after call.
The gradient passes straight through to the real logits, as megatron's RandomSTE does.
"""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state


class ForcedLogits:
    def __init__(self, layer_number):
        self.layer_number = layer_number
        self.generator = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.generator is None or self.generator.device != logits.device:
            seed = zlib.crc32(f"force-balance|{self.layer_number}|"
                              f"{parallel_state.get_data_parallel_rank()}".encode())
            self.generator = torch.Generator(device=logits.device).manual_seed(seed)
        random = torch.randn(logits.shape, generator=self.generator, device=logits.device,
                             dtype=torch.float32).to(logits.dtype)
        return logits + (random - logits).detach()  # random values, the logits' gradient
