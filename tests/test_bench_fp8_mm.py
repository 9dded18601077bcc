"""bench/fp8_mm.py's kernel under Triton's interpreter (its own process: TRITON_INTERPRET is read at import): the
dequantised product to float32 accuracy, whole and split stores, partial tiles at both edges."""
import os
import subprocess
import sys

from _shards import ROOT

CHECK = r"""
import sys
import torch
sys.path.insert(0, "bench")
import fp8_mm
torch.manual_seed(0)
# e4m3 values held in float32; 37 rows and 100 columns leave partial tiles of 16 x 32, K = 64 four K-steps
a = (torch.randn(37, 64) * 3).to(torch.float8_e4m3fn).float()
b = torch.randn(100, 64).to(torch.float8_e4m3fn).float()
scale = 0.37
exact = a.double() @ b.double().T * scale
u, k = 2.0 ** -24, a.shape[1]
bound = 2 * (k * u / (1 - k * u) + 2 * u) * (a.double().abs() @ b.double().abs().T) * scale + 1e-30
for split in (1, 2):
    out = fp8_mm.fp8_mm(a, b, scale, fp8_mm.INTERPRETER_TILES, split=split)
    worst = ((out.double() - exact).abs() / bound).max().item()
    print(f"split {split}: {tuple(out.shape)} {out.dtype} worst {worst:.3g}")
"""


def test_the_kernel_is_the_dequantised_product_to_fp32_accuracy():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout
    for line, split in zip(lines, (1, 2)):
        head, worst = line.split(" worst ")
        assert head == f"split {split}: (37, 100) torch.float32", line
        assert float(worst) <= 1.0, line


def test_without_a_gpu_the_bench_is_one_error_line(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    import torch

    import fp8_mm
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_mm.main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "GPU" in err[0]
