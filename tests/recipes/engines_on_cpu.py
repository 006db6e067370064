"""recipes/train.py under FSDP or DeepSpeed on CPU processes (gloo), for tests:

    ACCELERATE_USE_CPU=1 accelerate launch --config_file <fsdp2.yaml, use_cpu: true> tests/recipes/engines_on_cpu.py
        --config ...
    accelerate launch --config_file <deepspeed_zero{2,3}.yaml> tests/recipes/engines_on_cpu.py --config ...

torch's `fully_shard` and DeepSpeed (its CPU accelerator) run on CPU over gloo, but accelerate 1.15 picks those engines
only on accelerator devices, and silently does something else on CPU:
- FSDP: `AcceleratorState` turns FSDP on only for MULTI_GPU, MULTI_NPU, ...: with the FSDP config and `use_cpu: true`
  each process trains alone (DistributedType.NO, 1 process), and with ACCELERATE_USE_CPU=1 too they run as DDP
  (MULTI_CPU), the FSDP plugin ignored.
- DeepSpeed: `PartialState` finds no device backend, so each process trains alone (DeepSpeed with 1 process); with
  ACCELERATE_USE_CPU=1 `AcceleratorState` skips DeepSpeed and they run as DDP.
This script flips those two choices (MULTI_CPU with an FSDP plugin becomes FSDP; a launched DeepSpeed process with no
backend gets gloo) and runs the recipe unchanged: accelerate's own FSDP2 and DeepSpeed code prepares, clips, saves and
gathers.
"""

import os
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from path_hf.recipes import train
from tests.recipes import teardown

_init = AcceleratorState.__init__
_prepare_backend = PartialState._prepare_backend


def _init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU and fsdp_plugin is not None:
        self.fsdp_plugin = fsdp_plugin
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def _prepare_backend_with_deepspeed_on_cpu(self, cpu=False, sagemaker_dp=False, backend=None):
    chosen = _prepare_backend(self, cpu, sagemaker_dp, backend)
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    if chosen[1] == DistributedType.NO and launched and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        return "gloo", DistributedType.MULTI_CPU
    return chosen


AcceleratorState.__init__ = _init_with_fsdp_on_cpu
PartialState._prepare_backend = _prepare_backend_with_deepspeed_on_cpu

if __name__ == "__main__":
    teardown.install()  # and the order of the teardown is checked, as in the DDP runs
    train.follow_launcher()
    sys.exit(train.main())
