"""``calibrate.column_norms`` (the down projection's column norms, a block of rows at a time)
against the norms of the whole dequantized matrix (gguf-py's ``dequantize`` of all rows at once)
for the file's own blocks and for float weights."""

from __future__ import annotations

import pytest
import torch

from sparseinfer.offline.calibrate import column_norms, dense_weight


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "fp32"])
def test_column_norms_equal_the_whole_matrix(smollm2_path, dtype):
    from sparseinfer.models.build import load

    model = load(smollm2_path, dtype).model
    for layer in (0, 17):
        for lin in (model.layers[layer].ffn.down, model.layers[layer].attn.wqkv):
            want = dense_weight(lin).double().norm(dim=0).float()
            for block in (7, 256, 100000):  # a ragged last block, the default, one block
                torch.testing.assert_close(column_norms(lin, block), want, rtol=1e-5, atol=1e-6)
