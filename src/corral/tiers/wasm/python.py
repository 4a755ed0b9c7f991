"""Which commands the wasm tier can run, and how they become a guest's argv.

The guest is CPython compiled to WASI: there is no shell and no other
program.  A command is accepted when it is a Python invocation::

    python3 [OPTIONS] -c CODE [ARGS]      python3 [OPTIONS] -m MODULE [ARGS]
    python3 [OPTIONS] SCRIPT [ARGS]       python3 [OPTIONS] [-]  (program on stdin)
    python3 -V | --version | -h | --help

(``python``, ``python3``, ``python3.12``, with or without a directory), or a
shell string (``sh -c "..."``) that is exactly one such invocation with no
shell syntax in it.  Anything else is refused with :class:`NotPython`.

WASI has no working directory of its own (wasi-libc starts in ``/``), so a
small boot program, run with ``-c``, changes to the command's cwd and then
runs the user's program the way ``python`` itself would: ``-c`` code and
scripts are compiled and run in ``__main__`` (the boot frame is cut from
tracebacks), ``-m`` goes through :mod:`runpy` as with the real interpreter.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence

PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")
#: interpreter options that take a value (as a separate argument or joined: -Wignore)
OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}
#: options that only print something and exit: passed to the guest as they are
INFO_OPTIONS = {"-V", "--version", "-VV", "-h", "--help", "-?", "--help-env", "--help-xoptions", "--help-all"}
SHELLS = {"/bin/sh", "sh", "/bin/bash", "bash", "/usr/bin/sh", "/usr/bin/bash"}
#: characters that mean shell syntax when not quoted (and $ ` \ even in double quotes)
_UNQUOTED_SPECIAL = set("|&;<>()$`\\\n*?[]{}~#!")
_DOUBLE_QUOTED_SPECIAL = set("$`\\")


class NotPython(ValueError):
    """The command is not a Python invocation, so it cannot exist in the wasm tier."""


# The boot program.  sys.argv is ["-c", MODE, CWD, *rest] when it starts.
BOOT = r"""
def _corral_boot():
    import os, sys
    g = globals()
    del g["_corral_boot"]
    mode = sys.argv[1]
    if mode == "w":
        # pre-started: the command arrives on stdin as a 10-digit length, then
        # NUL-separated mode, cwd, argument count, arguments, NAME=VALUE environment
        header = b""
        while len(header) < 10:
            chunk = os.read(0, 10 - len(header))
            if not chunk:
                raise SystemExit(0)
            header += chunk
        size, payload = int(header), b""
        while len(payload) < size:
            chunk = os.read(0, size - len(payload))
            if not chunk:
                raise SystemExit(0)
            payload += chunk
        fields = payload.decode("utf-8", "surrogateescape").split("\0")
        count = int(fields[2])
        sys.argv[1:] = [fields[0], fields[1], *fields[3 : 3 + count]]
        os.environ.clear()
        for item in fields[3 + count :]:
            name, _, value = item.partition("=")
            os.environ[name] = value
        mode = sys.argv[1]
    cwd, rest = sys.argv[2], sys.argv[3:]

    def finish(code):
        # what interpreter shutdown does that a program can see: atexit handlers and
        # flushed output; the rest of finalization (~15% of a command's instructions
        # in wasm) is skipped, as after os._exit
        import atexit
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF)

    def exit_code(exc):
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        sys.stderr.write(f"{exc.code}\n")
        return 1

    try:
        os.chdir(cwd)
    except OSError as exc:
        sys.stderr.write(f"corral: cannot change to working directory {cwd}: {exc.strerror}\n")
        finish(1)
    if mode == "m":
        import runpy
        sys.argv = ["-m", *rest[1:]]
        sys.executable = sys.executable or "python3"  # runpy's errors start with it
        sys.path.insert(0, os.getcwd())
        try:
            runpy._run_module_as_main(rest[0], alter_argv=True)
        except SystemExit as exc:
            finish(exit_code(exc))
        except BaseException as exc:
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            sys.excepthook(type(exc), exc.with_traceback(tb), tb)
            finish(1)
        finish(0)
    if mode == "c":
        sys.argv = ["-c", *rest[1:]]
        code = rest[0]  # exec(str) compiles as "<string>", like -c, and cheaper than compile()
    elif mode == "s":
        sys.argv = list(rest)
        sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
        try:
            with open(rest[0], "rb") as f:
                source = f.read()
        except OSError as exc:
            sys.stderr.write(f"python: can't open file {rest[0]!r}: [Errno {exc.errno}] {exc.strerror}\n")
            finish(2)
        g["__file__"] = filename = rest[0]
    else:
        sys.argv = [""]
        source, filename = sys.stdin.read(), "<stdin>"
    try:
        if mode != "c":
            code = compile(source, filename, "exec")
        exec(code, g)
    except SystemExit as exc:
        finish(exit_code(exc))
    except BaseException as exc:
        # cut this boot frame: the traceback starts in the user's code, as with python itself
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        finish(1)
    finish(0)
_corral_boot()
"""


#: a guest started ahead of its command: it waits for a launch record on stdin
PRESTART_ARGV = ["python", "-c", BOOT, "w"]


def launch_record(argv: Sequence[str], env: dict[str, str]) -> bytes | None:
    """The stdin record that hands ``argv`` (from :func:`guest_argv`) to a pre-started guest,
    or None when only a fresh interpreter can run it faithfully: interpreter options, or
    PYTHON* variables, which CPython reads while it starts."""
    if len(argv) < 5 or argv[1] != "-c" or argv[2] is not BOOT or any(k.startswith("PYTHON") for k in env):
        return None
    mode, cwd, rest = argv[3], argv[4], list(argv[5:])
    fields = [mode, cwd, str(len(rest)), *rest, *(f"{k}={v}" for k, v in env.items())]
    payload = "\0".join(fields).encode("utf-8", "surrogateescape")
    return b"%010d" % len(payload) + payload


def _has_shell_syntax(text: str) -> bool:
    """True if ``text`` needs a real shell: an operator, expansion, glob or escape outside single quotes."""
    quote = ""
    for char in text:
        if quote == "'":
            if char == "'":
                quote = ""
        elif quote == '"':
            if char == '"':
                quote = ""
            elif char in _DOUBLE_QUOTED_SPECIAL:
                return True
        elif char in "'\"":
            quote = char
        elif char in _UNQUOTED_SPECIAL:
            return True
    return bool(quote)


def _from_shell(argv: Sequence[str]) -> list[str] | None:
    """``sh -c "python3 x.py"`` -> ``["python3", "x.py"]``; None if it is not that simple."""
    if len(argv) != 3 or argv[0] not in SHELLS or argv[1] != "-c":
        return None
    if _has_shell_syntax(argv[2]):
        return None
    try:
        words = shlex.split(argv[2])
    except ValueError:
        return None
    return words or None


def guest_argv(argv: Sequence[str], cwd: str) -> list[str]:
    """The guest's argv for a command, or NotPython saying why it cannot run here."""
    words = list(argv)
    is_shell = len(words) == 3 and words[0] in SHELLS and words[1] == "-c"
    if is_shell:
        simple = _from_shell(words)
        if simple is None and words[2].split() and PYTHON_NAMES.match(os.path.basename(words[2].split()[0])):
            raise NotPython(
                "the wasm tier has no shell, so shell syntax (pipes, redirections, variables, globs, "
                "several commands) cannot run; pass one Python invocation, e.g. ['python3', '-c', CODE]"
            )
        words = simple or words
    if not words or not PYTHON_NAMES.match(os.path.basename(words[0])):
        program = words[0] if words else ""
        if is_shell and words[0] in SHELLS:
            program = argv[2].split()[0] if argv[2].split() else argv[0]
        raise NotPython(
            f"{program!r} does not exist in the wasm tier: it has no shell and no programs, only Python. "
            "Run python3 -c CODE, python3 SCRIPT.py [ARGS] or python3 -m MODULE [ARGS]"
        )
    options: list[str] = []
    i = 1
    while i < len(words):
        word = words[i]
        if word in INFO_OPTIONS:
            return ["python", *options, word]
        if word == "-c" or word == "-m":
            if i + 1 >= len(words):
                raise NotPython(f"python3: argument expected for the {word} option")
            mode = "c" if word == "-c" else "m"
            return ["python", *options, "-c", BOOT, mode, cwd, *words[i + 1 :]]
        if word.startswith("-c") or word.startswith("-m"):  # -cCODE / -mMODULE
            mode = word[1]
            return ["python", *options, "-c", BOOT, mode, cwd, word[2:], *words[i + 1 :]]
        if word == "-":
            return ["python", *options, "-c", BOOT, "i", cwd, *words[i + 1 :]]
        if word == "--":
            i += 1
            break
        if word.startswith("-"):
            options.append(word)
            if word in OPTIONS_WITH_VALUE:
                if i + 1 >= len(words):
                    raise NotPython(f"python3: argument expected for the {word} option")
                options.append(words[i + 1])
                i += 1
            i += 1
            continue
        break
    if i >= len(words):
        return ["python", *options, "-c", BOOT, "i", cwd]
    return ["python", *options, "-c", BOOT, "s", cwd, *words[i:]]
