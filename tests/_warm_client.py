"""A test host's stand-in process: asks the warm server (`_warm_hosts`) to fork the host.

Run as `python -I -S tests/_warm_client.py -m MODULE ARGS...` in place of `python -m
MODULE ARGS...`, it imports only the standard library (milliseconds, where
the host's own imports take seconds). It hands the server its
stdin/stdout/stderr, environment, folder and arguments, passes SIGINT /
SIGTERM / SIGHUP on to the forked host, and exits with the host's status.
Without a server, or when the server answers "cold", it execs `python -m
MODULE ARGS...` itself. A stopped client (SIGSTOP) does not stop its host:
tests that freeze a host start it cold.
"""

from __future__ import annotations

import array
import os
import pickle
import signal
import socket
import struct
import sys
import time

CLIENT = os.path.abspath(__file__)
SOCKET_ENV = "HETJAX_WARM_HOSTS"
PYTHON_ENV = "HETJAX_WARM_PYTHON"   # The interpreter of a cold start.
CONNECT_S = 120.0  # The server imports JAX once before it listens.
# A socket that refuses was bound by a server that has died (it listens as
# soon as it binds): go cold after this grace, not after CONNECT_S.
REFUSED_S = 2.0
_POLL_S = 0.05
_HEADER = struct.Struct("!I")


def jax_variables(env: dict[str, str]) -> dict[str, str]:
  """The variables JAX reads when it is imported: a fork must see the server's."""
  return {k: v for k, v in env.items() if k.startswith("JAX_")}


def send_message(sock: socket.socket, payload: object, fds: tuple[int, ...] = ()) -> None:
  data = pickle.dumps(payload)
  frame = _HEADER.pack(len(data)) + data
  if fds:
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(frame):
      sock.sendall(frame[sent:])
  else:
    sock.sendall(frame)


def _exactly(sock: socket.socket, n: int, start: bytes = b"") -> bytes | None:
  data = start
  while len(data) < n:
    more = sock.recv(n - len(data))
    if not more:
      return None
    data += more
  return data


def receive_message(sock: socket.socket) -> tuple[object, list[int]] | None:
  """(payload, the file descriptors that came with it), or None when the peer has gone."""
  fds = array.array("i")
  head, ancillary, _, _ = sock.recvmsg(_HEADER.size, socket.CMSG_LEN(3 * fds.itemsize))
  for level, kind, data in ancillary:
    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
      fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
  head = _exactly(sock, _HEADER.size, head) if head else None
  body = None if head is None else _exactly(sock, _HEADER.unpack(head)[0])
  if body is None:
    for fd in fds:
      os.close(fd)
    return None
  return pickle.loads(body), list(fds)


def _connect(path: str, clock=time.monotonic, sleep=time.sleep) -> socket.socket | None:
  """The server's socket, or None (start cold): waits while the server is still
  importing (no socket yet), briefly when the socket refuses (the server died)."""
  deadline, refused_since = clock() + CONNECT_S, None
  while True:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      sock.connect(path)
      return sock
    except ConnectionRefusedError:
      refused_since = clock() if refused_since is None else refused_since
      late = clock() - refused_since > REFUSED_S
    except OSError:
      late = clock() > deadline
    sock.close()
    if late:
      return None
    sleep(_POLL_S)


def python() -> list[str]:
  """The command that stands for `python` in front of `-m MODULE`: this client."""
  return [sys.executable, "-I", "-S", CLIENT]


def module_command(module: str) -> list[str]:
  """How a test runs `python -m module`: through the warm server when one runs."""
  return [*python(), "-m", module] if os.environ.get(SOCKET_ENV) else [sys.executable, "-m", module]


def _cold(argv: list[str]) -> None:
  python = os.environ.get(PYTHON_ENV, sys.executable)
  os.execv(python, [python, *argv])


def main(argv: list[str]) -> int:
  if len(argv) < 2 or argv[0] != "-m":
    print("usage: _warm_client.py -m MODULE [ARGS...]", file=sys.stderr)
    return 2
  path = os.environ.get(SOCKET_ENV)
  sock = _connect(path) if path else None
  if sock is None:
    _cold(argv)
  with sock:
    request = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": argv}
    try:
      send_message(sock, request, (0, 1, 2))
      answer = receive_message(sock)
    except OSError:
      answer = None
    if answer is None or answer[0][0] == "cold":
      _cold(argv)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
      signal.signal(signum, lambda n, _: send_message(sock, n))
    while True:
      try:
        answer = receive_message(sock)
      except InterruptedError:
        continue
      if answer is None:  # The server died: the host died with it.
        return 1
      kind, value = answer[0]
      if kind == "exited":
        if value < 0:  # Killed by a signal: end the same way, as the host did.
          signal.signal(-value, signal.SIG_DFL)
          os.kill(os.getpid(), -value)
        return value


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
