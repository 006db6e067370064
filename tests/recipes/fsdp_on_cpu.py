"""recipes/train.py under FSDP on CPU processes (gloo), for tests:

    ACCELERATE_USE_CPU=1 accelerate launch --config_file <fsdp2.yaml with use_cpu: true> tests/recipes/fsdp_on_cpu.py
        --config ...

torch's `fully_shard` runs on CPU over gloo, but accelerate 1.15 turns FSDP on only for accelerator devices
(`AcceleratorState` picks FSDP among MULTI_GPU, MULTI_NPU, ...): with the FSDP config and `use_cpu: true` each process
trains alone (DistributedType.NO), and with ACCELERATE_USE_CPU=1 too they run as DDP (MULTI_CPU), the FSDP plugin
ignored. This script flips that one choice, MULTI_CPU with an FSDP plugin becoming FSDP, and runs the recipe
unchanged: accelerate's own FSDP2 code prepares, clips, saves and gathers.
"""

import sys
from pathlib import Path

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import train  # noqa: E402

_init = AcceleratorState.__init__


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


AcceleratorState.__init__ = _init_with_fsdp_on_cpu

if __name__ == "__main__":
    train.follow_launcher()
    sys.exit(train.main())
