"""A host short of CPU for its input (EMULATED, HETJAX_INPUT_SAMPLE_MS) looks slower and gets less."""

from __future__ import annotations

import numpy as np

from hetjax.observe import goodput, goodput_summary
from hetjax.testing import run_hosts

STARVED = 2  # The host whose reader needs INPUT_MS per record.
INPUT_MS, DEVICE_MS = 12.0, 1.0  # Its input is 12x slower than every host's emulated device.


def train_input_bound(steps: int, out: str) -> dict:
  """One host's run: the CNN on the digits, dynamic balancer, emulated devices (run by run_hosts)."""
  import optax

  import hetjax
  from hetjax import models as zoo
  from hetjax.input import data

  hetjax.initialize()
  config = hetjax.TrainConfig(global_batch=96, microbatch=4, balancer="dynamic", check_every=0)
  trainer = hetjax.Trainer(zoo.build("cnn", kind="image", num_classes=10), optax.sgd(0.1),
                           data.load("digits"), config)
  summary = trainer.fit(steps, out=out)
  return {"shares": [list(s) for s in trainer.history.shares], "goodput": summary.get("goodput")}


def test_an_input_starved_host_gets_a_smaller_share_and_its_wait_shows_as_waiting_for_input(tmp_path):
  runs = run_hosts("test_input_bound:train_input_bound", hosts=3, args=(16, str(tmp_path)),
                   env={"HETJAX_DEVICE_SAMPLE_MS": f"{DEVICE_MS:g}"},
                   host_env={STARVED: {"HETJAX_INPUT_SAMPLE_MS": f"{INPUT_MS:g}"}}, timeout_s=600)
  shares = np.array(runs[0]["shares"])
  assert tuple(shares[0]) == (32, 32, 32)  # Equal until the balancer has measured steps.
  # Past its probing steps, the balancer keeps the starved host at a third of the others or less.
  for last in shares[-4:]:
    assert last[STARVED] * 3 <= min(last[0], last[1]), shares.tolist()
  # Every host's phase file: the starved host waited for its input, the others hardly.
  job = goodput.read_job(str(tmp_path))
  waits = [h.seconds[goodput.INPUT] / h.wall_s for h in job.hosts]
  assert waits[STARVED] > 5 * max(waits[0], waits[1]), waits
  text = goodput_summary.lines(goodput_summary.from_job(job), None)
  assert "waiting for input" in next(line for line in text if line.startswith(f"  host {STARVED}:"))


def test_paced_input_sleeps_per_record_in_its_reader_and_keeps_the_records():
  import pickle

  from hetjax.cluster import emulate
  from hetjax.input import data

  slept = []
  source = data.load("digits")
  paced = emulate.paced_input_from_env(source, {"HETJAX_INPUT_SAMPLE_MS": "5"})
  paced._sleep = slept.append
  np.testing.assert_array_equal(paced[np.array([3, 1])]["x"], source[np.array([3, 1])]["x"])
  assert slept == [0.01] and len(paced) == len(source) and paced.info == source.info
  assert emulate.paced_input_from_env(source, {}) is source
  assert not hasattr(paced, "train_records")  # Only where the source has a training view.
  assert pickle.loads(pickle.dumps(emulate.PacedInput(source, 0.001)))[np.arange(2)]["y"].shape == (2,)
