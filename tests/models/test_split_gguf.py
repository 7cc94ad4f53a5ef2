"""A model split by llama.cpp's gguf-split (PREFIX-00001-of-0000N.gguf, ``split.*`` keys) is read
as one file from whichever part ``-m`` names. The parts here are written by gguf-py's own
splitting writer from the real SmolLM2 file; the reference is gguf-py reading the whole file
(tensor bytes) and transformers reading it (logits)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sparseinfer.cli import main
from sparseinfer.errors import ModelFileError
from sparseinfer.models.loading import load_model, open_source


def split_gguf(src, out_dir, n_parts: int) -> list:
    """``src`` rewritten by gguf-py's GGUFWriter in ``n_parts`` parts (every metadata key in the
    first, the tensors spread over all)."""
    from sparseinfer.offline.export import _copy_fields

    reader = gguf.GGUFReader(src)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    per_part = -(-len(reader.tensors) // n_parts)
    w = gguf.GGUFWriter(str(out_dir / "model.gguf"), arch, split_max_tensors=per_part)
    _copy_fields(w, reader, lambda k: not k.startswith(("GGUF.", "general.architecture")))
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(out_dir.glob("model-*-of-*.gguf"))
    assert [p.name for p in parts] == [f"model-{i:05d}-of-{n_parts:05d}.gguf"
                                       for i in range(1, n_parts + 1)]
    return parts


@pytest.fixture(scope="module")
def smollm2_parts(smollm2_path, tmp_path_factory):
    return split_gguf(smollm2_path, tmp_path_factory.mktemp("split"), 3)


@pytest.mark.parametrize("part", [0, 2])
def test_every_tensor_read_from_its_part(smollm2_parts, smollm2_path, part):
    """Opened by its first or last part: every tensor of the whole file, bytes as gguf-py reads
    them there, and the first part's metadata."""
    src = open_source(smollm2_parts[part])
    assert src.path == smollm2_parts[0] and src.parts == tuple(smollm2_parts[1:])
    assert src.file_bytes == sum(p.stat().st_size for p in smollm2_parts)
    whole = gguf.GGUFReader(smollm2_path)
    assert [t.name for t in src.all_tensors] == [t.name for t in whole.tensors]
    for ours, want in zip(src.all_tensors, whole.tensors):
        assert ours.kind == want.tensor_type.name
        np.testing.assert_array_equal(ours.raw(), want.data)
    assert src.metadata["general.architecture"] == "llama"
    assert src.config.n_layers == 30 and src.name == "model"
    assert src.tokenizer().encode("Pride and Prejudice") == \
        open_source(smollm2_path).tokenizer().encode("Pride and Prejudice")


@pytest.mark.slow
def test_split_model_logits_match_transformers_on_the_whole_file(smollm2_parts, smollm2_hf):
    lm = load_model(smollm2_parts[0], max_seq_len=256)
    ids = torch.tensor([lm.tokenizer.encode("It is a truth universally acknowledged, that")])
    cache = lm.model.new_cache(1, ids.shape[1] + 1)
    with torch.inference_mode():
        got = lm.model(ids, 0, cache)
        want = smollm2_hf(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.slow
def test_split_model_decodes_as_the_whole_file_by_default(smollm2_parts, smollm2_path):
    """The default engine (4-bit rows mapped from each part, C kernels) gives the whole
    file's tokens."""
    from sparseinfer.config import SamplingParams
    from sparseinfer.engine import Engine, TokenEvent

    def greedy(path) -> list[int]:
        engine = Engine.load(path, n_ctx=128, threads=1)
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompt = engine.encode("Pride and Prejudice was written by")
        return [e.token_id for e in engine.stream(prompt, params) if isinstance(e, TokenEvent)]

    assert greedy(smollm2_parts[1]) == greedy(smollm2_path)


def test_the_cli_names_the_parts(smollm2_parts, capsys):
    assert main(["info", "-m", str(smollm2_parts[1])]) == 0
    out = capsys.readouterr().out
    assert f"file:   {smollm2_parts[0]}" in out and "split in 3 parts" in out


def test_a_missing_part_is_named(smollm2_parts, tmp_path):
    for p in smollm2_parts[:2]:
        (tmp_path / p.name).symlink_to(p)
    with pytest.raises(ModelFileError, match=r"model split into 3 files; expected all of them "
                                             r"in .*, missing model-00003-of-00003\.gguf"):
        open_source(tmp_path / smollm2_parts[0].name)


def test_a_renamed_part_says_how_to_merge(smollm2_parts, tmp_path):
    renamed = tmp_path / "first.gguf"
    renamed.symlink_to(smollm2_parts[0])
    with pytest.raises(ModelFileError, match=r"first\.gguf: part 1 of a model split into 3 files "
                                             r".*MODEL-00001-of-00003\.gguf.*--merge"):
        open_source(renamed)


def test_parts_out_of_order_are_refused(smollm2_parts, tmp_path):
    names = [p.name for p in smollm2_parts]
    for p, name in zip(smollm2_parts, [names[0], names[2], names[1]]):
        (tmp_path / name).symlink_to(p)
    with pytest.raises(ModelFileError, match=r"model-00002-of-00003\.gguf: expected part 2 of 3 "
                                             r"\(split\.no 1, split\.count 3\), found "):
        open_source(tmp_path / names[0])


@pytest.mark.slow
def test_a_split_model_converts_to_one_sparse_file(smollm2_parts, tmp_path):
    """The offline pipeline takes a split model: its output is one file (no ``split.*`` keys)
    holding the source's tensors, which loads."""
    from sparseinfer.offline.pipeline import ConvertOptions, convert
    from sparseinfer.offline.profile import ProfileOptions
    from sparseinfer.offline.train import TrainOptions

    torch.set_num_threads(2)
    options = ConvertOptions(profile=ProfileOptions(chunk_len=128, max_tokens=256, min_tokens=1),
                             train=TrainOptions(ranks=(8,), epochs=1, min_steps=10))
    out = tmp_path / "sparse.gguf"
    convert(smollm2_parts[0], out, options)
    r = gguf.GGUFReader(out)
    assert not [k for k in r.fields if k.startswith("split.")]
    names = {t.name for t in r.tensors}
    assert {t.name for p in smollm2_parts for t in gguf.GGUFReader(p).tensors} <= \
        names | {f"blk.{i}.ffn_down.weight" for i in range(30)}  # down stored transposed
    sparse = load_model(out, max_seq_len=256)
    assert sparse.config.n_layers == 30 and not sparse.source.parts
