"""The microVM tier (QEMU ``microvm``, own guest kernel, snapshot restore).

``tier`` → ``template`` (the booted, snapshotted guest) → ``qemu`` → ``guest``
(kernel, initramfs, agent); ``rootdisk`` (the image as a disk), ``egress_bridge``.
"""

from .tier import MicroVMSandbox, MicroVMTier

TIER = MicroVMTier

__all__ = ["TIER", "MicroVMSandbox", "MicroVMTier"]
