"""Time the embedding tables' backward: inductor's decomposition against aten's sorted CUDA kernel.

    git worktree add /tmp/at-cc2c822 cc2c822   # the code it was written for (PINNED_COMMIT): it imports its modules
    python3 notes/2026-11-26_speed3_H200/embedding_bwd.py --repo=/tmp/at-cc2c822 [--tokens=49152,16384] [--tables=4]

One CUDA GPU, about a minute. A micro-batch looks up its token ids in 4 tables (embed and the 3 value embeddings,
each 50304 x 768 bf16). Compiled, inductor decomposes each table's backward into an fp32 (V, D) zero fill, an atomic
add of every row's gradient into it and a conversion to bf16: passes over the whole table that cost the same at any
micro-batch size, so they weigh most where a rank's micro-batch is small (8 GPUs). aten's CUDA kernel, what eager
runs and what inductor itself falls back to on XPU, sorts the ids, sums each id's rows in fp32 and writes them into a
bf16 zero fill; the variant "aten, opaque" reaches it through a custom op that inductor cannot decompose.

For each token count and variant it prints the GPU's kernel ms of one forward + backward of all tables (from a
profiler trace, bench/attention.py's gpu_kernel_ms) with its largest kernels, and the largest difference of the
tables' gradients from a float64 sum, over the largest gradient (both variants sum in fp32 and round once to bf16:
they differ in order only). Token ids come from data/synthetic.py's Zipf-like generator.
"""
from __future__ import annotations

import argparse
import os
import sys

# The code this script was written for (it has not run yet). It imports that code from a checkout of this commit
# (--repo), never from the tree around it, whose names have moved on since.
PINNED_COMMIT = "cc2c82267626f5c7e668d6db50f6521de818be67"


def pinned_checkout() -> str:
    """The checkout of PINNED_COMMIT that --repo=PATH (or --repo PATH) names, taken out of sys.argv; without one, one
    error line that names the commit to check out. Nothing heavier than os and sys is imported before it."""
    argv, repo = sys.argv[1:], None
    for i, arg in enumerate(argv):
        if arg == "--repo" or arg.startswith("--repo="):
            repo = arg[len("--repo="):] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            sys.argv[1:] = argv[:i] + argv[i + (1 if "=" in arg else 2):]
            break
    if repo is None or not os.path.isfile(os.path.join(repo, "train_gpt.py")):
        short = PINNED_COMMIT[:7]
        found = "no --repo" if repo is None else f"--repo={repo} holds no train_gpt.py"
        sys.exit(f"error: {os.path.basename(__file__)} runs on a checkout of {PINNED_COMMIT} ({found}): "
                 f"git worktree add /tmp/at-{short} {short}, then pass --repo=/tmp/at-{short}")
    return os.path.abspath(repo)


ROOT = pinned_checkout()  # the checkout's root
sys.path[:0] = [ROOT, os.path.join(ROOT, "data"), os.path.join(ROOT, "bench")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

import train_gpt as tg  # noqa: E402
import synthetic  # noqa: E402  (data/synthetic.py)
from attention import gpu_kernel_ms  # noqa: E402  (bench/attention.py)


@torch.library.custom_op("nanogpt_bench::embedding_backward", mutates_args=())
def embedding_backward(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    """aten's dense embedding backward, opaque to inductor."""
    return torch.ops.aten.embedding_dense_backward(grad, ids, num_rows, -1, False)


@embedding_backward.register_fake
def _embedding_backward_fake(grad: Tensor, ids: Tensor, num_rows: int) -> Tensor:
    return grad.new_empty((num_rows, grad.shape[-1]))


class OpaqueEmbedding(torch.autograd.Function):
    """F.embedding whose backward is embedding_backward."""

    @staticmethod
    def forward(ctx, ids: Tensor, table: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.num_rows = table.shape[0]
        return F.embedding(ids, table)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        return None, embedding_backward(grad.contiguous(), ids, ctx.num_rows)


VARIANTS = {"inductor (trainer)": F.embedding, "aten, opaque": OpaqueEmbedding.apply}


def loss_fn(lookup):
    """Each table's rows times a weight of their own, summed: the rows' gradients are the weights, in bf16."""
    def loss(ids: Tensor, tables: list[Tensor], weights: list[Tensor]) -> Tensor:
        return sum((lookup(ids, t).float() * w).sum() for t, w in zip(tables, weights))
    return loss


def table_grads(loss, ids: Tensor, tables: list[Tensor], weights: list[Tensor]) -> tuple[Tensor, ...]:
    return torch.autograd.grad(loss(ids, tables, weights), tables)


def exact_grads(ids: Tensor, tables: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
    """float64 sums of each id's row gradients (the weights rounded to the lookups' dtype)."""
    return [torch.zeros(t.shape, dtype=torch.float64, device=t.device).index_add_(0, ids, w.to(t.dtype).double())
            for t, w in zip(tables, weights)]


def max_relative_error(got: tuple[Tensor, ...], exact: list[Tensor]) -> float:
    return max(((g.double() - e).abs().max() / e.abs().max()).item() for g, e in zip(got, exact))


def inputs(num_tokens: int, num_tables: int, V: int, D: int, device: torch.device, seed: int = 0):
    """Token ids from data/synthetic.py's generator (taken modulo V), tables (V, D) bf16 and fp32 weights (T, D)."""
    vocab = synthetic.Vocabulary(seed)
    tokens = synthetic.make_tokens(vocab, [seed, 1, num_tokens], num_tokens, 0.5).astype("int64") % V
    ids = torch.from_numpy(tokens)
    gen = torch.Generator(device=device).manual_seed(seed)
    tables = [torch.randn(V, D, device=device, generator=gen).bfloat16().requires_grad_() for _ in range(num_tables)]
    weights = [torch.randn(num_tokens, D, device=device, generator=gen) for _ in range(num_tables)]
    return ids.to(device), tables, weights


def token_counts(text: str) -> list[int]:
    """--tokens: positive integers, comma-separated."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, comma-separated (e.g. 49152,16384), "
                                         f"got {text!r}")
    return counts


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=token_counts, default=[49152, 16384],
                    help="tokens per micro-batch, comma-separated (default 49152,16384)")
    ap.add_argument("--tables", type=int, choices=range(1, 9), default=4, metavar="1..8",
                    help="tables looked up with the same ids (default 4: embed + 3 ve)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: embedding_bwd.py times CUDA kernels and found no GPU; run it on the device")
    device = torch.device("cuda")
    hp = tg.Hyperparameters()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for T in args.tokens:
        ids, tables, weights = inputs(T, args.tables, hp.vocab_size, hp.model_dim, device)
        exact = exact_grads(ids, tables, weights)
        print(f"\n{T} tokens, {args.tables} tables, {ids.unique().numel()} distinct ids")
        for name, lookup in VARIANTS.items():
            torch._dynamo.reset()
            compiled = torch.compile(loss_fn(lookup), fullgraph=True, dynamic=False)
            err = max_relative_error(table_grads(compiled, ids, tables, weights), exact)
            kernels = gpu_kernel_ms(lambda: table_grads(compiled, ids, tables, weights))
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
            print(f"  {name:<20} {sum(kernels.values()):7.3f} ms   error {err:.2e}   "
                  + ", ".join(f"{k[:40]} {v:.3f}" for k, v in top))


if __name__ == "__main__":
    main(sys.argv[1:])
