"""Why tests/test_model_gpu.py::test_kernels_torch_compiles_and_matches_the_fused_kernels[True] failed: the test's
4-layer model, compiled, with the FP8 MLP off and on, under --kernels=fused, torch and every op but one fused
(mlp:torch, ce:torch, fp8:torch, qk:torch); prints the loss and each parameter's gradient error against the fused run.
Run from the repository root on a GPU: python3 notes/2026-12-03_recipe84_gpu/diag_fp8_mlp.py [on|off ...]"""
import sys

sys.path[:0] = [".", "tests"]
import torch  # noqa: E402

import test_model_gpu as t  # noqa: E402

for fp8 in [a == "on" for a in sys.argv[1:]] or (False, True):
    torch._dynamo.reset()
    ref_loss, ref = t._loss_and_grads("fused", fp8)
    print(f"fp8_mlp={fp8} fused loss {ref_loss:.6f}", flush=True)
    for kernels in ("torch", "mlp:torch", "ce:torch,fp8:torch", "qk:torch"):
        torch._dynamo.reset()
        loss, grads = t._loss_and_grads(kernels, fp8)
        errs = {n: t.rel_err(grads[n], g) for n, g in ref.items() if g.norm() > 0}
        worst = sorted(errs.items(), key=lambda kv: -kv[1])[:6]
        bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
        print(f"  {kernels:20s} loss {loss:.6f} rel {abs(loss - ref_loss) / abs(ref_loss):.2e} nonfinite {bad} "
              f"worst {[(n, f'{e:.2e}') for n, e in worst]}", flush=True)
