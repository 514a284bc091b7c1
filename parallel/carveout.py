"""SM carve-out: keep cuBLAS matmuls off a few SMs while collectives overlap them.

`torch._C._set_sm_carveout_experimental(n)` makes cuBLAS(Lt) target `num_SMs - n` SMs (process-wide, read when a
matmul is issued), so that matmuls fit beside NCCL capped at n CTAs. Why and where it is measured: docs/parallel.md.
"""

from __future__ import annotations

import torch

__all__ = ["SMCarveout", "check_sm_carveout"]


def check_sm_carveout(num_sms: int | None) -> int | None:
    """`num_sms` if it is None or an int in [0, SMs of the current GPU); otherwise a ValueError naming the rule."""
    if num_sms is None:
        return None
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
        raise ValueError(f"sm_carveout ({num_sms!r}) must be None or an int >= 0")
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if num_sms >= total:
            raise ValueError(f"sm_carveout ({num_sms}) must be less than the GPU's {total} SMs")
    return num_sms


class SMCarveout:
    """Sets the carve-out on `enter()` and restores what was there before on `exit()`; both idempotent, so a
    wrapper may call `enter()` at every collective it issues and `exit()` wherever the overlap may end."""

    def __init__(self, num_sms: int | None):
        self.num_sms = check_sm_carveout(num_sms)
        self._previous: int | None = None
        self.active = False

    def enter(self) -> None:
        if self.num_sms is None or self.active:
            return
        self._previous = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(self.num_sms)
        self.active = True

    def exit(self) -> None:
        if not self.active:
            return
        torch._C._set_sm_carveout_experimental(self._previous)
        self.active = False
