"""How fast a forward could be on this CPU: the compiled forward, the same modules run
eagerly, and the *matmul floor* - the model's matrix multiplications at the best rate
this CPU gives one large square GEMM. ``cold_start.py``'s aot-warm child reports them
beside its first call, whose forward is most of it at depth."""

from __future__ import annotations

import statistics
import time


def forward_floors(model, call, compiled, tokens: int, rows: int) -> dict:
    """After the measured calls: the compiled forward and the same modules run eagerly
    (``force_eager`` sends every region to eager PyTorch), medians of 3; the GFLOP of the
    model's matrix multiplications (each ``nn.Linear`` on ``tokens`` rows, the head on the
    ``rows`` it computes); and the best rate this CPU gives a large square GEMM (2048^3,
    best of 5). Their quotient is a floor no forward here can beat."""
    import torch

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    gflop = (
        sum(2 * m.in_features * m.out_features * (rows if name.endswith("lm_head") else tokens) for name, m in linears)
        / 1e9
    )

    def median_s(fn):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def eager():
        with torch.compiler.set_stance("force_eager"):
            call(compiled)

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    peak = 2 * 2048**3 / best / 1e9
    return {
        "compiled_run_s": median_s(lambda: call(compiled)),
        "eager_run_s": median_s(eager),
        "matmul_gflop": gflop,
        "gemm_peak_gflops": peak,
        "matmul_floor_s": gflop / peak,
    }
