"""Warm test hosts: JAX imported once, each host of `run_hosts` and of the CLI tests forked from it.

Every emulated host of a multi-host test is a fresh process, and a fresh
process spends ~3.4 s of CPU importing JAX, Flax, optax and orbax before it
does anything (`python -X importtime`: JAX alone 2.5 s); the suite starts
about a hundred of them on 2 cores. A warm server imports them once; a
host's command becomes a tiny client (`python -I -S _warm_client.py ...`,
stdlib only) that hands the server its stdin/stdout/stderr, environment,
folder and arguments, and the server forks a child that becomes the host:
its own process, its own session, its own JAX backend and `jax.distributed`
runtime, exactly the process `python -m hetjax.testing` would be.

What the harness sees does not change: the client is the process it
started, prefixes and reads its output (the child writes to the client's
pipe), signals it (the client passes SIGINT / SIGTERM / SIGHUP on to the
child; a SIGKILLed client makes the server SIGKILL the child), and ends
with the child's exit status. A request whose JAX_* variables differ from
the server's (JAX reads them at import) is answered "cold", and the client
runs the ordinary child command itself.

The server is single-threaded (a selector loop), so it forks with no other
thread alive; backends are never initialised in it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import runpy
import shlex
import tempfile
import threading
import traceback
from typing import Iterator

from _warm_client import SOCKET_ENV, jax_variables, python, receive_message, send_message

PYTHON_ENV = "HETJAX_TESTING_PYTHON"  # hetjax.testing.PYTHON_ENV, without importing hetjax here.

# What a test host imports anyway: loaded once here, shared by every fork.
PRELOAD = ("jax", "jax.numpy", "optax", "flax.linen", "orbax.checkpoint", "numpy",
           "hetjax", "hetjax.trainer", "hetjax.cluster.runtime", "hetjax.cli.commands")
# Never the modules hosts run as __main__ (`runpy` would warn of a second copy).


def _become_host(request: dict, fds: list[int]) -> None:
  """In the forked child: take the client's streams, environment and folder; run the host."""
  os.setsid()
  for target, fd in zip((0, 1, 2), fds):
    os.dup2(fd, target)
  for fd in fds:
    os.close(fd)
  for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
    signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
  os.environ.clear()
  os.environ.update(request["env"])
  os.chdir(request["cwd"])
  extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
  sys.path[:0] = [p for p in extra if p not in sys.path]
  if request["env"].get("PYTHONUNBUFFERED"):
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
  _, module, *args = request["argv"]  # "-m", MODULE, ARGS...: `python -m MODULE ARGS`.
  code = 0
  try:
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  finally:
    # The end of an interpreter, as the ordinary child has it after a clean
    # return (a failing child left through os._exit already): non-daemon
    # threads joined, then atexit (JAX's distributed shutdown waits for every
    # host there). Never back into the server's frames.
    try:
      threading._shutdown()  # pylint: disable=protected-access
      atexit._run_exitfuncs()  # pylint: disable=protected-access
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)


def serve(path: str) -> None:
  """Answers clients on the UNIX socket `path` until SIGTERM; never returns normally."""
  for name in PRELOAD:
    __import__(name)
  own_jax = jax_variables(dict(os.environ))
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(64)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_w, False)
  signal.set_wakeup_fd(wake_w)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ, "accept")
  selector.register(wake_r, selectors.EVENT_READ, "child")
  children: dict[int, socket.socket] = {}  # pid -> its client's connection
  parent = os.getppid()
  try:
    while os.getppid() == parent:  # Never outlive the test run that started it.
      for key, _ in selector.select(timeout=1.0):
        if key.data == "accept":
          conn, _ = listener.accept()
          selector.register(conn, selectors.EVENT_READ, "request")
        elif key.data == "child":
          os.read(wake_r, 4096)
          _reap(children, selector)
        elif key.data == "request":
          _answer(key.fileobj, own_jax, children, selector, listener, wake_r, wake_w)
        else:  # A running host's client: a signal to pass on, or the client is gone.
          _from_client(key.fileobj, key.data, selector)
  finally:
    for pid in children:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _answer(conn: socket.socket, own_jax: dict[str, str], children: dict[int, socket.socket],
            selector: selectors.BaseSelector, listener: socket.socket, wake_r: int,
            wake_w: int) -> None:
  selector.unregister(conn)
  try:
    message = receive_message(conn)
  except OSError:
    message = None
  if message is None:
    conn.close()
    return
  request, fds = message
  if jax_variables(request["env"]) != own_jax:
    for fd in fds:
      os.close(fd)
    _tell(conn, ("cold", None))
    conn.close()
    return
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    signal.set_wakeup_fd(-1)
    selector.close()
    listener.close()
    for fd in (wake_r, wake_w):
      os.close(fd)
    for other in children.values():
      other.close()
    conn.close()
    _become_host(request, fds)
  for fd in fds:
    os.close(fd)
  children[pid] = conn  # Reaped and closed when it exits, whatever happens to its client.
  if _tell(conn, ("started", pid)):
    selector.register(conn, selectors.EVENT_READ, pid)
  else:  # The client left before its host started: nobody waits for that host.
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)


def _tell(conn: socket.socket, payload: object) -> bool:
  """Sends `payload` to a client; False when it has gone. One client's end (a test
  that kills its launcher) must not end the server that every later host needs."""
  try:
    send_message(conn, payload)
  except OSError:
    return False
  return True


def _from_client(conn: socket.socket, pid: int, selector: selectors.BaseSelector) -> None:
  try:
    message = receive_message(conn)
  except OSError:
    message = None
  signum = signal.SIGKILL if message is None else int(message[0])
  with contextlib.suppress(ProcessLookupError):
    os.kill(pid, signum)
  if message is None:  # The client is gone: nothing left to tell it.
    selector.unregister(conn)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
  while children:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    conn = children.pop(pid, None)
    if conn is None:
      continue
    with contextlib.suppress(KeyError, ValueError):
      selector.unregister(conn)
    _tell(conn, ("exited", os.waitstatus_to_exitcode(status)))
    conn.close()


@contextlib.contextmanager
def running() -> Iterator[str]:
  """A warm server for this process's tests and the hosts they start; yields its socket path.

  While it runs, `hetjax.testing.run_hosts` and `_warm_client.module_command`
  start hosts through the client (HETJAX_TESTING_PYTHON, HETJAX_WARM_HOSTS).
  """
  folder = tempfile.mkdtemp(prefix="hetjax-warm-")
  path = os.path.join(folder, "socket")
  server = subprocess.Popen([sys.executable, os.path.abspath(__file__), path],
                            stdin=subprocess.DEVNULL, start_new_session=True)
  os.environ.update({SOCKET_ENV: path, PYTHON_ENV: shlex.join(python())})
  try:
    yield path
  finally:
    for name in (SOCKET_ENV, PYTHON_ENV):
      os.environ.pop(name, None)
    server.terminate()
    try:
      server.wait(10)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()
    with contextlib.suppress(OSError):
      os.unlink(path)
      os.rmdir(folder)


if __name__ == "__main__":
  serve(sys.argv[1])
