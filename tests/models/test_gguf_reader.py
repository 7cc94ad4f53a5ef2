"""Our GGUF reader (``loading.open_gguf``) reads metadata arrays in one pass without a numpy view
per item: every field, part and tensor must equal what gguf-py's own ``GGUFReader`` reads."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from sparseinfer.models.loading import open_gguf


def _same(path) -> None:
    ours, ref = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, fb in ref.fields.items():
        fa = ours.fields[key]
        assert fa.types == fb.types, key
        assert fa.contents() == fb.contents(), key
        assert [int(i) for i in fa.data] == list(fb.data), key
        assert len(fa.parts) == len(fb.parts), key
        for i in range(len(fb.parts)):
            assert bytes(fa.parts[i]) == bytes(fb.parts[i]), (key, i)
            assert fa.parts[i].dtype == fb.parts[i].dtype, (key, i)
        if fb.types[0] == GGUFValueType.ARRAY and len(fb.data) > 2 and fb.types[-1] != \
                GGUFValueType.ARRAY:
            assert fa.contents(1) == fb.contents(1), key
            assert fa.contents(slice(1, None, 2)) == fb.contents(slice(1, None, 2)), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in ref.tensors]
    for ta, tb in zip(ours.tensors, ref.tensors):
        assert np.array_equal(ta.data, tb.data)


def test_arrays_of_every_type_read_as_gguf_py_reads_them(tmp_path):
    path = tmp_path / "t.gguf"
    w = GGUFWriter(path, "llama")
    w.add_array("t.strings", ["", "a", "héllo ▁wörld", "x" * 300, "<|end|>"])
    w.add_array("t.empty", [])
    w.add_string("t.one", "single")
    w.add_uint32("t.u32", 7)
    w.add_array("t.floats", [0.5, -1.25, 3.0])
    w.add_array("t.ints", [1, -2, 3, 4])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])  # through gguf-py's own code
    for vtype, values in ((GGUFValueType.UINT8, [1, 2, 255]), (GGUFValueType.INT64, [-5, 9]),
                          (GGUFValueType.FLOAT64, [1.5, 2.5]), (GGUFValueType.UINT16, [7])):
        w.add_key_value(f"t.{vtype.name.lower()}", values, GGUFValueType.ARRAY, vtype)
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same(path)


@pytest.mark.slow
def test_smollm2_reads_as_gguf_py_reads_it(smollm2_path):
    _same(smollm2_path)  # 49,152 tokens, 48,900 merges, token types
