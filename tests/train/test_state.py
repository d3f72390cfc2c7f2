"""Training state round trip through safetensors + JSON (no pickle), bit-exact."""
import json
import random

import numpy as np
import pytest
import torch

from fastprompt.train.build import linear_schedule
from fastprompt.train.state import (
    META_FILE,
    TENSORS_FILE,
    capture_rng_state,
    load_training_state,
    restore_rng_state,
    save_training_state,
)


def _setup(fp16=False):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_schedule(2, 10))
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    return params, opt, sched, scaler


def _steps(params, opt, sched, n):
    for _ in range(n):
        loss = sum((p ** 2).sum() for p in params) + torch.randn(()) * 0  # uses the RNG too
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("fp16", [False, True])
def test_optimizer_scheduler_scaler_rng_round_trip(tmp_path, fp16):
    params, opt, sched, scaler = _setup(fp16)
    _steps(params, opt, sched, 3)
    if scaler is not None:
        scaler.scale(torch.ones(()))  # initialises the scale tensor
        scaler.update(1234.5)
    random.random(), np.random.rand()
    save_training_state(tmp_path, optimizer=opt, scheduler=sched, scaler=scaler, trainer={"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([META_FILE, TENSORS_FILE])
    json.loads((tmp_path / META_FILE).read_text())  # plain JSON
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    snapshot = [p.detach().clone() for p in params]
    _steps(params, opt, sched, 2)
    reference = [p.detach().clone() for p in params]

    params2, opt2, sched2, scaler2 = _setup(fp16)
    with torch.no_grad():
        for p, s in zip(params2, snapshot):
            p.copy_(s)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)  # scramble: the load must restore
    assert load_training_state(tmp_path, optimizer=opt2, scheduler=sched2, scaler=scaler2) == {"step": 3}
    assert (random.random(), float(np.random.rand()), torch.rand(3)).__repr__() == expected.__repr__()
    assert sched2.last_epoch == 3
    if fp16:
        assert scaler2.get_scale() == 1234.5
    _steps(params2, opt2, sched2, 2)
    for a, b in zip(params2, reference):
        assert torch.equal(a, b)
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_rng_capture_restore():
    tensors, meta = capture_rng_state()
    a = (torch.rand(2), np.random.rand(), random.random())
    restore_rng_state(tensors, meta)
    b = (torch.rand(2), np.random.rand(), random.random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_missing_or_foreign_state(tmp_path):
    params, opt, sched, scaler = _setup()
    with pytest.raises(FileNotFoundError, match="training state not found"):
        load_training_state(tmp_path, optimizer=opt, scheduler=sched, scaler=scaler)
    (tmp_path / META_FILE).write_text('{"format_version": 99}')
    with pytest.raises(ValueError, match="format 99"):
        load_training_state(tmp_path, optimizer=opt, scheduler=sched, scaler=scaler)


def test_linear_schedule():
    f = linear_schedule(2, 10)
    expected = [0.3333, 0.6667, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]
    assert [round(f(s), 4) for s in range(11)] == expected
