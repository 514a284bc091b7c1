"""Which tuned file the attention kernels read, decided at import with the standard library only, so that a
`RAYSYS_FLASH_TUNED` naming no file fails before torch is imported (`kernels.attention` imports this first)."""

from __future__ import annotations

import os
from pathlib import Path

TUNED_ENV = "RAYSYS_FLASH_TUNED"
"""A tuned file to read instead of the committed one (read at import)."""

COMMITTED_TUNED_PATH = Path(__file__).parent / "triton" / "tuned.json"
TUNED_CONFIGS_PATH = Path(os.environ.get(TUNED_ENV) or COMMITTED_TUNED_PATH)
"""The tuned file the kernels read: `RAYSYS_FLASH_TUNED` when set (at import), else the committed one."""
if not TUNED_CONFIGS_PATH.is_file() and os.environ.get(TUNED_ENV):  # a typo must not mean "untuned"
    raise ValueError(f"{TUNED_ENV} ({TUNED_CONFIGS_PATH}) names no file; unset it to read the committed "
                     f"{COMMITTED_TUNED_PATH.name}")
