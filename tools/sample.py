"""Text from a trained model: what did the run learn?

    python3 tools/sample.py --checkpoint=logs/<run_id>/state_step001480.pt --prompt="The meaning of life is"

Reads any state the trainer saved (--save_checkpoint, --checkpoint_every; with several GPUs any rank's file: the
weights are on every rank; a damaged one is refused by its seal, as --resume refuses it) and builds the model with
train_gpt.py's own code, its rotary (YaRN) state brought to where training left it. GPT-2 BPE needs tiktoken's two
table files, downloaded once into its cache folder (TIKTOKEN_CACHE_DIR chooses it); offline without them, one error
line names the folder, the files it lacks and the fixes.
--encoding=bytes works offline for models trained on data/tokenize_docs.py --encoding=bytes shards. Runs on a GPU when
there is one, else on the CPU. Needs torch (the README) and tiktoken (python3 -m pip install -r tools/requirements.txt).
Exit codes: 0 done, 1 the gpt2 tables cannot be loaded, 2 bad arguments, an unusable checkpoint or tiktoken missing.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "data"), str(ROOT / "tools")]
from runlogs import ToolArgumentParser, finite_float, missing_dependencies, user_path  # noqa: E402


def load_model(path: str, device):
    """(model in eval mode, its Hyperparameters, ws_short, ws_long): the windows it was last trained or validated
    with (the final validation's long window for a finished run)."""
    import torch
    import train_gpt as tg
    import harness
    state = load_state(path)
    try:
        hp = harness.from_dict(tg.Hyperparameters(), state["hyperparameters"])
        # sdpa takes any length and any mask on any device; the training kernels' numerics do not matter here.
        model = tg.build_model(dataclasses.replace(hp, use_fp8=False), device, "sdpa")
        model.load_state_dict(state["model"])
        step = int(state["step"])
        ws_long = tg.replay_yarn(model, hp, step)
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as e:   # edited, or another code's
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise harness.ConfigError(f"{path} does not build this code's model ({type(e).__name__}: {first_line[:200]})"
                                  "; give a state_step*.pt written by this train_gpt.py") from None
    model.eval()
    ws_short = tg.schedule_at(max(min(step, hp.num_iterations) - 1, 0), hp).ws_short
    if step >= hp.num_iterations:
        ws_long = hp.ws_long_final_val
    return model, hp, ws_short, ws_long


def load_state(path: str) -> dict:
    """A state file as the trainer wrote it (any rank's: only the weights are used), its seal checked as the
    trainer's --resume checks it (harness.read_sealed_state): a damaged state is refused, not sampled."""
    import harness
    return harness.read_sealed_state(path, needs=("model", "hyperparameters", "step"))


def decodable(enc) -> list[bool]:
    """Which ids up to <|endoftext|> the encoding can turn back into text (the bytes encoding has only 257 of them;
    ids past it are the vocabulary's padding)."""
    ok = []
    for i in range(enc.eot_token + 1):
        try:
            enc.decode_single_token_bytes(i)
            ok.append(True)
        except KeyError:
            ok.append(False)
    return ok


def generate(model, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int, generator,
             ws_short: int, ws_long: int, context: int, allowed: list[bool]) -> list[int]:
    """prompt + new tokens. Each token: the model's next-token scores over the last `context` tokens, restricted to
    the `allowed` ids, then greedy (temperature 0) or sampling from softmax(scores / temperature) over the top_k
    (0: all). The input is padded at the end to a multiple of 16 tokens with a separate document: every layer is
    causal, so padding after the last real token cannot change its scores."""
    import torch
    import train_gpt as tg
    device = model.lm_head.device
    ids = list(prompt)
    banned = ~torch.tensor(allowed, device=device)
    for _ in range(max_new_tokens):
        ctx = ids[-context:]
        n = len(ctx)
        padded = -(-n // 16) * 16
        inputs = torch.tensor(ctx + [tg.BOS_ID] * (padded - n), dtype=torch.int32, device=device)
        cu_seqlens = torch.tensor([0, n, padded], dtype=torch.int32, device=device)
        scores = model.logits(inputs, cu_seqlens, ws_short, ws_long, padded)[n - 1]      # (V,) fp32
        scores = scores[: len(allowed)].masked_fill(banned, float("-inf"))
        if temperature == 0:
            nxt = int(scores.argmax())
        else:
            if top_k > 0:
                kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            # less the best score first: at a tiny temperature the quotients would overflow to inf - inf = NaN
            scores = scores.double()
            probs = torch.softmax((scores - scores.max()) / temperature, dim=-1)
            nxt = int(torch.multinomial(probs.cpu(), 1, generator=generator))
        ids.append(nxt)
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = ToolArgumentParser(prog="tools/sample.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, type=user_path,
                    help="a state_step<step>.pt file written by train_gpt.py")
    ap.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    ap.add_argument("--max_new_tokens", type=int, default=100)
    ap.add_argument("--temperature", type=finite_float, default=0.8, help="0: always the most likely token")
    ap.add_argument("--top_k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    ap.add_argument("--num_samples", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--encoding", default="gpt2", choices=("gpt2", "bytes"),
                    help="the tokenizer the training shards were made with")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1 or args.temperature < 0 or args.top_k < 0:
        ap.error("--max_new_tokens and --num_samples must be >= 1, --temperature and --top_k >= 0")
    if not 0 <= args.seed < 2**63:
        ap.error(f"--seed={args.seed} must be 0 .. 2**63 - 1")
    missing = missing_dependencies("tools/sample.py", "tiktoken")
    if missing:
        print(missing, file=sys.stderr)
        return 2

    import torch
    import train_gpt as tg
    from tokenize_docs import get_encoding
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device=cuda but no CUDA GPU is visible; use --device=cpu")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    enc = get_encoding(args.encoding)                 # offline: a SystemExit("error: ...") that names the fixes
    try:
        model, hp, ws_short, ws_long = load_model(args.checkpoint, device)
    except tg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = [tg.BOS_ID] + enc.encode(args.prompt, allowed_special="all")
    allowed = decodable(enc)
    generator = torch.Generator().manual_seed(args.seed)
    for k in range(args.num_samples):
        ids = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, ws_short,
                       ws_long, hp.stages[-1].max_doc_len, allowed)
        if k:
            print("-" * 40)
        print(args.prompt + enc.decode(ids[len(prompt):], errors="replace"), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
