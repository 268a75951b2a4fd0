"""DeepSpeed's start-up notice on a machine without an accelerator, left out.

Importing DeepSpeed (the HF Trainer does, when it is installed) logs "Setting accelerator to CPU.
If you have GPU or other accelerator, we were unable to detect it." Where torch itself sees no
accelerator, CPU is the only choice and the line only alarms; it is filtered out then, and only
then (with a GPU torch cannot reach, it still shows). Nothing else DeepSpeed logs is touched.
"""

from __future__ import annotations

import logging

import torch

#: The name of DeepSpeed's logger (``deepspeed.utils.logging``), and the start of the notice.
DEEPSPEED_LOGGER = "DeepSpeed"
CPU_FALLBACK_NOTICE = "Setting accelerator to CPU."


def _keep(record: logging.LogRecord) -> bool:
    """The filter: every record but the notice (logging keeps a record when this is true)."""
    return not str(record.msg).startswith(CPU_FALLBACK_NOTICE)


def leave_out_cpu_fallback_notice() -> None:
    """Filter the notice out of DeepSpeed's logger when torch sees no accelerator (idempotent; the
    logger need not exist yet: DeepSpeed configures the same logger object when it is imported)."""
    if torch.accelerator.is_available():
        return
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if _keep not in logger.filters:
        logger.addFilter(_keep)
