"""The wasm tier: CPython compiled to WebAssembly, run by wasmtime, no OS underneath.

``tier`` (the tier) → ``sandbox`` (one sandbox) → ``process`` (one command seen from the host),
``files`` (files API), ``python`` (which commands exist, boot program),
``standby`` (standby guests: started before their sandbox exists), ``runtime`` (runtime,
module cache, worker pool) → ``worker`` (the worker process, run as a script).
"""

from .sandbox import WasmSandbox
from .tier import WasmTier

TIER = WasmTier

__all__ = ["TIER", "WasmSandbox", "WasmTier"]
