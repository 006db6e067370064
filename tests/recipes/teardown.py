"""recipes/train.py as the multi-process tests launch it: the recipe unchanged, and a check of the order of its
teardown.

    accelerate launch ... tests/recipes/teardown.py --config ...

The process group must outlive every distributed wrapper of the model. A DDP model freed after the group was destroyed
drops, in its reducer's destructor, the last reference to the gloo group while holding the GIL; the group's destructor
then joins its worker thread, which may be waiting for the GIL to finish the last collective: the process hangs after
its work is done (pytorch/pytorch#56297, seen in CI). Here destroying the default process group fails the run
if a DDP, FSDP2 or DeepSpeed wrapper still exists then, reachable or only garbage not yet collected (the check itself
collects nothing: a collection here would hide a teardown that does not collect).
"""

from __future__ import annotations

import gc
import sys

import torch.distributed
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from path_hf.recipes import train

_destroy_process_group = torch.distributed.destroy_process_group


def distributed_wrappers() -> list[str]:
    """The type names of the DDP, FSDP2 and DeepSpeed engine objects that exist now, collected or not."""
    kinds: tuple[type, ...] = (DistributedDataParallel, FSDPModule)
    if "deepspeed" in sys.modules:
        from deepspeed import DeepSpeedEngine

        kinds += (DeepSpeedEngine,)
    return [type(obj).__name__ for obj in gc.get_objects() if isinstance(obj, kinds)]


def _checked_destroy_process_group(group=None) -> None:
    if group is None and (alive := distributed_wrappers()):
        raise RuntimeError(
            f"the default process group is destroyed while {', '.join(sorted(set(alive)))} objects still exist: "
            "release the prepared model (and collect it) before accelerator.end_training()"
        )
    _destroy_process_group(group)


def install() -> None:
    """Make `torch.distributed.destroy_process_group` (which accelerate's `end_training` calls) check the order."""
    torch.distributed.destroy_process_group = _checked_destroy_process_group


if __name__ == "__main__":
    install()
    train.follow_launcher()
    sys.exit(train.main())
