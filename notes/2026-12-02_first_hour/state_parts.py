"""What a saved training state holds: each part's tensors and bytes, and the non-tensor parts.

    python3 notes/2026-12-02_first_hour/state_parts.py logs/<run_id>/state_step<N>.pt

Reads the file with torch alone (no shipped code): a state is a torch.save archive (its zip comment the seal)."""
import collections
import sys

import torch


def tensors(obj, path=""):
    """(path, tensor) for every tensor inside nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{path}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{path}[{i}]")


def part_of(path):
    """model, grads, rng, or optimizer/<buffer kind> (summed over the parameters)."""
    parts = path.strip("/").split("/")
    if parts[0] == "optimizer" and parts[1] == "buffers":
        return f"optimizer/{parts[-1]}"
    return parts[0]


def main(path):
    state = torch.load(path, map_location="cpu", weights_only=False)
    sizes = collections.defaultdict(lambda: [0, 0])
    per_tensor = []
    for name, t in tensors(state):
        nbytes = t.untyped_storage().nbytes()        # what torch.save writes: the whole storage
        sizes[part_of(name)][0] += 1
        sizes[part_of(name)][1] += nbytes
        per_tensor.append((nbytes, name, tuple(t.shape), str(t.dtype).replace("torch.", "")))
    print(f"{'part':28s} {'tensors':>7s} {'MB':>8s}")
    for part, (n, nbytes) in sorted(sizes.items(), key=lambda kv: -kv[1][1]):
        print(f"{part:28s} {n:7d} {nbytes / 1e6:8.2f}")
    print(f"{'all tensors':28s} {sum(n for n, _ in sizes.values()):7d} {sum(b for _, b in sizes.values()) / 1e6:8.2f}")
    print("largest tensors:")
    for nbytes, name, shape, dtype in sorted(per_tensor, reverse=True)[:10]:
        print(f"  {nbytes / 1e6:8.2f} MB  {name}  {shape} {dtype}")
    other = {k: len(repr(v)) for k, v in state.items() if not any(True for _ in tensors(v))}
    print("other parts (characters of repr):", other)
    print(f"step {state['step']}; parameters {sum(t.numel() for t in state['model'].values()):,}")


if __name__ == "__main__":
    main(sys.argv[1])
