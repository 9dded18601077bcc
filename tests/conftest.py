import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the device (see README, Tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def compiler_settings_restored(monkeypatch):
    """train_gpt.configure_compiler changes process-wide torch settings; they are put back after the test."""
    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    for config, name in ((functorch_config, "autograd_cache_allow_custom_autograd_functions"),
                         (functorch_config, "force_non_lazy_backward_lowering"),
                         (torch._dynamo.config, "recompile_limit"),
                         (torch.compiler.config, "cache_key_tag"),
                         (inductor_config, "post_grad_custom_post_pass")):
        monkeypatch.setattr(config, name, getattr(config, name))
