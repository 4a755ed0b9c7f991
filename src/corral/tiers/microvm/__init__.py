"""The microVM tier (QEMU ``microvm``, own guest kernel, snapshot restore)."""

from .tier import MicroVMSandbox, MicroVMTier

__all__ = ["MicroVMSandbox", "MicroVMTier"]
