"""gptkit.native.ops: waiting for the weights' move to huge pages."""

from __future__ import annotations

import pytest
import torch

from gptkit.native import library as kernels
from gptkit.native import ops

needs_kernels = pytest.mark.skipif(not kernels.load(), reason="this CPU has neither AVX2 nor AVX-512")


@needs_kernels
def test_await_huge_pages_returns_once_every_move_has_ended():
    """Two moves started (one 8 MiB tensor each, whole 2 MiB spans in it): after await_huge_pages neither thread runs;
    the tensors' values are unchanged."""
    tensors = [torch.arange(2 << 20, dtype=torch.float32) for _ in range(2)]
    started = []
    real_start = kernels.start_native_thread

    def recorded(work, name, exit_wait_s):
        started.append(real_start(work, name, exit_wait_s))
        return started[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "start_native_thread", recorded)
        for t in tensors:
            ops.back_with_huge_pages([t])
    ops.await_huge_pages()
    assert len(started) == 2 and not any(thread.is_alive() for thread in started)
    assert all(torch.equal(t, torch.arange(2 << 20, dtype=torch.float32)) for t in tensors)
