"""Why tests/test_model_gpu.py::test_kernels_torch_compiles_and_matches_the_fused_kernels[True] failed: the test's
4-layer model, compiled, with the FP8 MLP off and on, under --kernels=fused, torch and every op but one fused
(mlp:torch, ce:torch, fp8:torch, qk:torch); prints the loss and each parameter's gradient error against the fused run.
On a GPU, on a checkout of the commit it ran at (PINNED_COMMIT; it imports the tests and, through them, the trainer):

    git worktree add /tmp/at-7f62494 7f62494
    python3 notes/2026-12-03_recipe84_gpu/diag_fp8_mlp.py --repo=/tmp/at-7f62494 [on|off ...]
"""
import os
import sys

PINNED_COMMIT = "7f62494568c4282e5c5191b257aa15e7bcc67c85"


def pinned_checkout() -> str:
    """The checkout of PINNED_COMMIT that --repo=PATH names, taken out of sys.argv; without one, one error line that
    names the commit to check out. Nothing heavier than os and sys is imported before it."""
    repo = next((a[len("--repo="):] for a in sys.argv[1:] if a.startswith("--repo=")), None)
    sys.argv[1:] = [a for a in sys.argv[1:] if not a.startswith("--repo=")]
    if repo is None or not os.path.isfile(os.path.join(repo, "train_gpt.py")):
        short = PINNED_COMMIT[:7]
        found = "no --repo" if repo is None else f"--repo={repo} holds no train_gpt.py"
        sys.exit(f"error: {os.path.basename(__file__)} runs on a checkout of {PINNED_COMMIT} ({found}): "
                 f"git worktree add /tmp/at-{short} {short}, then pass --repo=/tmp/at-{short}")
    return os.path.abspath(repo)


ROOT = pinned_checkout()
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import torch  # noqa: E402

import train_gpt  # noqa: E402,F401  (the checkout's, before the tests import it)
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
