"""MetricsLog: CSV rows, truncation on resume, TensorBoard scalars when the package is importable."""
import csv
import sys
import types

from fastprompt.train.logs import MetricsLog


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_rows_and_resume_truncation(tmp_path):
    log = MetricsLog(tmp_path, resume_step=None, tensorboard=False)
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step, "lr": float("nan")})
    log.close()
    rows = _rows(tmp_path / "train_log.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3"] and rows[0]["loss"] == "1" and rows[2]["loss"] == "0.333333"
    log = MetricsLog(tmp_path, resume_step=2, tensorboard=False)  # steps after the checkpoint are redone
    log.write({"step": 3, "loss": 0.5})
    log.close()
    rows = [(r["step"], r["loss"]) for r in _rows(tmp_path / "train_log.csv")]
    assert rows == [("1", "1"), ("2", "0.5"), ("3", "0.5")]


def test_tensorboard_scalars(tmp_path, monkeypatch):
    calls = []

    class FakeWriter:
        def __init__(self, logdir, purge_step=None):
            calls.append(("init", logdir, purge_step))

        def add_scalar(self, tag, value, step):
            calls.append((tag, value, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=FakeWriter))
    log = MetricsLog(tmp_path, resume_step=None, tensorboard=True)
    log.write({"step": 4, "epoch": 0, "loss": 0.25, "grad_norm": float("inf")})
    log.write({"step": 4, "stsb_dev": 81.5})
    log.close()
    assert calls == [("init", str(tmp_path / "tensorboard"), None), ("train/loss", 0.25, 4),
                     ("eval/stsb_dev", 81.5, 4), ("close",)]


def test_resume_rewrite_is_atomic(tmp_path, monkeypatch):
    """A crash while the log is truncated on resume (here: the disk fills up) keeps the whole history."""
    import errno

    import fastprompt.io

    log = MetricsLog(tmp_path, resume_step=None, tensorboard=False)
    for step in range(1, 6):
        log.write({"step": step, "loss": 1.0})
    log.close()
    before = (tmp_path / "train_log.csv").read_bytes()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fastprompt.io.os, "fsync", full_disk)
    try:
        MetricsLog(tmp_path, resume_step=3, tensorboard=False)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    else:
        raise AssertionError("the failed write was not reported")
    assert (tmp_path / "train_log.csv").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_log.csv"]  # no temporary file left
