"""CUDA-event timing shared by the small diagnostics."""
import torch


def cuda_median_ms(fn, reps: int = 10, warmup: int = 3, sleep_cycles: int = 0) -> float:
    """Median milliseconds of ``fn()`` between two CUDA events over ``reps`` calls after ``warmup``.
    ``sleep_cycles`` > 0 queues a GPU sleep first, so the events time the device work alone
    (the host enqueues ``fn`` while the GPU sleeps)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
