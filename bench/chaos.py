"""Chaos soak: a seeded schedule of faults over one long emulated run; its end equals a quiet run's.

Run: `.venv/bin/python bench/chaos.py --faults 12 --seed 0` (2 emulated CPU hosts; minutes).

A fault-free reference run and the soak run train the same job (mlp on
digits, 2 hosts, a fixed equal split, so the parameters do not depend on
timing) under `launch/local.py --max-restarts K`. Faults hit the soak run one
every `--gap` steps, drawn from `--seed` (bench/chaos_schedule.py): kill -9 of
a host (host 0 too), SIGTERM to one host and to all, SIGSTOP of a host, a
damaged newest checkpoint (then kill -9), and, EMULATED inside a host
(HETJAX_FAULTS, once each per job): a stall inside a step, a stall in
evaluation, a checkpoint write that fails. The launcher restarts failures
and preemptions; a failed write ends the job with 74 by design, and the
bench resumes it with the same command, as an operator would.

Per fault it prints who the job's lines named, how the attempt ended, the
seconds from the fault to the first step after the resume (EMULATED cluster
on this machine's cores: a restart's start-up, JAX import and compile
dominate) and the steps redone; at the end, whether the final parameters'
digest equals the reference's. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chaos_schedule as cs  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAULTS, FAULTS_ONCE = "HETJAX_FAULTS", "HETJAX_FAULTS_ONCE"  # hetjax.cluster.emulate's.
WAIT_S = 300.0  # Only a broken job waits this long for its next line.


def train_command(out: pathlib.Path, steps: int, ckpt: pathlib.Path | None, *, every: int,
                  watchdog_s: float) -> list[str]:
  """The soak's job: tiny, a fixed equal split (the default), evaluated every `every` steps."""
  saves = [] if ckpt is None else ["--ckpt-dir", str(ckpt), "--ckpt-every", str(every)]
  return [sys.executable, "-m", "hetjax.cli", "train", "--model", "mlp", "--dataset", "digits",
          "--global-batch", "32", "--microbatch", "4", "--steps", str(steps), "--log-every", "1",
          "--eval-every", str(every), "--watchdog", str(watchdog_s), "--out", str(out), *saves]


def launcher(command: list[str], *, restarts: int = 0) -> list[str]:
  """`launch/local.py` on 2 hosts; a frozen host is declared dead after 10 s."""
  budget = ["--max-restarts", str(restarts), "--max-preemptions", str(restarts)] if restarts else []
  return [sys.executable, str(ROOT / "launch" / "local.py"), "--hosts", "2", "--grace", "5",
          "--heartbeat-timeout", "10", *budget, "--", *command]


class Lines:
  """The output lines of one launcher after another, with their arrival times."""

  def __init__(self, echo: bool = False):
    self.items: list[tuple[float, str]] = []
    self.proc: subprocess.Popen | None = None
    self._seen = threading.Condition()
    self._echo = echo

  def start(self, command: list[str], env: dict[str, str]) -> None:
    self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
    threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

  def _read(self, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
      with self._seen:
        self.items.append((time.monotonic(), line.rstrip("\n")))
        self._seen.notify_all()
      if self._echo:
        print(line, end="", file=sys.stderr, flush=True)
    proc.wait()
    with self._seen:
      self._seen.notify_all()

  def wait(self, pattern, start: int, check=lambda m: True, *, or_exit: bool = False):
    """(match, index) of the first line from `start` on matching; (None, None) at exit if `or_exit`."""
    deadline, i = time.monotonic() + WAIT_S, start
    with self._seen:
      while True:
        while i < len(self.items):
          found = pattern.search(self.items[i][1])
          if found and check(found):
            return found, i
          i += 1
        if self.proc.poll() is not None:
          self._seen.wait(0.5)  # The reader may still be draining the pipe.
          if i >= len(self.items):
            if or_exit:
              return None, None
            raise RuntimeError(f"the job ended (exit {self.proc.returncode}) before "
                               f"{pattern.pattern!r}:\n" + self.text(max(0, i - 40)))
          continue
        if time.monotonic() > deadline:
          raise RuntimeError(f"no {pattern.pattern!r} for {WAIT_S:g} s:\n" + self.text(i - 40))
        self._seen.wait(1.0)

  def last_step_before(self, end: int, start: int) -> int | None:
    steps = [int(m.group(1)) for _, line in self.items[start:end] if (m := cs.STEP.search(line))]
    return steps[-1] if steps else None

  def text(self, start: int = 0, end: int | None = None) -> str:
    return "\n".join(line for _, line in self.items[max(0, start):end])

  def host_pids(self) -> dict[int, int]:
    """The current attempt's hosts, {host id: pid}, from the launcher's children in /proc."""
    pid = self.proc.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      children = [int(c) for c in f.read().split()]
    found = {}
    for child in children:
      try:
        with open(f"/proc/{child}/environ", "rb") as f:
          env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
      except OSError:
        continue
      if b"HETJAX_HOST_ID" in env:
        found[int(env[b"HETJAX_HOST_ID"])] = child
    return found

  def kill(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
      self.proc.wait()


@dataclasses.dataclass
class Result:
  """What one fault did."""
  fault: cs.Fault
  named: set[int]
  ended: str           # restart, preemption, or exit 74 (resumed by the bench)
  recovery_s: float    # from the fault to host 0's first step after the resume
  redone: int          # steps done before the fault and done again after it
  note: str = ""

  @property
  def ok(self) -> bool:
    return self.named == self.fault.expected and self.ended.startswith(cs.ENDS[self.fault.kind])


def damage_newest(ckpt: pathlib.Path, at_least: int) -> int:
  """Truncates the biggest array file of the newest committed checkpoint >= `at_least`; its step."""
  deadline = time.monotonic() + WAIT_S
  while True:
    steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and int(p.name) >= at_least]
    if steps:
      break
    if time.monotonic() > deadline:
      raise RuntimeError(f"no checkpoint >= {at_least} in {ckpt}")
    time.sleep(0.02)  # A poll for a folder orbax renames into place.
  step = max(steps)
  files = [p for p in (ckpt / str(step) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  biggest = max(files, key=lambda p: p.stat().st_size)
  with open(biggest, "r+b") as f:
    f.truncate(biggest.stat().st_size // 2)
  return step


class Soak:
  """One soak run: a launcher (or, after a 74, the next one) and the faults sent to it."""

  def __init__(self, command: list[str], env: dict[str, str], ckpt: pathlib.Path, echo: bool):
    self.command, self.env, self.ckpt = command, env, ckpt
    self.lines = Lines(echo)
    self.resumes = 0  # Jobs the bench started again by hand (after exit 74).
    self.cursor = 0   # The line after the last fault's recovery: the next fault's lines follow it.
    self.lines.start(command, env)

  def inject(self, fault: cs.Fault) -> tuple[float, int, str]:
    """Waits for the fault's step and sends it (or waits for the emulated one): (time, index, note)."""
    start = self.cursor  # An emulated fault may fire while the last one's lines are still read.
    if fault.kind in cs.INSIDE:
      _, i = self.lines.wait(cs.EMULATED, start, lambda m: int(m.group(2)) == fault.host)
      return self.lines.items[i][0], i, ""
    _, i = self.lines.wait(cs.STEP, start, lambda m: int(m.group(1)) >= fault.step)
    note = ""
    if fault.kind == cs.DAMAGE:
      # The newest committed one, already there (an asynchronous commit of the step's own
      # checkpoint may lag under load, and the next fault comes a gap later).
      note = f"checkpoint {damage_newest(self.ckpt, fault.step - 10)} truncated"
    pids = self.lines.host_pids()
    signum = {cs.KILL: signal.SIGKILL, cs.DAMAGE: signal.SIGKILL, cs.STOP: signal.SIGSTOP}.get(
        fault.kind, signal.SIGTERM)
    for host in sorted(fault.expected):
      os.kill(pids[host], signum)
    return time.monotonic(), len(self.lines.items), note

  def outcome(self, fault: cs.Fault, since: int) -> tuple[set[int], str, int]:
    """How the attempt that `fault` hit ended: (named hosts, how, index of the ending line)."""
    ended, i = self.lines.wait(cs.ENDED, since, or_exit=True)
    if ended is not None:
      named = cs.blamed(ended.group(2))
      if fault.kind in (cs.TERM_ONE, cs.TERM_ALL):  # Who got the signal, in the hosts' words.
        named = {int(m.group(1)) for _, line in self.lines.items[since:i]
                 if (m := cs.REACHED.search(line))}
      return named, "restart" if ended.group(1) == "restart" else "preemption restart", i
    code, i = self.lines.proc.returncode, len(self.lines.items)
    text = self.lines.text(since)
    named = {int(m.group(1)) for line in text.splitlines() if (m := cs.WRITE_FAILED.search(line))}
    if code != 74:
      raise RuntimeError(f"{fault}: the job ended with {code}, no restart:\n{text[-4000:]}")
    self.resumes += 1
    self.lines.start(self.command, self.env)  # What an operator does once the disk has room.
    return named, "exit 74, resumed by the bench", i

  def run(self, fault: cs.Fault) -> Result:
    before = self.cursor
    sent_at, since, note = self.inject(fault)
    named, how, end = self.outcome(fault, since)
    # Resumed, or (killed before the first checkpoint was committed) started over.
    found, r = self.lines.wait(cs.RESUMED_OR_STEP, end)
    start_step = int(found.group(1)) if found.group(1) is not None else 0
    if found.group(1) is None:
      back = r
      note += ("; " if note else "") + "no checkpoint committed yet: started over"
    else:
      _, back = self.lines.wait(cs.STEP, r)
    self.cursor = back + 1
    last = self.lines.last_step_before(end, before) or 0
    if fault.kind == cs.DAMAGE:
      damaged = int(note.split()[1])
      moved = f"{damaged}.damaged" in self.lines.text(end, back)
      note += f"; {damaged}.damaged moved aside" if moved else "; NOT moved aside"
    return Result(fault, named, how, self.lines.items[back][0] - sent_at,
                  max(0, last - start_step), note)

  def finish(self) -> int:
    code = self.lines.proc.wait(timeout=WAIT_S * 4)
    if code == 74:  # The last fault was a failed write after the last restart line.
      self.resumes += 1
      self.lines.start(self.command, self.env)
      code = self.lines.proc.wait(timeout=WAIT_S * 4)
    return code


def digest(out: pathlib.Path) -> str | None:
  with open(out / "summary.json") as f:
    return json.load(f).get("params_digest")


def soak(faults: int, seed: int, folder: pathlib.Path, *, gap: int = 20, every: int = 10,
         watchdog_s: float = 3.0, echo: bool = False) -> dict:
  """Runs the reference, then the soak; returns the per-fault results and both digests."""
  schedule = cs.draw(faults, seed, first=2 * every, gap=gap)
  steps = (schedule[-1].step if schedule else 2 * every) + cs.AFTER_FAILED_WRITE * gap
  base = {k: v for k, v in os.environ.items() if k not in (FAULTS, FAULTS_ONCE)}
  base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
  t0 = time.monotonic()
  ref = subprocess.run(launcher(train_command(folder / "ref", steps, None, every=every,
                                              watchdog_s=watchdog_s)),
                       cwd=ROOT, env=base, capture_output=True, text=True, timeout=WAIT_S * 4)
  if ref.returncode != 0:
    raise RuntimeError(f"the reference run failed ({ref.returncode}):\n{ref.stderr[-4000:]}")
  ref_s = time.monotonic() - t0
  env = {**base, FAULTS: cs.faults_env(schedule), FAULTS_ONCE: str(folder / "fired")}
  command = launcher(train_command(folder / "run", steps, folder / "ckpt", every=every,
                                   watchdog_s=watchdog_s), restarts=faults + 2)
  run = Soak(command, env, folder / "ckpt", echo)
  t1 = time.monotonic()
  try:
    results = [run.run(fault) for fault in schedule]
    code = run.finish()
  finally:
    run.lines.kill()
    (folder / "soak.log").write_text(run.lines.text())
  if code != 0:
    raise RuntimeError(f"the soak run ended with {code}:\n{run.lines.text()[-4000:]}")
  return {"seed": seed, "steps": steps, "results": results, "resumed_by_bench": run.resumes,
          "reference_s": ref_s, "soak_s": time.monotonic() - t1,
          "digest": digest(folder / "run"), "reference_digest": digest(folder / "ref"),
          "text": run.lines.text()}


def table(report: dict) -> str:
  rows = [f"seed {report['seed']}: {len(report['results'])} faults over {report['steps']} steps "
          f"(2 emulated hosts, mlp/digits, fixed equal split)",
          f"{'fault':<46} {'named':<8} {'ended':<32} {'recovery s':>10} {'redone':>6}  ok"]
  for r in report["results"]:
    named = ",".join(map(str, sorted(r.named))) or "-"
    rows.append(f"{str(r.fault):<46} {named:<8} {r.ended:<32} {r.recovery_s:>10.1f} "
                f"{r.redone:>6}  {'yes' if r.ok else 'NO'}" + (f"  ({r.note})" if r.note else ""))
  same = report["digest"] == report["reference_digest"]
  rows.append(f"final params digest {report['digest'][:16]} "
              f"{'==' if same else '!='} fault-free {report['reference_digest'][:16]}; "
              f"every fault named: {all(r.ok for r in report['results'])}; jobs resumed by the "
              f"bench after exit 74: {report['resumed_by_bench']}; soak {report['soak_s']:.0f} s, "
              f"reference {report['reference_s']:.0f} s (emulated, this machine)")
  return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--faults", type=int, default=12)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--gap", type=int, default=20, help="steps between faults")
  parser.add_argument("--watchdog", type=float, default=3.0, help="the hosts' --watchdog")
  parser.add_argument("--folder", default=None, help="where the runs live (default: a temp dir)")
  parser.add_argument("--echo", action="store_true", help="print the soak job's lines too")
  args = parser.parse_args(argv)
  folder = pathlib.Path(args.folder or tempfile.mkdtemp(prefix="hetjax-chaos-"))
  folder.mkdir(parents=True, exist_ok=True)
  report = soak(args.faults, args.seed, folder, gap=args.gap, watchdog_s=args.watchdog,
                echo=args.echo)
  report.pop("text")
  print(table(report))
  ok = report["digest"] == report["reference_digest"] and all(r.ok for r in report["results"])
  print(json.dumps({"seed": args.seed, "faults": args.faults, "ok": ok,
                    "same_digest": report["digest"] == report["reference_digest"],
                    "resumed_by_bench": report["resumed_by_bench"],
                    "results": [{"fault": str(r.fault), "named": sorted(r.named), "ended": r.ended,
                                 "recovery_s": round(r.recovery_s, 1), "redone": r.redone,
                                 "ok": r.ok} for r in report["results"]]}))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
