"""bench/ce.py's --tiles: the launches it times, and one error line for a malformed list; its --digest
(no GPU needed)."""
import sys

import pytest
import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import ce as bench_ce  # noqa: E402


def test_tiles_parse_to_the_launch_tuples():
    assert bench_ce.parse_tiles("32:128:1024:4,16:256:0:8") == [(32, 128, 1024, 4), (16, 256, None, 8)]
    assert bench_ce.parse_tiles("32:128:1024:4,") == [(32, 128, 1024, 4)]
    assert bench_ce.parse_tiles("") == []


@pytest.mark.parametrize("text", ["32:128:1024", "32:128:x:4", "0:128:1024:4", "32:-1:0:4", "32:128:0:0"])
def test_malformed_tiles_are_one_error_line(text, capsys):
    with pytest.raises(ValueError, match="R:C:COLS:WARPS"):
        bench_ce.parse_tiles(text)
    assert bench_ce.main([f"--tiles={text}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tiles:") and err.count("\n") == 1


def test_digest_sees_every_bit_and_the_order():
    a = torch.arange(12, dtype=torch.float32).view(3, 4)
    b = torch.tensor([3, 250], dtype=torch.uint8)
    same = bench_ce.digest(a.clone(), b.clone())
    assert bench_ce.digest(a, b) == same and len(same) == 16
    flipped = a.clone()
    flipped.view(torch.int32)[2, 3] ^= 1  # the lowest mantissa bit of one element
    assert bench_ce.digest(flipped, b) != same
    assert bench_ce.digest(b, a) != same
    assert bench_ce.digest(a.t(), b) != same  # the values in memory order of the tensor as given
