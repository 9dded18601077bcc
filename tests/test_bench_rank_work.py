"""bench/rank_work.py: the attention cost model by hand, and each rank's work from the documents the trainer's loader
gives it, across a batch-size change."""
import sys
from types import SimpleNamespace

import numpy as np

import train_gpt as tg
from _shards import BOS, ROOT, write_shard

sys.path.insert(0, str(ROOT / "bench"))
import rank_work  # noqa: E402


def test_pairs_and_the_layers_cost_by_hand():
    assert rank_work.pairs(4, 2) == 1 + 2 + 3 + 3
    assert rank_work.pairs(3, 10) == 1 + 2 + 3
    hp = SimpleNamespace(attn_layout="N-P", long_window_layers=(2,), block_size=1, num_heads=4)
    # layer 0: normal, short window 1: 4 heads x (1 + 2 + 2); layer 2: paired, long window 2, 6 positions: 2 heads x
    # (1 + 2 + 3 + 3 + 3 + 3); layer 1 has no attention
    assert rank_work.attention_work([3], 1, 2, hp) == 4 * 5 + 2 * 15
    assert rank_work.attention_work([3, 3], 1, 2, hp) == 2 * (4 * 5 + 2 * 15)
    assert rank_work.doc_lengths(np.array([0, 3, 7, 7, 7])) == [3, 4]


def test_each_rank_gets_the_work_of_its_own_documents(tmp_path):
    """Tiny preset, 2 ranks of 256 tokens at step 0: 128-token documents give each rank two (the third only lends a
    target); one 256-token document where rank 1's share starts gives rank 1 that one."""
    hp = tg.parse_args(["--preset=tiny", f"--train_files={tmp_path}/fineweb_train_*.bin"])
    change = next(s for s in range(hp.num_iterations)
                  if tg.schedule_at(s, hp).global_batch != tg.schedule_at(0, hp).global_batch)
    assert tg.schedule_at(change, hp).global_batch == 768       # 384 tokens a rank: three documents each

    def work(lengths, step):
        sched = tg.schedule_at(step, hp)
        return rank_work.attention_work(lengths, sched.ws_short, sched.ws_long, hp)

    for docs, rank1_first in (([128] * 200, [128, 128]), ([128] * 3 + [256] + [128] * 200, [256])):
        write_shard(tmp_path / "fineweb_train_000001.bin",
                    np.concatenate([[BOS] + [1] * (n - 1) for n in docs]))
        got = rank_work.rank_work(hp, 2, [0, change])
        assert got[0] == [work([128, 128], 0), work(rank1_first, 0)]
        assert got[change] == [work([128] * 3, change)] * 2


def test_bad_steps_ranks_or_shards_are_one_error_line(tmp_path, capsys):
    assert rank_work.main(["--steps=3,x"]) == 2
    assert rank_work.main(["--steps=4", "--ranks=3", "--preset=tiny"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: --") for line in err)
    assert rank_work.main(["--steps=1", "--ranks=2", "--preset=tiny", f"--train_files={tmp_path}/none_*.bin"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: no train shards") and "--train_files" in err[0]
