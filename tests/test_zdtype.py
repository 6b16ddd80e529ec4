"""dmi.zdtype: the Zarr v3 bfloat16 data type (zarr-extensions spec) on top of ml_dtypes."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec
from zarr.dtype import DataTypeValidationError, data_type_registry, parse_dtype

from dmi.zdtype import BF16, BFloat16, register

# bit patterns: 1.5, -0.0, +inf, -inf, NaN, NaN with payload, smallest/largest subnormal,
# -smallest subnormal, smallest normal, max bf16, -max bf16, 1.0
SPECIAL_BITS = [0x3FC0, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0x0001, 0x007F, 0x8001, 0x0080, 0x7F7F, 0xFF7F,
                0x3F80]


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint16)


def values(shape: tuple[int, ...]) -> np.ndarray:
    n = math.prod(shape)
    u = np.resize(np.array(SPECIAL_BITS, dtype=np.uint16), n)
    u[len(SPECIAL_BITS):] = np.arange(n - len(SPECIAL_BITS), dtype=np.uint16) * 97 + 0x3000
    return u.view(BF16).reshape(shape)


def test_round_trip_exact_bits(tmp_path):
    path = tmp_path / "a.zarr"
    a = zarr.create_array(store=path, shape=(5, 7), chunks=(2, 7), dtype="bfloat16", fill_value=float("nan"))
    assert a.dtype == BF16
    v = values((4, 7))
    a[:4] = v  # row 4 stays unwritten: fill value
    got = zarr.open_array(path)[...]
    assert got.dtype == BF16
    np.testing.assert_array_equal(bits(got[:4]), bits(v))
    assert (bits(got[4]) == 0x7FC0).all()
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["data_type"] == "bfloat16"
    assert meta["fill_value"] == "NaN"
    # float32 input rounds like ml_dtypes' astype (round to nearest even)
    f = np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.3e38, -1e-40], dtype=np.float32)
    a[4, :4] = f
    np.testing.assert_array_equal(bits(a[4, :4]), bits(f.astype(BF16)))


def test_ml_dtypes_dtype_and_payload_nan_fill(tmp_path):
    path = tmp_path / "b.zarr"
    a = zarr.create_array(store=path, shape=(3,), dtype=BF16, fill_value=np.uint16(0xFFC1).view(BF16))
    assert json.loads((path / "zarr.json").read_text())["fill_value"] == "0xffc1"  # "NaN" would lose the payload
    assert (bits(zarr.open_array(path)[...]) == 0xFFC1).all()
    assert a.metadata.data_type == BFloat16()


@pytest.mark.parametrize("endian", ["little", "big"])
def test_chunk_bytes(tmp_path, endian):
    path = tmp_path / "c.zarr"
    dt = BF16 if endian == "little" else BF16.newbyteorder(">")
    a = zarr.create_array(store=path, shape=(5, 7), chunks=(2, 7), dtype=dt, compressors=None,
                          serializer=BytesCodec(endian=endian), fill_value=0)
    v = values((5, 7))
    a[...] = v
    raw = (path / "c" / "0" / "0").read_bytes()
    assert raw == bits(v[:2]).astype("<u2" if endian == "little" else ">u2").tobytes()
    assert len(raw) == 2 * 2 * 7
    np.testing.assert_array_equal(bits(zarr.open_array(path)[...].astype(BF16)), bits(v))


def test_fresh_process_plain_readers_after_import_dmi(tmp_path):
    arr, grp = tmp_path / "arr.zarr", tmp_path / "grp.zarr"
    v = values((5, 7))
    zarr.create_array(store=arr, shape=(5, 7), chunks=(2, 7), dtype=BF16, fill_value=float("nan"))[:4] = v[:4]
    g = zarr.create_group(store=grp)
    x = g.create_array("x", shape=(5, 7), chunks=(2, 7), dtype=BF16, fill_value=float("nan"),
                       dimension_names=("row", "col"))
    x[:4] = v[:4]
    g.create_array("row", shape=(5,), dtype="int32", dimension_names=("row",))[...] = np.arange(5)
    np.save(tmp_path / "want.npy", bits(v))
    script = textwrap.dedent(f"""
        import sys
        import dmi                  # before zarr: registers bfloat16 when zarr is imported
        assert "zarr" not in sys.modules and "dmi.zdtype" not in sys.modules   # (import dmi stays fast)
        import numpy as np
        import xarray as xr
        import zarr
        want = np.load({str(tmp_path / "want.npy")!r})
        got = zarr.open_array({str(arr)!r})[...]
        assert str(got.dtype) == "bfloat16", got.dtype
        u = got.view(np.uint16)
        assert (u[:4] == want[:4]).all() and (u[4] == 0x7FC0).all()
        for kw in ({{}}, {{"mask_and_scale": False}}):
            ds = xr.open_zarr({str(grp)!r}, consolidated=False, **kw)
            assert ds["x"].dims == ("row", "col") and str(ds["x"].dtype) == "bfloat16", ds["x"]
            u = ds["x"].values.view(np.uint16)
            assert (u[:4] == want[:4]).all() and (u[4] == 0x7FC0).all()
            np.testing.assert_array_equal(ds["x"].values.astype(np.float32), got.astype(np.float32))
        tree = xr.open_datatree({str(grp)!r}, engine="zarr", consolidated=False)
        assert str(tree["x"].dtype) == "bfloat16"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("ok")


@pytest.mark.parametrize("js, want", [("NaN", 0x7FC0), ("Infinity", 0x7F80), ("-Infinity", 0xFF80),
                                      ("0x7fc0", 0x7FC0), ("0x7FC1", 0x7FC1), ("0x0001", 0x0001),
                                      (1.5, 0x3FC0), (-0.0, 0x8000), (3, 0x4040)])
def test_fill_value_json_forms(tmp_path, js, want):
    d = BFloat16()
    assert bits(d.from_json_scalar(js, zarr_format=3)) == want
    # the same value in a store's zarr.json
    path = tmp_path / "f.zarr"
    zarr.create_array(store=path, shape=(2,), dtype=BF16)
    meta = json.loads((path / "zarr.json").read_text())
    meta["fill_value"] = js
    (path / "zarr.json").write_text(json.dumps(meta))
    assert (bits(zarr.open_array(path)[...]) == want).all()
    # to_json_scalar writes a form that reads back to the same bits
    back = d.to_json_scalar(d.from_json_scalar(js, zarr_format=3), zarr_format=3)
    assert bits(d.from_json_scalar(back, zarr_format=3)) == want


def test_to_json_scalar_forms():
    d = BFloat16()
    assert d.to_json_scalar(float("nan"), zarr_format=3) == "NaN"
    assert d.to_json_scalar(float("-inf"), zarr_format=3) == "-Infinity"
    assert d.to_json_scalar(np.uint16(0x7FC1).view(BF16), zarr_format=3) == "0x7fc1"
    assert d.to_json_scalar(1.5, zarr_format=3) == 1.5
    assert d.default_scalar() == 0 and bits(d.default_scalar()) == 0
    assert bits(d.cast_scalar("0x3fc0")) == 0x3FC0 and bits(d.cast_scalar(np.float32(1.5))) == 0x3FC0


@pytest.mark.parametrize("bad", ["0x12", "0x12345", "0xzzzz", "abc", "", None, True, [1.0]])
def test_invalid_fill_values(bad):
    with pytest.raises(TypeError):
        BFloat16().from_json_scalar(bad, zarr_format=3)
    if not isinstance(bad, bool):
        with pytest.raises(TypeError):
            BFloat16().cast_scalar(bad)


@pytest.mark.parametrize("name", ["float16", "bfloat", "BFloat16", {"name": "bfloat16", "configuration": {"x": 1}}, 5])
def test_invalid_json_names(name):
    with pytest.raises(DataTypeValidationError):
        BFloat16.from_json(name, zarr_format=3)


def test_json_names_and_v2_refused(tmp_path):
    assert BFloat16.from_json("bfloat16", zarr_format=3) == BFloat16()
    assert BFloat16.from_json({"name": "bfloat16"}, zarr_format=3) == BFloat16()
    assert BFloat16().to_json(zarr_format=3) == "bfloat16"
    for js in ("bfloat16", {"name": "<V2", "object_codec_id": None}):
        with pytest.raises(DataTypeValidationError, match="Zarr v2 has no bfloat16"):
            BFloat16.from_json(js, zarr_format=2)
    with pytest.raises(DataTypeValidationError, match="Zarr v2 has no bfloat16"):
        zarr.create_array(store=tmp_path / "v2.zarr", shape=(2,), dtype=BF16, zarr_format=2)
    with pytest.raises(ValueError, match="No Zarr data type found"):  # other v3 names still unknown
        data_type_registry.match_json("bfloat17", zarr_format=3)


def test_register_idempotent_and_native_dtype_match():
    register()
    register()
    assert data_type_registry.get("bfloat16") is BFloat16
    assert sum(cls is BFloat16 for cls in data_type_registry.contents.values()) == 1
    assert parse_dtype(BF16, zarr_format=3) == BFloat16()  # exactly one class claims the ml_dtypes dtype
    assert parse_dtype(BF16.newbyteorder(">"), zarr_format=3) == BFloat16(endianness="big")
    assert BFloat16(endianness="big").to_native_dtype().byteorder == ">"
    assert BFloat16().to_native_dtype() == BF16 and BFloat16().item_size == 2
    assert type(parse_dtype(np.dtype(np.float16), zarr_format=3)).__name__ == "Float16"   # zarr's own, unchanged
    with pytest.raises(DataTypeValidationError):
        BFloat16.from_native_dtype(np.dtype(np.float16))
    with pytest.raises(DataTypeValidationError):
        BFloat16.from_native_dtype(np.dtype("V2"))
