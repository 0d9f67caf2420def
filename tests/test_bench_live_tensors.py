"""bench/live_tensors.py: the live-tensor peak (a GPU's max_memory_allocated, on the CPU) counts exactly."""

from __future__ import annotations

import torch

from bench.live_tensors import LiveTensorPeak

MB = 1 << 20  # 1 MiB = 262144 FP32 elements


def test_counts_a_known_forward_backward_exactly():
    torch.manual_seed(0)
    w = torch.randn(512, 512, requires_grad=True)  # 1 MiB each
    x = torch.randn(512, 512)
    with LiveTensorPeak() as live:
        start = live.start_bytes
        assert start >= 2 * MB  # w and x (and whatever else this process keeps alive)
        y = (x @ w).relu()  # mm out (1 MiB) and relu out (1 MiB) coexist; the mm out dies, relu's is saved
        assert live.live_bytes - start == MB
        assert live.peak_bytes - start == 2 * MB
        loss = y.sum()
        del y  # still alive: autograd saved relu's output
        assert live.live_bytes - start == MB + 4
        # backward: the seed gradient (4 bytes) and threshold_backward's output (1 MiB) while relu's saved output
        # lives; autograd frees that after relu's node ran, before x.t() @ g makes w.grad (1 MiB)
        loss.backward()
        assert live.peak_bytes - start == 2 * MB + 8
        del loss
        assert live.live_bytes - start == MB  # w.grad only
    assert w.grad is not None and w.grad.nbytes == MB


def test_views_and_in_place_results_add_nothing_and_reset_peak_restarts():
    a = torch.zeros(256, 1024)  # 1 MiB, alive before entry
    with LiveTensorPeak() as live:
        start = live.live_bytes
        v = a.t()[3:]  # views of a: its storage, counted at entry
        a.add_(1.0)  # in place: returns a
        v.mul_(2.0)
        assert live.live_bytes == start and live.peak_bytes == start
        b = a.to(torch.bfloat16)  # a 0.5 MiB cast
        assert live.live_bytes - start == MB // 2 and live.peak_op.startswith("aten._to_copy")
        del b
        live.reset_peak()
        c = torch.empty(1024, dtype=torch.uint8)
        assert live.peak_bytes - start == 1024
        del c, v
        assert live.live_bytes == start
