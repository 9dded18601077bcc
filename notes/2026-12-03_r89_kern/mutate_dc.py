"""Mutation check of tests/test_dc.py: one small wrong edit at a time to triton_kernels.py section 10 (the DC-MHA
correction's reference and kernels), tests/test_dc.py run on it (stopping at the first failure), the file restored
by `git checkout -- triton_kernels.py`. Run from the repository root on a clean tree:

    python3 notes/2026-12-03_r89_kern/mutate_dc.py [ID ...]          # all mutants, or the named ones
    python3 notes/2026-12-03_r89_kern/mutate_dc.py --gpu k-round-a    # the file's GPU tests only (on the device)

Prints one line per mutant: id, caught (a test failed) or SURVIVED, the first failing test, seconds.
"""
import re
import subprocess
import sys
import time

FILE = "triton_kernels.py"
# (id, what is wrong, old text, new text); old must occur exactly once in FILE
MUTANTS = [
    # the plain-PyTorch reference
    ("ref-sign", "reference subtracts the correction",
     "return (y.to(acc) + correction).to(y.dtype)", "return (y.to(acc) - correction).to(y.dtype)"),
    ("ref-no-c-round", "reference keeps w2*A in fp32 (no bf16 rounding of C)",
     "c = (w2.to(acc)[:, :, None] * a[:, None, :]).to(v.dtype).to(acc)",
     "c = (w2.to(acc)[:, :, None] * a[:, None, :])"),
    ("ref-round-a", "reference rounds A, not w2*A (the scoping note's reading)",
     "c = (w2.to(acc)[:, :, None] * a[:, None, :]).to(v.dtype).to(acc)",
     "c = (w2.to(acc)[:, :, None] * a.to(v.dtype).to(acc)[:, None, :])"),
    ("w1-not-normed", "w1 is the raw gate value (no RMS norm over the heads)",
     "return F.rms_norm(r1.to(acc_dtype(r1.dtype)), (r1.shape[-1],), eps=DC_W1_EPS).to(r1.dtype)",
     "return r1"),
    ("w1-eps", "w1's RMS norm with the trainer's eps 2^-23, not 1e-6",
     "DC_W1_EPS = 1e-6 ", "DC_W1_EPS = RMS_EPS_DC "),
    ("window-111", "DC_WINDOW = 111 (one key short of the record's 112)",
     "DC_WINDOW = 112 ", "DC_WINDOW = 111 "),
    ("ref-window-mask", "reference mask lets a key of the previous document in (> start - 1)",
     "return t - window + 1 + torch.arange(window, device=cu_seqlens.device) >= start[:, None]",
     "return t - window + 1 + torch.arange(window, device=cu_seqlens.device) >= start[:, None] - 1"),
    ("ref-scale", "reference softmax without the scale",
     "logits = scale * torch.einsum(", "logits = 1.0 * torch.einsum("),
    ("ref-w1-mix", "reference mixes the heads' softmaxes with sqrt|w1| instead of w1",
     'return torch.einsum("th,thi->ti", w1.to(acc), probs)',
     'return torch.einsum("th,thi->ti", w1.to(acc).abs().sqrt(), probs)'),
    # the kernels (run under the interpreter in float32 on CPU)
    ("k-fwd-sign", "forward kernel subtracts C @ v",
     "d[None, :], y + tl.dot(c, v), row_ok[:, None])", "d[None, :], y - tl.dot(c, v), row_ok[:, None])"),
    ("k-fwd-no-c-round", "forward kernel keeps w2*A in fp32 (no rounding of C)",
     "c = (w2[:, None] * a).to(v.dtype)                 # the rounding point of C",
     "c = (w2[:, None] * a)                 # the rounding point of C"),
    ("k-round-a", "forward kernel rounds A first, then w2*bf16(A) (interpreter: fp32, so a no-op on CPU)",
     "c = (w2[:, None] * a).to(v.dtype)                 # the rounding point of C",
     "c = (w2[:, None] * a.to(v.dtype).to(tl.float32)).to(v.dtype)"),
    ("k-default-window", "dc_correction_triton defaults to 111 keys",
     "cu_seqlens: Tensor, scale: float, window: int = DC_WINDOW,\n                         deterministic",
     "cu_seqlens: Tensor, scale: float, window: int = 111,\n                         deterministic"),
    ("k-window", "kernel query tile sees window + 1 keys (>= instead of >)",
     "& (cols[None, :] > rows[:, None] - window))", "& (cols[None, :] >= rows[:, None] - window))"),
    ("k-doc-start", "kernel query tile ignores the document start",
     "valid = (row_ok[:, None] & (cols[None, :] >= row_start[:, None])",
     "valid = (row_ok[:, None] & (cols[None, :] >= 0)"),
    ("k-fwd-scale", "forward launcher passes the scale without log2 e (kernel uses exp2)",
     "q, k, v, y, w1, w2, start, out, lse, T, window, scale * _LOG2E,",
     "q, k, v, y, w1, w2, start, out, lse, T, window, scale,"),
    ("k-fwd-no-w1", "forward kernel mixes the heads without w1",
     "a += w1[:, None] * (p / l_sum[:, None])", "a += (p / l_sum[:, None])"),
    ("k-swap-dkdv", "key-block kernel stores dk into dv and dv into dk",
     "_store_from_fp32(dk_ptr + offs, dk * scale, col_ok[:, None])\n    _store_from_fp32(dv_ptr + offs, dv, col_ok[:, None])",
     "_store_from_fp32(dv_ptr + offs, dk * scale, col_ok[:, None])\n    _store_from_fp32(dk_ptr + offs, dv, col_ok[:, None])"),
    ("k-rho-sign", "backward dS = P (w1 dA + rho)",
     "ds = (p * (w1[:, None] * da - rho[:, None])).to(k.dtype)",
     "ds = (p * (w1[:, None] * da + rho[:, None])).to(k.dtype)"),
    ("k-dq-scale", "backward dq without the softmax scale",
     "d[None, :], tl.dot(ds, k) * scale, row_ok[:, None])", "d[None, :], tl.dot(ds, k), row_ok[:, None])"),
    ("k-dw2", "backward dw2 = sum_s dM (A dropped)",
     "_store_from_fp32(dw2_ptr + rows * H + h, tl.sum(a * dm, 1), row_ok)",
     "_store_from_fp32(dw2_ptr + rows * H + h, tl.sum(dm, 1), row_ok)"),
    ("k-atomic-dk-scale", "atomic backward's dk without the softmax scale",
     "tl.atomic_add(dk_ptr + col_offs + h * HEAD_DIM, tl.dot(tl.trans(ds), q) * scale,",
     "tl.atomic_add(dk_ptr + col_offs + h * HEAD_DIM, tl.dot(tl.trans(ds), q),"),
    ("k-key-loop", "key-block kernel stops half a window early (drops late queries)",
     "b1 = tl.minimum(tl.load(end_ptr + last), last + window)",
     "b1 = tl.minimum(tl.load(end_ptr + last), last + window // 2)"),
]


def main(ids, gpu):
    text = open(FILE).read()
    assert subprocess.run(["git", "diff", "--quiet", "--", FILE]).returncode == 0, f"{FILE} has local changes"
    chosen = [m for m in MUTANTS if not ids or m[0] in ids]
    survived = 0
    for mid, what, old, new in chosen:
        assert text.count(old) == 1, f"{mid}: the text to mutate occurs {text.count(old)} times"
        mutated = text.replace(old, new)
        if mid == "w1-eps":   # RMS_EPS is defined above section 10
            mutated = mutated.replace("RMS_EPS_DC", "RMS_EPS")
        open(FILE, "w").write(mutated)
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                   *(["-m", "gpu"] if gpu else []), "tests/test_dc.py"],
                                  capture_output=True, text=True, timeout=1200)
        finally:
            subprocess.run(["git", "checkout", "--", FILE], check=True)
        failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M) or re.findall(r"^ERROR (\S+)", proc.stdout, re.M)
        caught = proc.returncode != 0
        if gpu and " skipped" in proc.stdout.strip().splitlines()[-1]:
            sys.exit("error: the GPU tests were skipped (no CUDA GPU here)")
        inner = re.findall(r"FAILED tests/test_dc.py::(test_interp_\S+)", proc.stdout)
        first = (failed[0].split("::")[-1] if failed else "-") + (f" ({inner[0]})" if inner else "")
        survived += not caught
        print(f"{mid}\t{'caught' if caught else 'SURVIVED'}\t{first}\t{time.time() - t0:.0f}s\t{what}", flush=True)
    print(f"{len(chosen)} mutants, {len(chosen) - survived} caught, {survived} survived")


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if a != "--gpu"], "--gpu" in args)
