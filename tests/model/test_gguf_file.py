"""model/load/gguf_file.py against the gguf package's own reader and writer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from model.errors import ModelLoadError
from model.load.gguf import open_gguf
from model.load.gguf_file import GGUFError, GGUFFile
from model.load.loader import default_model_path

F32 = gguf.GGMLQuantizationType.F32


def reader_fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def assert_same_as_reader(path) -> None:
    ours = GGUFFile(path)
    assert ours.fields == reader_fields(path)
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in ours.tensors] == [t.name for t in theirs]
    for a, b in zip(theirs, ours.tensors, strict=True):
        assert tuple(int(n) for n in a.shape) == b.shape
        assert a.tensor_type == b.tensor_type
        assert a.data.shape == b.data.shape
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name
        assert b.rows().shape == (b.n_rows, b.row_bytes)


def write(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ world")
    w.add_array("t.strs", ["a", "", "ĠĊ", "<|fim_prefix|>"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.bools", [True, False])
    for name, (data, qtype) in tensors.items():
        raw = gguf.quants.quantize(data, qtype) if qtype.name.startswith("Q") else data
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_metadata_type_and_tensor_type_read_as_the_reference_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "t.gguf"
    tensors = {
        "f32": (rng.standard_normal((3, 64)).astype(np.float32), gguf.GGMLQuantizationType.F32),
        "f16": (rng.standard_normal((2, 32)).astype(np.float16), gguf.GGMLQuantizationType.F16),
        "q8": (rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0),
        "q4": (rng.standard_normal((5, 96)).astype(np.float32), gguf.GGMLQuantizationType.Q4_0),
        "vec": (rng.standard_normal(32).astype(np.float32), gguf.GGMLQuantizationType.F32),
    }
    write(path, tensors)
    assert_same_as_reader(path)
    f = GGUFFile(path)
    assert f.fields["t.u64"] == 2**60 and f.fields["t.bool"] is True
    assert f.fields["t.strs"] == ["a", "", "ĠĊ", "<|fim_prefix|>"]
    q4 = f.tensor("q4")
    assert q4 is not None and q4.shape == (96, 5) and q4.row_bytes == 3 * 18
    assert "vec" in f and f.tensor("nope") is None


def test_the_embedded_model_reads_as_the_reference_reads_it():
    assert_same_as_reader(default_model_path())


@pytest.mark.parametrize(
    "cut",
    [0, 3, 20, 200, 100_000, -1],
    ids=["empty", "magic", "counts", "metadata", "vocabulary", "data"],
)
def test_a_truncated_file_is_a_clear_load_error(tmp_path, cut):
    src = default_model_path().read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(src[:cut] if cut >= 0 else src[: len(src) - 1000])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_gguf(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="no GGUF magic"):
        GGUFFile(bad)


def test_open_gguf_parses_a_file_once_and_again_once_it_changes(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "m.gguf"
    write(path, {"w": (rng.standard_normal((2, 32)).astype(np.float32), F32)})
    first = open_gguf(path)
    assert open_gguf(path) is first  # start-up's several questions: one parse
    write(path, {"w": (rng.standard_normal((3, 32)).astype(np.float32), F32)})
    again = open_gguf(path)
    assert again is not first and again.tensor("w").shape == (32, 3)
