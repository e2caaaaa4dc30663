"""A flat token file (nanoGPT's .bin) read as fixed windows by global index."""

import pickle

import numpy as np
import pytest

from hetjax.input import data, tokenfile


def _bin(tmp_path, tokens, dtype="uint16", name="train.bin"):
  path = tmp_path / name
  np.asarray(tokens, dtype=dtype).tofile(path)
  return str(path)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_windows_are_the_file_cut_in_seq_len_pieces(tmp_path, dtype):
  tokens = (np.arange(1003) * 7919) % 50000
  path = _bin(tmp_path, tokens, dtype)
  source = data.load(f"tokenfile:{path}", seq_len=10, token_dtype=dtype, vocab_size=50304)
  assert len(source) == 100 and source.info.kind == "tokens" and source.info.vocab_size == 50304
  got = source[np.array([99, 3, 3, 0])]["x"]
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, tokens[:1000].reshape(100, 10)[[99, 3, 3, 0]])
  # A record is the same whatever else is read with it (invariant 1), and in a worker.
  again = pickle.loads(pickle.dumps(source))
  np.testing.assert_array_equal(again[np.array([3])]["x"][0], got[1])


def test_the_vocabulary_defaults_to_the_largest_id_plus_one(tmp_path, monkeypatch):
  monkeypatch.setattr(tokenfile, "_SCAN_TOKENS", 7)  # Several chunks, the maximum in a late one.
  path = _bin(tmp_path, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 979, 3, 2, 3])
  assert data.load(f"tokenfile:{path}", seq_len=4).info.vocab_size == 980


def test_a_billion_token_file_is_read_without_reading_it_whole(tmp_path):
  path = tmp_path / "big.bin"
  with open(path, "wb") as f:  # Sparse: 2 GB on paper, two blocks on disk.
    f.truncate(2 * 10**9)
    f.seek(2 * (10**9 - 64))
    np.arange(64, dtype=np.uint16).tofile(f)
  source = data.load(f"tokenfile:{path}", seq_len=64, vocab_size=50304)
  last = len(source) - 1
  assert len(source) == 10**9 // 64
  np.testing.assert_array_equal(source[np.array([last, 0])]["x"],
                                [np.arange(64), np.zeros(64)])
  sampler = data.GlobalSampler(len(source), 32, seed=0)
  assert source[sampler.indices(10**6)]["x"].shape == (32, 64)


@pytest.mark.parametrize("size, kwargs, message", [
    (None, {"seq_len": 8}, "does not exist"),
    (11, {"seq_len": 2}, "not a multiple of 2"),
    (20, {"seq_len": 11}, "fewer than one window of --seq-len 11"),
    (20, {}, "needs --seq-len"),
    (20, {"seq_len": 4, "token_dtype": "int8"}, "--token-dtype"),
])
def test_a_bad_token_file_is_refused_before_jax_naming_the_fix(tmp_path, size, kwargs, message):
  path = tmp_path / "t.bin"
  if size is not None:
    path.write_bytes(b"\0" * size)
  with pytest.raises(ValueError, match=message):
    data.check_dataset_name(f"tokenfile:{path}", None, **kwargs)


def test_an_id_past_the_vocabulary_is_refused_with_its_window(tmp_path):
  path = _bin(tmp_path, [1, 2, 3, 4, 5, 600, 7, 8])
  source = data.load(f"tokenfile:{path}", seq_len=4, vocab_size=512)
  with pytest.raises(ValueError, match="window 1 holds token id 600, not below --vocab-size 512"):
    source[np.array([0, 1])]


def test_synthetic_tokens_take_the_sequence_flags_and_images_refuse_them():
  source = data.load("tokens", seq_len=64, vocab_size=50304)
  assert source[np.arange(2)]["x"].shape == (2, 64) and source.info.vocab_size == 50304
  with pytest.raises(ValueError, match="apply to token datasets"):
    data.check_dataset_name("digits", None, seq_len=64)
  assert data.evaluation_split("tokenfile:/x.bin") is None


def test_hetjax_train_reads_a_token_file_and_refuses_a_bad_one_before_jax(tmp_path, capsys):
  import json

  from hetjax import cli
  path = _bin(tmp_path, (np.arange(4096) * 7) % 61)
  base = ["train", "--model", "transformer", "--dataset", f"tokenfile:{path}", "--steps", "2",
          "--global-batch", "8", "--microbatch", "4", "--vocab-size", "64"]
  assert cli.main(base + ["--seq-len", "4097", "--out", str(tmp_path / "no")]) == 2
  assert "fewer than one window of --seq-len 4097" in capsys.readouterr().err
  assert cli.main(base + ["--seq-len", "16", "--out", str(tmp_path / "run")]) == 0
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
