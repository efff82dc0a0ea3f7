"""bench/step_bench on the embedded model: the worker built as the server builds it (the one-call
step where the kernels are built), positive times for each kind of step, bad sizes refused."""

from __future__ import annotations

import pytest

from bench import step_bench
from model.kernels import kernel_status, load_kernels


def test_times_each_kind_of_step_on_the_served_worker():
    load_kernels()
    got = step_bench.run(None, rows=16, decode=3, steps=2)
    assert got["prompt"]["rows"] == 16 and got["decode"]["rows"] == 3
    for kind in ("prompt", "decode", "decode_one"):
        assert got[kind]["ms"] > 0
    assert got["prompt"]["rows_per_s"] == pytest.approx(16e3 / got["prompt"]["ms"], rel=1e-2)
    # the served setup of this CPU: the one-call step wherever the C++ kernels are built
    assert got["native_step"] == (kernel_status().level is not None)


def test_refuses_sizes_that_time_nothing():
    with pytest.raises(ValueError, match="--rows"):
        step_bench.run(None, rows=1, decode=1, steps=1)
