"""bench/embedding_bwd.py's variants: the opaque op must give the same table gradients as F.embedding's own backward
(on the CPU both are aten's kernel, so bit for bit), also traced by torch.compile (aot_eager: dynamo, the autograd
function and the op's fake), and those gradients must be the sums of each id's rows; otherwise the bench would time
different math."""
import sys

import pytest
import torch

from _shards import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import embedding_bwd  # noqa: E402


def test_opaque_backward_is_the_embedding_backward_and_sums_each_ids_rows():
    ids, tables, weights = embedding_bwd.inputs(300, 2, 97, 16, torch.device("cpu"))
    assert 1 < ids.unique().numel() < 97 and ids.min() >= 0 and ids.max() < 97
    plain, opaque = (embedding_bwd.loss_fn(f) for f in embedding_bwd.VARIANTS.values())
    want = embedding_bwd.table_grads(plain, ids, tables, weights)
    compiled = torch.compile(opaque, fullgraph=True, backend="aot_eager")
    for loss in (opaque, compiled):
        got = embedding_bwd.table_grads(loss, ids, tables, weights)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    exact = embedding_bwd.exact_grads(ids, tables, weights)
    assert embedding_bwd.max_relative_error(want, exact) < 2 ** -7      # bf16 sums of a few rows each
    assert embedding_bwd.max_relative_error(want, [2 * e for e in exact]) > 0.4   # the measure is relative


def test_bad_options_and_no_gpu_give_one_error_line(capsys):
    assert embedding_bwd.token_counts("49152,16384") == [49152, 16384]
    for bad in ("abc", "0", "16384,", ""):
        with pytest.raises(SystemExit) as e:
            embedding_bwd.main([f"--tokens={bad}"])
        assert e.value.code == 2
        assert "error: argument --tokens: expected positive token counts" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            embedding_bwd.main(["--tokens=16"])
        assert str(e.value).startswith("error:") and "no GPU" in str(e.value)
