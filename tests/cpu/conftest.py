"""Fixtures of the C library's tests."""

from __future__ import annotations

import pytest

from sparseinfer import cpu


@pytest.fixture(params=["avx2", "avx2_vnni", "avx2_128", "avx512"])
def isa(request):
    """Each kernel variant this CPU can run (the others skip), restored to "auto" after."""
    if request.param not in cpu.available_isas():
        pytest.skip(f"this CPU has no {request.param}")
    cpu.set_isa(request.param)
    assert cpu.get_isa() == request.param
    yield request.param
    cpu.set_isa("auto")


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request):
    """The C library's pool at 1 and 2 threads, restored after."""
    before = cpu.get_threads()
    cpu.set_threads(request.param)
    yield request.param
    cpu.set_threads(before)
