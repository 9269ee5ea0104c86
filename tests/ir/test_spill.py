"""ir/spill.py: large constants made while compiling kept in unlinked files, values unchanged."""
import numpy as np
import pytest

from shardflow.compiler.ir import spill as sp
from shardflow.compiler.ir.graph import const_tensor

BIG = (512, 1024)  # float32: 2 MiB, above SPILL_BYTES


def _big(seed=0, shape=BIG, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_nothing_is_spilled_outside_a_spilling_block():
    a = _big()
    assert sp.spill(a) is a
    assert const_tensor(a).value is a
    assert type(sp.zeros(BIG, np.float32)) is np.ndarray


def test_large_arrays_are_mapped_from_unlinked_files_beside_the_output(tmp_path):
    a, small = _big(), _big(shape=(16, 16))
    with sp.spilling(tmp_path / "out", budget=0):
        t = const_tensor(a, "w")
        assert sp.file_backed(t.value) and not sp.file_backed(a)
        np.testing.assert_array_equal(t.value, a)
        assert t.value.dtype == a.dtype and t.value.shape == a.shape
        (folder,) = [p for p in tmp_path.iterdir()]  # made on the first spill, beside out
        assert folder.name.startswith(".out.spill-") and list(folder.iterdir()) == []  # (unlinked at once)
        assert const_tensor(small).value is small  # below SPILL_BYTES
        assert sp.spill(t.value) is t.value  # already a file's
        view = np.asarray(t.value)[:, :7]  # a view of a map stays one
        assert sp.file_backed(view) and sp.spill(view) is view
        fake = np.zeros_like(t.value)  # (of the memmap class, but memory of its own)
        assert not sp.file_backed(fake)
        t.value[0, 0] = 5.0  # copy-on-write: the process's own page changes
        assert t.value[0, 0] == 5.0
    assert list(tmp_path.iterdir()) == []  # the folder removed at the end
    np.testing.assert_array_equal(t.value[1:], a[1:])  # still readable after the block


def test_no_folder_when_nothing_is_large(tmp_path):
    with sp.spilling(tmp_path / "sub" / "out", budget=0):
        const_tensor(_big(shape=(8, 8)))
    assert list(tmp_path.iterdir()) == []  # (not even the parent folder)


@pytest.mark.parametrize("inside", [False, True])
def test_helpers_equal_numpy(tmp_path, inside):
    a = _big(1)
    b = _big(2, shape=(512, 300))
    import contextlib

    with sp.spilling(tmp_path / "o", budget=0) if inside else contextlib.nullcontext():
        z = sp.zeros(BIG, np.float16)
        assert z.dtype == np.float16 and z.shape == BIG and not z.any() and z.flags.writeable
        assert sp.file_backed(z) == inside
        c = sp.contiguous(a.T, np.float16)  # transposed and cast in one assignment
        np.testing.assert_array_equal(c, a.T.astype(np.float16))
        assert c.flags.c_contiguous and sp.file_backed(c) == inside
        assert sp.contiguous(a) is a
        s = sp.contiguous(np.float32(3.0))
        assert s.shape == ()  # (0-d stays 0-d)
        cat = sp.concatenate([a, b], axis=1)
        np.testing.assert_array_equal(cat, np.concatenate([a, b], axis=1))
        assert sp.file_backed(cat) == inside


def test_constants_stay_in_memory_up_to_the_budget(tmp_path):
    """Large constants are counted while alive; only those past the budget are spilled."""
    nbytes = _big().nbytes
    with sp.spilling(tmp_path / "o", budget=int(2.5 * nbytes)):
        first = const_tensor(_big(1)).value
        second = const_tensor(_big(2)).value
        assert not sp.file_backed(first) and not sp.file_backed(second)
        third = const_tensor(_big(3)).value  # (past the budget)
        assert sp.file_backed(third)
        assert sp.file_backed(sp.zeros(BIG, np.float32))  # (would be past it too)
        del first  # its bytes no longer count
        fourth = const_tensor(_big(4)).value
        assert not sp.file_backed(fourth)
        np.testing.assert_array_equal(third, _big(3))
    assert list(tmp_path.iterdir()) == []


def test_the_budget_comes_from_the_environment(tmp_path, monkeypatch):
    from shardflow.compiler import ConfigError

    monkeypatch.setenv(sp.BUDGET_ENV, "0")
    with sp.spilling(tmp_path / "o"):
        assert sp.file_backed(const_tensor(_big()).value)
    monkeypatch.setenv(sp.BUDGET_ENV, str(1 << 40))
    with sp.spilling(tmp_path / "o"):
        assert not sp.file_backed(const_tensor(_big()).value)
    monkeypatch.delenv(sp.BUDGET_ENV)
    with sp.spilling(tmp_path / "o"):  # (half of what is available: far more than 2 MiB here)
        assert not sp.file_backed(const_tensor(_big()).value)
    for bad in ("lots", "-1", "1.5e9"):
        monkeypatch.setenv(sp.BUDGET_ENV, bad)
        with pytest.raises(ConfigError, match=f"{sp.BUDGET_ENV}=.*whole number of bytes"):
            with sp.spilling(tmp_path / "o"):
                pass


def test_a_full_disk_is_a_clear_error(tmp_path, monkeypatch):
    import errno
    import os

    from shardflow.compiler import ShardflowError

    def full(fd, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, offset, nbytes: full(fd, nbytes))
    with sp.spilling(tmp_path / "o", budget=0):
        with pytest.raises(ShardflowError, match=r"constant of 2,097,152 bytes .*No space left.*free space there, "
                                                 r"or raise SHARDFLOW_SPILL_BUDGET \(now 0 bytes\)"):
            sp.zeros(BIG, np.float32)
        (folder,) = tmp_path.iterdir()
        assert list(folder.iterdir()) == []  # (the file unlinked)
    assert list(tmp_path.iterdir()) == []
