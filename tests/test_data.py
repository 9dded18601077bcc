"""Data loader tests: shard checks, BOS-aligned train batches against a pure-Python reference of the batch rule,
world-size invariance, batch-size messages, shard ends, validation batches, and bad input. All on CPU."""
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import checks
import train_gpt as tg
import harness  # noqa: E402
from _data_helpers import (BOS, RefTrainLoader, labelled_docs, load_script, read_shard, ref_max_num_docs,
                           ref_val_batches, write_shard)

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------------------------
# fixtures: small shards of three kinds
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory):
    """4 synthetic (FineWeb-shaped) train shards of 40k tokens, made with data/synthetic.py's generator."""
    syn, shards = load_script("synthetic"), load_script("shards")
    vocab = syn.Vocabulary(seed=1)
    out = tmp_path_factory.mktemp("syn")
    for k in range(1, 5):
        shards.write_shard(str(out / f"fineweb_train_{k:06d}.bin"), syn.make_tokens(vocab, [1, 1, k], 40_000, 0.5))
    return out


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Train shards made by data/tokenize_docs.py (bytes encoding) from generated English-like text."""
    tok = load_script("tokenize_docs")
    rng = np.random.default_rng(5)
    words = ["the", "data", "loader", "reads", "shards", "of", "tokens", "and", "every", "document", "starts",
             "with", "a", "marker", "über", "naïve", "42", "—", "\n"]
    src = tmp_path_factory.mktemp("text_src")
    for f in range(4):
        docs = [" ".join(rng.choice(words, int(rng.lognormal(np.log(60), 1.0)) + 1)) for _ in range(60)]
        (src / f"part{f}.txt").write_text("\n\n".join(docs), encoding="utf-8")
    out = tmp_path_factory.mktemp("text_out")
    tok.tokenize_to_shards([str(src)], str(out), tok.get_encoding("bytes"), shard_tokens=30_000, val_docs=3,
                           txt_split="blank_line", threads=1)
    return out


@pytest.fixture(scope="module")
def labelled_dir(tmp_path_factory):
    """3 shards of labelled documents (every token of document d is its label), so a segment names its document."""
    rng = np.random.default_rng(0)
    out = tmp_path_factory.mktemp("lab")
    label = 0
    for k in range(1, 4):
        tokens = [7, 7, 7] + labelled_docs(rng, 400, label, median=60)   # leading tokens before the first BOS
        label += 400
        write_shard(str(out / f"fineweb_train_{k:06d}.bin"), tokens)
    return out


def shard_files(folder, kind="train"):
    return harness.resolve_shards(os.path.join(str(folder), f"*_{kind}_*.bin"), kind)


def as_lists(batch):
    inputs, targets, cu = batch
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
    return inputs.tolist(), targets.tolist(), cu.tolist()


# ------------------------------------------------------------------------------------------------------------------
# shard format
# ------------------------------------------------------------------------------------------------------------------

def test_max_num_docs_values():
    assert [tg.max_num_docs(n, 300) for n in (16384, 32768, 49152, 262144)] == [128, 128, 256, 896]
    # ours holds at least as many segments as record 80's 64 / 96 / 128 at the record's micro-batch sizes
    assert checks.UPSTREAM_DOC_CAPACITY == {16384: 64, 32768: 96, 49152: 128}
    assert all(tg.max_num_docs(n, 300) >= room for n, room in checks.UPSTREAM_DOC_CAPACITY.items())
    for n in [1, 127, 38_400, 38_401, 38_700, 100_000, 1_000_000]:
        for bound in (1, 7, 100, 300):
            assert tg.max_num_docs(n, bound) == ref_max_num_docs(n, bound)


def test_shard_roundtrip(tmp_path):
    tokens = list(np.random.default_rng(0).integers(0, 50257, 1000))
    path = write_shard(str(tmp_path / "a.bin"), tokens)
    assert checks.shard_num_tokens(path) == 1000
    loaded = checks.read_tokens(path)[0]
    assert loaded.dtype == np.uint16 and loaded.shape == (1000,)
    assert loaded.astype(np.int32).tolist() == read_shard(path)


@pytest.mark.parametrize("kind", ["magic", "version", "truncated", "padded", "no_header"])
def test_bad_shards(tmp_path, kind):
    path = str(tmp_path / "bad.bin")
    if kind == "magic":
        write_shard(path, [1, 2, 3], magic=1234)
        expected = ["bad magic 1234", "20240520"]
    elif kind == "version":
        write_shard(path, [1, 2, 3], version=7)
        expected = ["bad version 7"]
    elif kind == "truncated":
        write_shard(path, [1, 2, 3], header_count=5)
        expected = ["truncated", "expected 1034 bytes", "found 1030"]
    elif kind == "padded":
        write_shard(path, [1, 2, 3], extra_bytes=b"xx")
        expected = ["expected 1030 bytes", "found 1032"]
    else:
        with open(path, "wb") as f:
            f.write(b"\x00" * 10)
        expected = ["truncated", "10 bytes"]
    for read in (checks.shard_num_tokens, checks.read_tokens):
        with pytest.raises(tg.DataError) as info:
            read(path)
        assert path in str(info.value)
        for text in expected:
            assert text in str(info.value)


def test_resolve_shards(tmp_path):
    for name in ["x_train_000002.bin", "x_train_000001.bin", "x_val_000000.bin"]:
        write_shard(str(tmp_path / name), [BOS, 1])
    assert [os.path.basename(p) for p in harness.resolve_shards(str(tmp_path / "x_train_*.bin"), "train")] == \
        ["x_train_000001.bin", "x_train_000002.bin"]
    with pytest.raises(tg.DataError) as info:                      # empty glob in an existing folder
        harness.resolve_shards(str(tmp_path / "fineweb_train_*.bin"), "train")
    message = str(info.value)
    assert "no file matches" in message and "--train_files" in message
    assert "python data/cached_fineweb10B.py" in message and "data/synthetic.py" in message
    with pytest.raises(tg.DataError) as info:                      # missing folder
        harness.resolve_shards(str(tmp_path / "nowhere" / "fineweb_val_*.bin"), "val")
    assert "does not exist" in str(info.value) and "--val_files" in str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# training batches against the reference
# ------------------------------------------------------------------------------------------------------------------

def run_both(files, plan, world_size, cap, bound):
    """Run train_batches for every rank and the reference through `plan` = [(global_batch, grad_accum, send)] until
    the plan ends or the data runs out; the implementation must run out at the same request as the reference.
    Returns the per-request, per-rank (inputs, targets, cu) lists of both."""
    shards = [read_shard(f) for f in files]
    ref = RefTrainLoader(shards)
    gb0, ga0, _ = plan[0]
    gens = [tg.train_batches(files, gb0, ga0, r, world_size, CPU, cap, bound) for r in range(world_size)]
    got, want = [], []
    for i, (gb, ga, send) in enumerate(plan):
        msg = (gb, cap, ga) if send else None
        try:
            want.append(ref.next_batch(gb // (ga * world_size), world_size, cap, bound))
        except EOFError:
            for g in gens:
                with pytest.raises(tg.DataError, match="ran out"):
                    g.send(msg)
            break
        got.append([as_lists(g.send(None) if i == 0 else g.send(msg)) for g in gens])
    return got, want


@pytest.mark.parametrize("source", ["synthetic", "text"])
@pytest.mark.parametrize("world_size,cap", [(1, 2048), (3, 300), (8, 512)])
def test_train_batches_match_reference(request, source, world_size, cap):
    files = shard_files(request.getfixturevalue(f"{source}_dir"))
    # three per-rank sizes (256, 512, 768) as in the record's schedule (the second phase also changes grad_accum),
    # small enough that the run crosses every shard end and then runs out
    plan = [(256 * world_size, 1, False)] * 3 + [(1024 * world_size, 2, True)] * 2 + \
           [(1024 * world_size, 2, False)] * 2 + [(768 * world_size, 1, True)] + [(768 * world_size, 1, False)] * 400
    got, want = run_both(files, plan, world_size, cap, bound=20)
    assert 8 <= len(got) < len(plan)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g == [tuple(x) for x in w], f"request {step} differs from the reference"


def test_quick_index_prefix_gives_the_same_batches(synthetic_dir, monkeypatch):
    """The first shard starts from a quick prefix index while the full one loads; batches must not change."""
    monkeypatch.setattr(tg, "_QUICK_INDEX_TOKENS", 1500)
    got, want = run_both(shard_files(synthetic_dir), [(4096, 1, False)] * 100, 4, 2048, 20)
    assert len(got) > 10 and got == [[tuple(x) for x in w] for w in want]


def test_quick_index_of_a_later_shard_gives_the_same_batches(synthetic_dir, monkeypatch):
    """A later shard whose full index is not ready starts from its quick index; where that runs out the
    loader waits for the full one (no skipped rest of the shard). Shard 2's full load is held back until the
    quick index has run out, so the quick path is taken; the batches equal the reference (the full index)."""
    monkeypatch.setattr(tg, "_QUICK_INDEX_TOKENS", 1500)
    files = shard_files(synthetic_dir)
    release, quick_reads = threading.Event(), []
    real_load, real_extend, real_read = tg._TrainShards._load, tg._TrainShards.extend, checks.read_tokens

    def held_load(self, k):
        if k == 1:
            assert release.wait(60)
        return real_load(self, k)

    def extend(self):
        if self._full_current is not None and self.shard == 1:     # shard 2's quick index ran out
            release.set()
        return real_extend(self)

    def read(path, max_tokens=None, out=None):
        if max_tokens is not None:
            quick_reads.append(files.index(path))
        return real_read(path, max_tokens, out)

    monkeypatch.setattr(tg._TrainShards, "_load", held_load)
    monkeypatch.setattr(tg._TrainShards, "extend", extend)
    monkeypatch.setattr(checks, "read_tokens", read)
    got, want = run_both(files[:3], [(4096, 1, False)] * 40, 1, 2048, 20)
    assert release.is_set() and 0 in quick_reads and 1 in quick_reads
    assert len(got) > 15 and got == [[tuple(x) for x in w] for w in want]


def test_worked_example_of_the_document_cap(tmp_path):
    """One rank (W = 1), micro-batches of N = 1500 tokens, a 5000-token shard with BOS at 0, 1000, 1100, 3000: at
    the caps 896 and 2048, the documents' segments and cu_seqlens."""
    tokens = [1 + i % 40000 for i in range(5000)]
    for p in (0, 1000, 1100, 3000):
        tokens[p] = BOS
    files = [write_shard(str(tmp_path / "w_train_000001.bin"), tokens)]
    cap_len = tg.max_num_docs(1500, 300)
    for cap, segments, cu in [(896, [(0, 896), (1000, 1100), (1100, 1605)], [0, 896, 996, 1500]),
                              (2048, [(0, 1000), (1000, 1100), (1100, 1501)], [0, 1000, 1100, 1500])]:
        position = tg.TrainPosition()
        gen = tg.train_batches(files, 1500, 1, 0, 1, CPU, cap, 300, position=position)
        inputs, targets, cu_seqlens = as_lists(next(gen))
        buf = [t for a, b in segments for t in tokens[a:b]]
        assert inputs == buf[:-1] and targets == buf[1:]
        assert cu_seqlens == cu + [1500] * (cap_len - len(cu))
        assert (position.shard, position.cursor) == (0, 3)
        if cap == 896:      # the message applies to the batch it gets: document 3 cut at 2048 would give 1501
            inputs, _, cu_seqlens = as_lists(gen.send((1500, 2048, 1)))
            assert inputs == tokens[3000:4500] and cu_seqlens[:2] == [0, 1500]


@pytest.mark.parametrize("world_size", [1, 3])
def test_cap_messages_match_the_reference(labelled_dir, world_size):
    """The cap and the batch change by message, together or alone; each batch follows the reference with the cap
    the message named."""
    files = shard_files(labelled_dir)
    shards = [read_shard(f) for f in files]
    ref = RefTrainLoader(shards)
    plan = [(256, 32), (256, 32), (256, 64), (512, 64), (512, 64), (512, 16), (384, 16), (384, 16)] * 2
    gens = [tg.train_batches(files, 256 * world_size, 1, r, world_size, CPU, 32, 4) for r in range(world_size)]
    for i, (n, cap) in enumerate(plan):
        want = ref.next_batch(n, world_size, cap, 4)
        msg = (n * world_size, cap, 1) if i and plan[i - 1] != (n, cap) else None
        got = [as_lists(next(g) if i == 0 else g.send(msg)) for g in gens]
        assert got == [tuple(w) for w in want], i


def test_batches_over_upstreams_capacity_are_counted(labelled_dir, monkeypatch):
    """Micro-batches (of every rank) holding more segments than record 80's cu_seqlens would are counted in
    the stream position; sizes upstream has no entry for are not counted."""
    monkeypatch.setattr(checks, "UPSTREAM_DOC_CAPACITY", {256: 6})
    files = shard_files(labelled_dir)
    world_size, over = 2, 0
    positions = [tg.TrainPosition() for _ in range(world_size)]
    gens = [tg.train_batches(files, 512, 1, r, world_size, CPU, 2048, 4, position=positions[r])
            for r in range(world_size)]
    for _ in range(20):
        for g in gens:
            inputs, _, cu = as_lists(next(g))
            over += len(set(cu)) - 1 > 5          # segments = distinct boundaries - 1 (a lone BOS adds none)
    assert 0 < over < 40 and all(p.over_upstream_capacity == over for p in positions)
    position = tg.TrainPosition()
    gen = tg.train_batches(files, 1024, 1, 0, 1, CPU, 2048, 4, position=position)
    for _ in range(5):
        next(gen)
    assert position.over_upstream_capacity == 0


def test_resume_takes_the_cap_of_the_next_step(tmp_path):
    """Trainer.reset_schedule_state: a stream resumed inside stage 1 cuts documents at stage 1's cap, one resumed
    after stage 2 has started at stage 2's (tiny preset: 128 before step 20, 256 from it)."""
    hp = tg.parse_args(["--preset=tiny"])
    assert [st.max_doc_len for st in hp.stages] == [128, 256, 256] and tg.stage_starts(60, 3)[1] == 20
    rng = np.random.default_rng(6)
    files = [write_shard(str(tmp_path / "long_train_000001.bin"), labelled_docs(rng, 300, 0, median=400, sigma=0.3))]
    for steps_done, cap, batch in [(0, 128, 512), (10, 128, 512), (19, 128, 512), (20, 256, 768), (45, 256, 1024)]:
        host = SimpleNamespace(hp=hp, model=_Rotary(), train_files=files, grad_accum=2, rank=0, world_size=1,
                               device=CPU)
        tg.Trainer.reset_schedule_state(host, steps_done)
        assert (host.max_doc_len, host.global_batch) == (cap, batch), steps_done
        longest = 0
        for _ in range(6):
            _, _, cu = as_lists(next(host.loader))
            longest = max(longest, max(b - a for a, b in zip(cu, cu[1:])))
        assert longest == cap, steps_done          # documents of ~400 tokens: some piece reaches the cap


class _Rotary:
    def reset_rotary(self):
        pass

    def apply_yarn(self, old, new):
        pass


def segments_of(inputs, targets, cu):
    """Per segment: (its tokens, its target list) from one rank's batch, using cu_seqlens."""
    bounds = sorted(set(cu))
    return [(inputs[a:b], targets[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("world_size,grad_accum,cap", [(1, 1, 2048), (4, 2, 100), (8, 1, 64)])
def test_train_batch_properties(labelled_dir, world_size, grad_accum, cap):
    """On labelled documents: BOS starts, length cap, cu_seqlens shape, consecutive documents per rank in rank order,
    targets = inputs shifted by one; checked from the batches alone."""
    files = shard_files(labelled_dir)
    global_batch = 8 * 256
    n = global_batch // (grad_accum * world_size)
    gens = [tg.train_batches(files, global_batch, grad_accum, r, world_size, CPU, cap, 4) for r in range(world_size)]
    last_label = None
    for _ in range(12):
        for r, gen in enumerate(gens):
            inputs, targets, cu = as_lists(next(gen))
            assert len(inputs) == len(targets) == n
            assert len(cu) == ref_max_num_docs(n, 4)
            assert cu[0] == 0 and cu[-1] == n and all(a <= b for a, b in zip(cu, cu[1:]))
            assert inputs[1:] == targets[:-1]
            segs = segments_of(inputs, targets, cu)
            labels = []
            for k, (tokens, tgts) in enumerate(segs):
                assert tokens[0] == BOS and BOS not in tokens[1:]
                # the last segment lent its last token as the final target, unless that target is the BOS of a
                # 1-token segment (the rank had exactly N tokens after a document)
                lent = k == len(segs) - 1 and targets[-1] != BOS
                assert len(tokens) + lent <= cap
                if len(tokens) > 1:
                    labels.append(tokens[1])
                    assert set(tokens[1:]) == {tokens[1]}
                if k < len(segs) - 1:
                    assert tgts[-1] == BOS                             # target after a segment is the next BOS
            # consecutive documents within the rank, continuing from the previous rank / batch
            for a, b in zip(labels, labels[1:]):
                assert b == a + 1
            if last_label is not None and labels and labels[0] % 400 != 0:    # (400 documents per shard)
                assert labels[0] in (last_label + 1, last_label + 2)  # +2 only if a 1-token document was skipped
            last_label = labels[-1] if labels else last_label


def test_world_size_invariance(synthetic_dir):
    """One optimizer step reads the same tokens in the same order with W=1, A=8 and W=8, A=1 (before a shard end)."""
    files = shard_files(synthetic_dir)[:1]
    global_batch = 8 * 256
    single = tg.train_batches(files, global_batch, 8, 0, 1, CPU, 2048, 4)
    ranks = [tg.train_batches(files, global_batch, 1, r, 8, CPU, 2048, 4) for r in range(8)]
    steps = 0
    while True:
        try:
            one = [next(single) for _ in range(8)]
            eight = [next(g) for g in ranks]
        except tg.DataError:
            break
        for idx in range(3):
            assert torch.equal(torch.cat([b[idx] for b in one]), torch.cat([b[idx] for b in eight]))
        steps += 1
    assert steps >= 5


def test_batch_size_change_applies_to_the_answering_batch(labelled_dir):
    files = shard_files(labelled_dir)
    gen = tg.train_batches(files, 1024, 2, 1, 2, CPU, 2048, 4)
    sizes = [len(gen.send(None)[0])]
    sizes.append(len(gen.send((2048, 2048, 2))[0]))
    sizes.append(len(gen.send(None)[0]))
    sizes.append(len(gen.send((2048, 2048, 1))[0]))            # grad_accum change: 2048 / (1 * 2)
    sizes.append(len(gen.send((2048, 2048, 1))[0]))            # re-sending is idempotent
    batch = gen.send((3072, 2048, 1))
    sizes.append(len(batch[0]))
    assert sizes == [256, 512, 512, 1024, 1024, 1536]
    assert len(batch[2]) == ref_max_num_docs(1536, 4)


def test_shard_end_abandons_the_batch(tmp_path):
    """Shard 1 holds 1.4 joint batches: the second is abandoned and rebuilt from the start of shard 2."""
    n, world_size = 100, 2
    shard1 = []
    for d in range(25):                                        # 25 documents of 11 tokens: 275 tokens
        shard1 += [BOS] + [d + 1] * 10
    shard2 = [5, 5] + [BOS] + [500] * 400 + [BOS] + [501] * 400
    files = [write_shard(str(tmp_path / "s_train_000001.bin"), shard1),
             write_shard(str(tmp_path / "s_train_000002.bin"), shard2)]
    gens = [tg.train_batches(files, n * world_size, 1, r, world_size, CPU, 2048, 1) for r in range(world_size)]
    # batch 0: rank 0 takes documents 1..10 (the 10th cut to 2 tokens), rank 1 documents 11..20; batch 1 needs 20
    # more documents but only 5 are left, so it comes from shard 2: rank 0 from its first BOS, rank 1 from the second.
    b0 = [as_lists(next(g)) for g in gens]
    assert b0[0][0][:11] == [BOS] + [1] * 10 and b0[0][0][-1] == BOS and b0[0][1][-1] == 10
    assert b0[1][0][:2] == [BOS, 11] and b0[1][1][-1] == 20
    b1 = [as_lists(next(g)) for g in gens]
    assert b1[0][0] == [BOS] + [500] * 99 and b1[0][1] == [500] * 100
    assert b1[1][0] == [BOS] + [501] * 99
    assert b1[0][2][:2] == [0, 100]


def test_lone_bos_segment(tmp_path):
    """When a rank has collected exactly N tokens it takes one more 1-token segment (a lone BOS) of length 0."""
    shard = ([BOS] + [1] * 49) * 2 + [BOS] + [2] * 9 + ([BOS] + [3] * 99) * 3
    files = [write_shard(str(tmp_path / "a_train_000001.bin"), shard)]
    inputs, targets, cu = as_lists(next(tg.train_batches(files, 100, 1, 0, 1, CPU, 2048, 1)))
    assert inputs == [BOS] + [1] * 49 + [BOS] + [1] * 49 and targets[-1] == BOS
    assert cu[:4] == [0, 50, 100, 100] and set(cu[2:]) == {100}


# ------------------------------------------------------------------------------------------------------------------
# training errors
# ------------------------------------------------------------------------------------------------------------------

def test_training_data_runs_out(labelled_dir):
    files = shard_files(labelled_dir)
    gen = tg.train_batches(files, 8 * 1024, 1, 0, 8, CPU, 2048, 4)
    with pytest.raises(tg.DataError) as info:
        for _ in range(1000):
            next(gen)
    message = str(info.value)
    total = sum(checks.shard_num_tokens(f) for f in files)
    assert "ran out after reading all 3 shards" in message and f"{total:,} tokens" in message
    assert "python data/cached_fineweb10B.py 5" in message


@pytest.mark.parametrize("via_message", [False, True])
def test_batch_not_divisible(labelled_dir, via_message):
    files = shard_files(labelled_dir)
    with pytest.raises(tg.DataError) as info:
        if via_message:
            gen = tg.train_batches(files, 4096, 1, 0, 8, CPU, 2048, 4)
            next(gen)
            gen.send((4100, 2048, 1))
        else:
            tg.train_batches(files, 4096, 3, 0, 8, CPU, 2048, 4)
    assert "--stages" in str(info.value) and "--batch_slices" in str(info.value)


def test_short_documents_overflow_cu_seqlens(tmp_path):
    rng = np.random.default_rng(3)
    files = [write_shard(str(tmp_path / "short_train_000001.bin"), labelled_docs(rng, 3000, 0, median=8, sigma=0.3))]
    with pytest.raises(tg.DataError) as info:
        next(tg.train_batches(files, 4096, 1, 0, 1, CPU, 2048, 300))
    message = str(info.value)
    assert "--tokens_per_doc_bound=300" in message and "cu_seqlens" in message
    suggested = int(message.split("Lower it: --tokens_per_doc_bound=")[1].split()[0])
    gen = tg.train_batches(files, 4096, 1, 0, 1, CPU, 2048, suggested)
    for _ in range(5):                     # the suggested bound fits these batches (similar documents)
        try:
            next(gen)
        except tg.DataError as e:
            assert "tokens_per_doc_bound" not in str(e)
            break


def test_documents_cut_short_by_max_doc_len_name_it(tmp_path):
    """Long documents cut to a tiny max_doc_len make the many short pieces: the loader's message and the density
    check before compiling both name the stage's max_doc_len (issue 56); short documents themselves do not."""
    rng = np.random.default_rng(4)
    long_docs = write_shard(str(tmp_path / "long_train_000001.bin"), labelled_docs(rng, 1500, 0, median=400, sigma=0.2))
    with pytest.raises(tg.DataError) as info:
        next(tg.train_batches([long_docs], 4096, 1, 0, 1, CPU, 8, 300))
    assert "max_doc_len=8" in str(info.value) and "--stages" in str(info.value) and \
        "--tokens_per_doc_bound=" in str(info.value)
    room = tg.max_num_docs(4096, 300) - 1
    with pytest.raises(tg.ConfigError) as info:      # one stage's cap is enough to fail
        checks.check_document_density(long_docs, BOS, {(4096, 2048): room, (4096, 8): room})
    assert str(info.value).startswith("max_doc_len=8 in --stages cuts the documents in ") and \
        "--tokens_per_doc_bound=" in str(info.value)
    checks.check_document_density(long_docs, BOS, {(4096, 2048): room})          # uncut, they fit

    short_docs = write_shard(str(tmp_path / "short_train_000001.bin"), labelled_docs(rng, 3000, 0, median=8, sigma=0.3))
    for call in (lambda: next(tg.train_batches([short_docs], 4096, 1, 0, 1, CPU, 2048, 300)),
                 lambda: checks.check_document_density(short_docs, BOS, {(4096, 2048): room})):
        with pytest.raises((tg.DataError, tg.ConfigError)) as info:
            call()
        assert "max_doc_len" not in str(info.value) and "--tokens_per_doc_bound=" in str(info.value)


@pytest.mark.timeout(900)
def test_corrupt_next_shard_reaches_the_caller(labelled_dir, tmp_path):
    """The background thread loading shard 2 fails: the caller gets that error (not a hang, not StopIteration)."""
    files = shard_files(labelled_dir)
    bad = str(tmp_path / "fineweb_train_000002.bin")
    with open(files[1], "rb") as f:
        data = bytearray(f.read())
    data[:4] = (999).to_bytes(4, "little")
    with open(bad, "wb") as f:
        f.write(data)
    gen = tg.train_batches([files[0], bad, files[2]], 1024, 1, 0, 1, CPU, 2048, 4)
    with pytest.raises(tg.DataError) as info:
        for _ in range(10_000):
            next(gen)
    assert bad in str(info.value) and "bad magic 999" in str(info.value)


@pytest.mark.timeout(900)
def test_exception_in_loader_thread_is_reraised(labelled_dir, monkeypatch):
    """The error surfaces on the first request after the thread failed, long before shard 1 is used up."""
    files = shard_files(labelled_dir)
    real_read = checks.read_tokens
    failed = threading.Event()

    def failing_read(path, *args, **kwargs):
        if path == files[1]:
            failed.set()
            raise OSError("disk went away")
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(checks, "read_tokens", failing_read)
    gen = tg.train_batches(files, 1024, 1, 0, 1, CPU, 2048, 4)
    with pytest.raises(OSError, match="disk went away"):
        next(gen)                            # raises here if the thread already failed,
        assert failed.wait(30)
        time.sleep(0.05)                     # (the thread is finishing its except block)
        next(gen)                            # else here


# ------------------------------------------------------------------------------------------------------------------
# validation batches
# ------------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_size_val(tmp_path_factory):
    """A 10.5M-token val shard: random tokens with BOS at random places (1 in 500), BOS at the start of rank 1's
    chunk so that a chunk starting with BOS is covered."""
    rng = np.random.default_rng(11)
    n = 10_485_760 + 1000
    tokens = rng.integers(0, BOS, n).astype(np.uint16)
    tokens[rng.random(n) < 1 / 500] = BOS
    tokens[262_144] = BOS
    path = str(tmp_path_factory.mktemp("val") / "fineweb_val_000000.bin")
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, n
    with open(path, "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
    return path, tokens


@pytest.mark.parametrize("world_size,grad_accum", [(8, 1), (1, 8)])
def test_val_batches_cover_the_first_val_tokens(real_size_val, world_size, grad_accum):
    path, tokens = real_size_val
    val_batch, val_tokens, n_val = 2_097_152, 10_485_760, 262_144 * 8 // (world_size * grad_accum)
    all_batches = [[as_np(b) for b in tg.val_batches([path], val_batch, val_tokens, grad_accum, r, world_size, CPU,
                                                       300)] for r in range(world_size)]
    assert all(len(b) == 5 * grad_accum for b in all_batches)
    # order of the stream: forward f, then rank r
    ordered = [all_batches[r][f] for f in range(5 * grad_accum) for r in range(world_size)]
    assert np.array_equal(np.concatenate([b[0] for b in ordered]), tokens[:val_tokens].astype(np.int32))
    assert np.array_equal(np.concatenate([b[1] for b in ordered]), tokens[1:val_tokens + 1].astype(np.int64))
    for inputs, _, cu in ordered:
        bos = np.flatnonzero(inputs == BOS)
        assert len(cu) == ref_max_num_docs(n_val, 300)
        assert np.array_equal(cu[:len(bos) + 1], np.concatenate(([0], bos)))
        assert np.all(cu[len(bos) + 1:] == n_val)
    if world_size == 8:
        assert ordered[1][2][:2].tolist() == [0, 0]          # rank 1's chunk starts with BOS: empty first sequence
        assert len(ordered[0][2]) == 896


def as_np(batch):
    inputs, targets, cu = batch
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
    return inputs.numpy(), targets.numpy(), cu.numpy()


def test_val_next_shard_rule_matches_reference(tmp_path):
    rng = np.random.default_rng(2)
    shards = []
    # the first is too short for some forwards; in the second, a forward of 512 ending exactly at its end still moves
    # to the next shard, while one of 1024 (+1) at position 0 fits exactly and is read
    for k, n in enumerate([700, 1025, 4000]):
        tokens = rng.integers(0, 100, n)
        tokens[rng.random(n) < 0.02] = BOS
        shards.append([int(t) for t in tokens])
        write_shard(str(tmp_path / f"v_val_{k:06d}.bin"), shards[-1])
    files = shard_files(tmp_path, "val")
    for world_size, grad_accum in [(2, 2), (4, 1), (1, 4)]:
        for r in range(world_size):
            got = [as_lists(b) for b in tg.val_batches(files, 1024, 3072, grad_accum, r, world_size, CPU, 2)]
            want = ref_val_batches(shards, 1024, 3072, grad_accum, r, world_size, 2)
            assert got == [tuple(w) for w in want]


def test_val_errors(tmp_path):
    tokens = [BOS] + [1] * 5000
    files = [write_shard(str(tmp_path / "v_val_000000.bin"), tokens)]
    with pytest.raises(tg.DataError, match="--val_tokens=3000 is not a multiple of --val_batch_size=1024"):
        tg.val_batches(files, 1024, 3000, 1, 0, 1, CPU, 300)
    with pytest.raises(tg.DataError, match="--val_batch_size=1001 does not divide"):
        tg.val_batches(files, 1001, 4004, 1, 0, 8, CPU, 300)
    with pytest.raises(tg.DataError) as info:             # 5001 tokens cannot score 5120 (needs 5122)
        tg.val_batches(files, 1024, 5120, 1, 0, 1, CPU, 300)
    assert "5,122" in str(info.value) and "Lower --val_tokens" in str(info.value)
    assert len(list(tg.val_batches(files, 1024, 4096, 1, 0, 1, CPU, 300))) == 4     # 4098 <= 5001: fits
    short = [write_shard(str(tmp_path / "s_val_000000.bin"), labelled_docs(np.random.default_rng(0), 2000, 0, 4, 0.1))]
    with pytest.raises(tg.DataError, match="--tokens_per_doc_bound"):
        list(tg.val_batches(short, 2048, 2048, 1, 0, 1, CPU, 300))


@pytest.mark.gpu
def test_cuda_batches_equal_cpu_batches(synthetic_dir):
    files = shard_files(synthetic_dir)
    cpu = tg.train_batches(files, 4096, 1, 1, 2, CPU, 2048, 20)
    gpu = tg.train_batches(files, 4096, 1, 1, 2, torch.device("cuda"), 2048, 20)
    for i in range(10):
        msg = (8192, 2048, 1) if i == 5 else None
        a, b = (cpu.send(msg) if i else next(cpu)), (gpu.send(msg) if i else next(gpu))
        for x, y in zip(a, b):
            assert y.is_cuda and x.dtype == y.dtype and torch.equal(x, y.cpu())
