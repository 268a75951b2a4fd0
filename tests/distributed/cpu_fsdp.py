"""Test-only: let Accelerate take its FSDP path in CPU processes.

Accelerate turns a ``fsdp_plugin`` into ``DistributedType.FSDP`` only on accelerators (CUDA, XPU,
...); in CPU processes (``MULTI_CPU``, gloo) it drops the plugin. FSDP2 itself runs on CPU with
gloo, so for the tests the state is switched to FSDP after Accelerate set it up; everything after
that (``fully_shard`` in ``prepare``, the sharded checkpoints) is Accelerate's and the Trainer's own
code path. Under CPU offloading (``cpu_offload``) the plugin's ``CPUOffloadPolicy`` is told not to pin
memory, which needs an accelerator (the engine's own offloading test does the same).
"""

from __future__ import annotations

import accelerate.state as accelerate_state
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy


def allow_fsdp_on_cpu() -> None:
    original = accelerate_state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            if isinstance(fsdp_plugin.cpu_offload, CPUOffloadPolicy) and fsdp_plugin.cpu_offload.pin_memory:
                fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
            accelerate_state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate_state.AcceleratorState.__init__ = init
