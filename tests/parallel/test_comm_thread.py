"""CommThread: calls run in submission order off the submitting thread, an error stops the issuing and reaches
drain(), and close() lets the thread exit."""

from __future__ import annotations

import threading

import pytest
import torch

from parallel.comm_thread import CommThread


def test_calls_run_in_order_on_another_thread_without_grad_mode():
    comm = CommThread("test-comm")
    seen = []
    for i in range(200):
        comm.submit(lambda i=i: seen.append((i, threading.current_thread().name, torch.is_grad_enabled())))
    comm.drain()
    assert [i for i, _, _ in seen] == list(range(200))
    assert {name for _, name, _ in seen} == {"test-comm"}
    assert not any(grad for _, _, grad in seen)
    comm.close()


def test_an_error_skips_later_calls_and_is_raised_by_drain():
    comm = CommThread()
    seen = []
    comm.submit(seen.append, 1)
    comm.submit(lambda: 1 / 0)
    comm.submit(seen.append, 3)    # after a failed call nothing more is issued
    with pytest.raises(ZeroDivisionError):
        comm.drain()
    assert seen == [1]
    comm.submit(seen.append, 4)    # raised once, then the thread issues again
    comm.drain()
    assert seen == [1, 4]
    comm.close()


def test_close_lets_the_thread_finish_and_exit():
    comm = CommThread()
    seen = []
    comm.submit(seen.append, 1)
    comm.close()
    comm._thread.join(timeout=10)
    assert seen == [1] and not comm.alive
    comm.drain()                   # nothing to wait for
    with pytest.raises(RuntimeError, match="closed"):
        comm.submit(seen.append, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_calls_queued_after_use_stream_run_on_that_stream():
    comm = CommThread()
    side = torch.cuda.Stream()
    seen = []
    comm.submit(lambda: seen.append(torch.cuda.current_stream().cuda_stream))
    comm.use_stream(side)
    comm.submit(lambda: seen.append(torch.cuda.current_stream().cuda_stream))
    comm.drain()
    assert seen == [torch.cuda.default_stream().cuda_stream, side.cuda_stream], (seen, side)
    comm.close()
