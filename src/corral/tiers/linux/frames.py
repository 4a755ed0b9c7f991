"""The agent protocol's frames (``src/corral/agent/agent.h``): ``u8 type | u32 id | u32 len | payload``.

Requests the host sends (below 100) and what the agent answers (100 and up).
"""

from __future__ import annotations

import struct

T_EXEC, T_GO, T_STDIN, T_STDIN_EOF, T_SIGNAL, T_EXEC_PTY, T_RESIZE, T_EXEC_SPARE = 1, 2, 3, 4, 5, 6, 7, 8
T_FREAD, T_FWRITE, T_FAPPEND, T_FLIST, T_FREMOVE, T_FMKDIR, T_FSTAT = 10, 11, 12, 13, 14, 15, 16
#: the microVM guest around a live snapshot (agent's guest_ops.c)
T_GUEST = 17
#: ``sandbox.files.write``: a whole file, replaced at once (the agent's files.c, do_fput)
T_FPUT = 18
#: T_FPUT's flags: make missing parents; more data follows (the answer names the temporary file);
#: the write is given up (its temporary file removed)
PUT_PARENTS, PUT_MORE, PUT_ABORT = 1, 2, 4
#: or'd into a file request's type: run it with the agent's own ids, not the default user's (the
#: host's own requests: the microVM's guest cgroup leaves and network files)
T_AS_AGENT = 0x80
T_READY, T_STARTED, T_STDOUT, T_STDERR, T_EXIT, T_DATA, T_SPARE, T_OK, T_ERR = 100, 101, 102, 103, 104, 105, 106, 110, 111
#: the agent wrote (or dropped) this many of a command's stdin bytes
T_STDIN_ACK = 107
#: the agent delivered a T_SIGNAL (payload: the signal; agents that say version 2 in T_READY)
T_SIGNALED = 108
#: stdin bytes of one command the host may have sent and the agent not yet acknowledged: what the
#: agent holds for a command that reads slowly (``STDIN_WINDOW`` in agent.h)
STDIN_WINDOW = 1 << 20

HEADER = struct.Struct("<BII")
MAX_FRAME = 64 << 20
