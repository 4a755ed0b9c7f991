"""The microVM tier (QEMU ``microvm``, own guest kernel, snapshot restore).

``tier`` → ``sandbox`` (one VM) → ``template`` (the booted, snapshotted guest) → ``qemu`` → ``guest``
(kernel, initramfs, agent); ``rootdisk`` (the image as a disk), ``egress_bridge``.
"""

from .sandbox import MicroVMSandbox
from .tier import MicroVMTier

TIER = MicroVMTier

__all__ = ["TIER", "MicroVMSandbox", "MicroVMTier"]
