"""`hetjax doctor`: can this cluster train, and how fast is each host?

Run on every host like `hetjax train` (docs/cluster.md, "The doctor"). Before
joining, a preflight catches what makes joining fail confusingly: a hostname
resolving to loopback (gloo would hand peers 127.0.1.1: "connection
refused"), a missing gloo interface, a taken coordinator port on host 0.
Then every host, in the same order: one all-gather of who it is; a
cross-host sum with a known answer (each device row carries host id + 1);
local train steps timed one host at a time, so hosts sharing a machine do
not slow each other. Every host returns the same exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from hetjax import config as config_lib

if TYPE_CHECKING:  # JAX loads only once the arguments are checked, so errors come fast.
  from hetjax.mesh import Meshes

TEXT_BYTES = 64  # Each text field travels as this many byte codes (exact in float32).
_TEXTS = ("hostname", "jax_version", "collectives", "platform", "address", "gloo_interface")
MODELS = ("mlp", "cnn")


def encode_text(text: str, size: int = TEXT_BYTES) -> np.ndarray:
  """UTF-8 bytes as float32 codes, zero-padded (truncated) to `size`."""
  raw = text.encode()[:size]
  return np.frombuffer(raw.ljust(size, b"\0"), np.uint8).astype(np.float32)


def decode_text(codes: np.ndarray) -> str:
  return bytes(np.asarray(codes, np.float32).astype(np.uint8)).rstrip(b"\0").decode(errors="replace")


def _collectives() -> str:
  import jax
  return str(jax.config.jax_cpu_collectives_implementation)


def _pacing(host_id: int) -> tuple[Callable[[float, int], float] | None, float, bool]:
  """The emulation hook, the emulated speed and whether anything is emulated."""
  if not config_lib.emulated_from_env():
    return None, 1.0, False
  from hetjax.cluster import emulate  # Emulation stays off the real path.
  return emulate.pacing_from_env(host_id), emulate.speed_from_env(), True


def gather_identity(meshes: Meshes, settings: str) -> list[dict[str, Any]]:
  """Every host's name, versions, collectives, speed and settings hash."""
  import jax
  from hetjax import mesh as mesh_lib
  _, speed, emulated = _pacing(meshes.host_id)
  texts = {"hostname": socket.gethostname(), "jax_version": jax.__version__,
           "collectives": _collectives(), "platform": jax.devices()[0].platform,
           "address": resolve_hostname(socket.gethostname()) or "",
           "gloo_interface": os.environ.get(config_lib.Env.GLOO_INTERFACE, "")}
  head = np.array([meshes.host_id, meshes.local_devices, speed, float(emulated)], np.float32)
  vector = np.concatenate([head, config_lib.fingerprint(settings)] + [encode_text(texts[k]) for k in _TEXTS])
  rows = mesh_lib.gather_host_values(vector, meshes)
  hosts = []
  for h, row in enumerate(rows):
    texts = {k: decode_text(row[8 + i * TEXT_BYTES: 8 + (i + 1) * TEXT_BYTES])
             for i, k in enumerate(_TEXTS)}
    hosts.append({"host": h, "reported_id": int(row[0]), "local_devices": int(row[1]),
                  "speed": float(row[2]), "emulated": bool(row[3]),
                  "settings": row[4:8].tolist(), **texts})
  return hosts


def check_reduction(meshes: Meshes, repeats: int = 5) -> dict[str, Any]:
  """A cross-host sum with a known answer, and its median latency."""
  import jax
  import jax.numpy as jnp
  from hetjax import mesh as mesh_lib

  rows = mesh_lib.host_rows(np.array([meshes.host_id + 1.0]), meshes)
  total = jax.jit(lambda x: jnp.sum(x[:, 0]), out_shardings=meshes.replicated)
  got = float(np.asarray(total(rows)))  # The first call compiles.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(total(rows))
    times.append(time.perf_counter() - t0)
  per_host = meshes.devices_per_host()
  expected = float(sum(d * (h + 1) for h, d in enumerate(per_host)))
  return {"ok": got == expected, "got": got, "expected": expected,
          "latency_ms": 1e3 * statistics.median(times)}


def build_local_step(model: str, batch: int, meshes: Meshes) -> Callable[[int], Any]:
  """A compiled local train step on `batch` synthetic samples; every host calls it (the
  state's initialisation is one program over all hosts), the step is local.
  """
  import jax
  import optax
  from hetjax import models as zoo
  from hetjax.input import data
  from hetjax import mesh as mesh_lib
  from hetjax import step as step_lib

  source = data.synthetic_images(size=batch)
  task = zoo.build(model, kind="image", num_classes=source.info.num_classes)
  per_device = -(-batch // meshes.local_devices)  # One micro-batch per step.
  example = source[np.arange(1)]
  optimizer = optax.sgd(1e-2)
  state = mesh_lib.to_local_tree(step_lib.init_state(
      task, optimizer, meshes, next(step_lib.micro_batches(example, per_device)), 0), meshes)
  local = step_lib.LocalProgram(task, optimizer, meshes, per_device)
  key, full = jax.random.key(0), source[np.arange(batch)]
  run = lambda s: jax.block_until_ready(local(state, None, full, example, key, s).sums)
  run(0)  # Compiles here, on every host at once.
  return run


def time_steps(run: Callable[[int], Any], batch: int, steps: int,
               pace: Callable[[float, int], float] | None) -> dict[str, float]:
  """Samples/s of the median step (one page fault must not set it), paced and real."""
  run(1)  # Warms caches after compilation.
  real, paced = [], []
  for s in range(steps):
    t0 = time.perf_counter()
    run(s + 2)
    dt = time.perf_counter() - t0
    real.append(dt)
    paced.append(pace(dt, s, batch) if pace is not None else dt)
  return {"samples_per_sec": batch / statistics.median(paced),
          "real_samples_per_sec": batch / statistics.median(real)}


def measure_in_turns(model: str, batch: int, steps: int, meshes: Meshes) -> list[dict[str, float]]:
  """Every host's local samples/s, measured one host at a time."""
  from hetjax import mesh as mesh_lib
  pace, _, _ = _pacing(meshes.host_id)
  run = build_local_step(model, batch, meshes)
  mine = np.zeros(2, np.float32)
  for turn in range(meshes.num_hosts):
    if turn == meshes.host_id:
      result = time_steps(run, batch, steps, pace)
      mine = np.array([result["samples_per_sec"], result["real_samples_per_sec"]], np.float32)
    mesh_lib.gather_host_values(np.zeros(1), meshes)  # The turn ends for everyone together.
  rows = mesh_lib.gather_host_values(mine, meshes)
  return [{"samples_per_sec": float(r[0]), "real_samples_per_sec": float(r[1])} for r in rows]


def resolve_hostname(name: str) -> str | None:
  """The address `name` resolves to here (what gloo would hand its peers), or None."""
  try:
    return socket.gethostbyname(name)
  except OSError:
    return None


def _is_loopback(address: str) -> bool:
  return address.startswith("127.") or address in ("::1", "localhost")


def hostname_verdict(host: int, hostname: str, address: str, interface: str,
                     coordinator: str | None) -> tuple[bool, str]:
  """Whether host `host`'s peers can reach its CPU collectives, as (ok, verdict)."""
  if interface:
    return True, f"host {host}: gloo uses network interface {interface}"
  if not address:
    return False, (f"host {host}: its hostname {hostname!r} does not resolve; gloo cannot give "
                   "its peers an address. Map it in /etc/hosts or DNS, or set "
                   "HETJAX_GLOO_INTERFACE (doctor: --gloo-interface) to the network interface "
                   "the hosts share.")
  local = coordinator is None or _is_loopback(coordinator.rsplit(":", 1)[0].strip("[]"))
  if _is_loopback(address) and not local:
    return False, (f"host {host}: its hostname {hostname!r} resolves to {address}, a loopback "
                   "address: hosts on other machines get 'connection refused' from gloo. Set "
                   "HETJAX_GLOO_INTERFACE (doctor: --gloo-interface) to the interface the hosts "
                   f"share, or map {hostname!r} to its network address in /etc/hosts.")
  return True, f"host {host}: hostname {hostname!r} resolves to {address}" + (
      " (loopback: fine, every host is on this machine)" if _is_loopback(address) else "")


def parse_expected_devices(text: str | None, num_hosts: int) -> list[int] | None:
  """`--expect-devices 8` (every host) or `8,8,4` (one per host) as a list; None if unset."""
  if text is None:
    return None
  try:
    counts = [int(x) for x in text.split(",")]
  except ValueError:
    raise ValueError(f"--expect-devices {text!r} is not N or N,N,...: devices per host.") from None
  if len(counts) == 1:
    counts *= num_hosts
  if len(counts) != num_hosts or min(counts) < 1:
    raise ValueError(f"--expect-devices {text!r} gives {len(counts)} count(s) (each >= 1) for "
                     f"{num_hosts} hosts; give one for all or one per host.")
  return counts


def device_verdicts(per_host: Sequence[int], expected: Sequence[int] | None,
                    platforms: Sequence[str]) -> list[tuple[bool, str]]:
  """Per host: does it see the devices it should, on the platform host 0 has?"""
  verdicts = []
  for h, (count, platform) in enumerate(zip(per_host, platforms)):
    ok, text = True, f"host {h}: {count} {platform} device(s)"
    if expected is not None and count != expected[h]:
      ok, text = False, (f"host {h}: {count} {platform} device(s), expected {expected[h]}; check "
                         "the GPU request, CUDA_VISIBLE_DEVICES, and that no launcher narrows "
                         "the host to one GPU.")
    elif platform != platforms[0]:
      ok, text = False, (f"host {h}: platform {platform}, host 0 has {platforms[0]}; install the "
                         "same JAX build (e.g. jax[cuda12]) on every host.")
    elif expected is not None:
      text += ", as expected"
    verdicts.append((ok, text))
  return verdicts


def check_port_free(address: str) -> None:
  """On host 0, before joining: raises ValueError when the coordinator's port is taken here."""
  from hetjax.cluster import runtime
  host, port = runtime.split_address(address)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as probe:
    # As a server does: a closed connection's TIME_WAIT does not block it, a listener does.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      probe.bind(("::" if family == socket.AF_INET6 else "", port))
    except OSError as e:
      raise ValueError(f"the coordinator port {port} ({address}) is taken on this host ({e.strerror}): "
                       "another job or a coordinator that is still shutting down. Pick another "
                       "port (HETJAX_COORDINATOR / HETJAX_PORT / --port) or stop that process.") from None


def diagnose(*, model: str = "mlp", batch: int = 256, steps: int = 10,
             expect_devices: str | None = None) -> dict[str, Any]:
  """Runs every check on this host (call it on every host); same result everywhere."""
  import jax
  from hetjax import mesh as mesh_lib

  meshes = mesh_lib.Meshes.create()
  hosts = gather_identity(meshes, f"{model}|{batch}|{steps}")
  problems = []
  if [h["reported_id"] for h in hosts] != list(range(meshes.num_hosts)):
    problems.append(f"the all-gather put hosts {[h['reported_id'] for h in hosts]} in rows "
                    f"{list(range(meshes.num_hosts))}: host rows are mixed up.")
  for key in ("jax_version", "collectives"):
    if len({h[key] for h in hosts}) > 1:
      by_host = ", ".join(f"host {h['host']} {h[key]}" for h in hosts)
      problems.append(f"hosts disagree on {key}: {by_host}; install the same "
                      "JAX everywhere and start every host the same way.")
  if len({tuple(h["settings"]) for h in hosts}) > 1:
    problems.append("hosts run doctor with different --model/--batch/--steps; give every host "
                    "the same arguments. Skipped the speed test.")
  from hetjax.cluster import runtime  # The coordinator it was told or found; None: JAX's own.
  coordinator = runtime.resolve(os.environ).coordinator
  preflight = [hostname_verdict(h["host"], h["hostname"], h["address"], h["gloo_interface"],
                                coordinator) for h in hosts]
  preflight += device_verdicts(meshes.devices_per_host(),
                               parse_expected_devices(expect_devices, meshes.num_hosts),
                               [h["platform"] for h in hosts])
  problems += [text for ok, text in preflight if not ok]
  reduction = check_reduction(meshes)
  if not reduction["ok"]:
    problems.append(f"the cross-host sum gave {reduction['got']:g}, expected "
                    f"{reduction['expected']:g}: some host's values are lost or counted twice.")
  speeds = (measure_in_turns(model, batch, steps, meshes) if not problems
            else [{"samples_per_sec": None, "real_samples_per_sec": None}] * meshes.num_hosts)
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  for h, host in enumerate(hosts):
    del host["reported_id"], host["settings"]
    host["devices"] = [{"id": d.id, "kind": d.device_kind} for d in devices if d.process_index == h]
    host.update(speeds[h])
  return {
      "ok": not problems, "problems": problems, "num_hosts": meshes.num_hosts,
      "devices_per_host": list(meshes.devices_per_host()), "coordinator": coordinator,
      "preflight": [{"ok": ok, "verdict": text} for ok, text in preflight],
      "platform": devices[0].platform, "collectives": _collectives(),
      "jax_version": jax.__version__, "reduction": reduction,
      "benchmark": {"model": model, "batch": batch, "steps": steps}, "hosts": hosts,
  }


def format_report(report: dict[str, Any]) -> str:
  """The doctor's findings as text (what process 0 prints)."""
  bench = report["benchmark"]
  lines = [
      f"hetjax doctor: {report['num_hosts']} hosts, {sum(report['devices_per_host'])} devices, "
      f"platform {report['platform']}, jax {report['jax_version']}",
      f"coordinator {report['coordinator'] or '(none: single host)'}; "
      f"CPU collectives {report['collectives']}",
      f"samples/s: local train steps of {bench['model']}, batch {bench['batch']}, "
      f"median of {bench['steps']} steps, one host at a time",
  ]
  rows = [("host", "name", "devices", "samples/s", "")]
  for h in report["hosts"]:
    kinds = "/".join(sorted({d["kind"] for d in h["devices"]}))
    ids = ",".join(str(d["id"]) for d in h["devices"])
    sps = h["samples_per_sec"]
    note = ""
    if sps is not None and h["emulated"]:
      note = f"emulated speed {h['speed']:g} (real {h['real_samples_per_sec']:,.0f})"
    rows.append((str(h["host"]), h["hostname"], f"{len(h['devices'])} x {kinds} (ids {ids})",
                 "not measured" if sps is None else f"{sps:,.0f}", note))
  widths = [max(len(row[i]) for row in rows) for i in range(4)]
  for row in rows:
    lines.append(("  " + "  ".join([row[0].rjust(widths[0]), row[1].ljust(widths[1]),
                                     row[2].ljust(widths[2]), row[3].rjust(widths[3]), row[4]])).rstrip())
  r = report["reduction"]
  lines.append(f"cross-host sum: {'ok' if r['ok'] else 'WRONG'} (got {r['got']:g}, expected "
               f"{r['expected']:g}; {r['latency_ms']:.2f} ms)")
  lines += [f"ok: {p['verdict']}" for p in report.get("preflight", []) if p["ok"]]
  lines += [f"problem: {p}" for p in report["problems"]]
  lines.append("doctor: all checks passed" if report["ok"] else
               f"doctor: {len(report['problems'])} problem(s)")
  return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The `hetjax doctor` arguments."""
  parser.add_argument("--model", default="mlp", choices=MODELS, help="model of the speed test")
  parser.add_argument("--batch", type=int, default=256, help="samples per timed step, per host")
  parser.add_argument("--steps", type=int, default=10, help="timed steps per host")
  parser.add_argument("--json", default=None, metavar="FILE", help="also write the report (host 0)")
  parser.add_argument("--init-timeout", type=float, default=None,
                      help="seconds to reach the coordinator (default HETJAX_INIT_TIMEOUT or 120)")
  parser.add_argument("--gloo-interface", default=None, metavar="IFACE",
                      help="network interface for the CPU collectives (default "
                           "HETJAX_GLOO_INTERFACE, else the hostname's address)")
  parser.add_argument("--expect-devices", default=None, metavar="N[,N,...]",
                      help="devices each host should see: one count for all, or one per host")


def run(args: argparse.Namespace) -> int:
  """`hetjax doctor` on this host; 0 when every check passed, 1 if not, 2 on bad input."""
  multi_host = int(os.environ.get(config_lib.Env.NUM_HOSTS, "1")) > 1
  try:
    config_lib.check_at_least("--batch", args.batch, 1)
    config_lib.check_at_least("--steps", args.steps, 1)
    from hetjax.cluster import runtime
    if args.gloo_interface:
      os.environ[config_lib.Env.GLOO_INTERFACE] = args.gloo_interface  # Host 0's report shows it.
    spec = runtime.resolve(os.environ, timeout_s=args.init_timeout)
    multi_host = spec.num_hosts != 1  # Also a srun step or Open MPI, not only HETJAX_*.
    if spec.num_hosts is not None:
      parse_expected_devices(args.expect_devices, spec.num_hosts)  # Fails before joining.
    if spec.host_id == 0 and spec.coordinator is not None and not runtime.is_initialized():
      check_port_free(spec.coordinator)
    topo = runtime.initialize(timeout_s=args.init_timeout)
    report = diagnose(model=args.model, batch=args.batch, steps=args.steps,
                      expect_devices=args.expect_devices)
  except (ValueError, ConnectionError) as e:
    print(f"hetjax doctor: error: {e}", file=sys.stderr)
    return _leave(2, multi_host)
  except BaseException:
    if not multi_host:
      raise
    traceback.print_exc()
    return _leave(1, multi_host)
  if topo.host_id == 0:
    print(format_report(report), end="", flush=True)
    if args.json:
      os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
      with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
  return 0 if report["ok"] else 1


def _leave(code: int, multi_host: bool) -> int:
  """Leaves at once on a multi-host failure: JAX's exit-time shutdown would wait for the others."""
  if multi_host:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="hetjax doctor", description=__doc__.splitlines()[0])
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
