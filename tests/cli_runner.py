"""The `tollgate` console script for tests, without paying its start-up (~1.3 s of imports) on each
of the suite's ~100 calls: a fork server that has imported `gateway.cli.main` once forks one
child per call, and the child does what the console script does (`sys.exit(main())`) with the
call's arguments, environment and working directory, its stdout and stderr going to files. Each
call is still its own process (its own exit code, environment, event loop, logging set-up);
`console_script` runs the installed script itself, for the tests that guard the entry point.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.context import BaseContext
from pathlib import Path

_context: BaseContext | None = None


def _forks() -> BaseContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tests.cli_runner", "gateway.cli.main"])
        _context = context
    return _context


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter makes of `sys.exit(code)`: None is 0, a number is itself, anything else
    is printed to stderr and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((out, 1), (err, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = ["tollgate", *argv]
    try:
        from gateway.cli.main import main

        code = _exit_code(SystemExit(main(argv)))
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def tollgate(argv: list[str] | tuple[str, ...], env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`tollgate *argv` with exactly `env` as its environment, as `subprocess.run(..., text=True,
    capture_output=True)` answers it."""
    with tempfile.TemporaryDirectory(prefix="tollgate-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        Path(out).touch()
        Path(err).touch()
        process = _forks().Process(target=_child, args=(list(argv), dict(env), os.getcwd(), out, err))  # type: ignore[attr-defined]
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(["tollgate", *argv], timeout)
        return subprocess.CompletedProcess(["tollgate", *argv], int(process.exitcode or 0),
                                           Path(out).read_text(), Path(err).read_text())


def console_script(argv: list[str] | tuple[str, ...], env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """The installed `tollgate` script itself, in a new interpreter."""
    exe = Path(sys.executable).with_name("tollgate")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, env=env, timeout=timeout)
