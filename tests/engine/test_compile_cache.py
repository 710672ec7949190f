"""Inductor's cache folder, content-checked (fedsap_ray.engine.compile_cache, issue 56): files recorded with their
digests; a flipped byte, a truncated file, an unrecorded file and a planted link are each removed with their digest
and counted in one warning naming the folder, while an intact file, a fresh unrecorded one and Inductor's locks are
kept. On a fake folder (milliseconds); Inductor itself is tests/engine/test_compile_cache_runs.py's."""
from __future__ import annotations

import io
import os
import shutil
import time
import warnings

import pytest

from fedsap_ray.data.cachefile import CacheRebuilt
from fedsap_ray.engine import compile_cache, compiled
from fedsap_ray.engine.compile_cache import check, digest_path, record

OLD = time.time() - 2 * compile_cache.GRACE_S


def write(root, rel: str, data: bytes, *, old: bool = True) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if old:
        os.utime(path, (OLD, OLD))


@pytest.fixture
def cache(tmp_path):
    """A fake Inductor folder: code cache, FX-graph entry, a lock; all recorded."""
    root = tmp_path / "inductor"
    for rel in ("ab/cab.py", "ab/cab.so", "cd/ccd.cpp", "fxgraph/fx/key/entry", "aotautograd/ak/entry", "ef/cef.so"):
        write(root, rel, rel.encode() * 50)
    write(root, "locks/cab.lock", b"")
    assert record(root) == 6 and record(root) == 0  # locks are Inductor's, not content; recorded once
    return root


def quiet_check(root) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return check(root)


def test_an_intact_folder_is_kept_untouched(cache):
    before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    assert quiet_check(cache) == 0
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    assert digest_path(cache, "ab/cab.so").read_text().startswith("sha256:")


def test_damaged_unrecorded_and_linked_entries_are_removed_with_their_digests(cache, tmp_path):
    so = cache / "ab/cab.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    so.write_bytes(bytes(data))
    with open(cache / "cd/ccd.cpp", "r+b") as f:  # truncated
        f.truncate(10)
    write(cache, "gh/cgh.py", b"# never recorded")  # written by no process that recorded it
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(b"other code")
    (cache / "fxgraph/fx/key/linked").symlink_to(outside)  # a link planted beside an entry
    (cache / "ij").symlink_to(tmp_path, target_is_directory=True)  # a linked folder: never walked into
    write(cache, "kl/ckl.py", b"# being compiled by another process", old=False)  # fresh: not yet recorded
    with pytest.warns(CacheRebuilt, match=f"{cache}: 5 damaged, linked or unrecorded entries removed"):
        assert check(cache) == 5
    for rel in ("ab/cab.so", "cd/ccd.cpp", "gh/cgh.py", "fxgraph/fx/key/linked", "ij"):
        assert not os.path.lexists(cache / rel) and not os.path.lexists(digest_path(cache, rel)), rel
    assert outside.read_bytes() == b"other code" and (tmp_path / "inductor").is_dir()  # links' targets left alone
    for rel in ("ab/cab.py", "fxgraph/fx/key/entry", "aotautograd/ak/entry", "ef/cef.so", "kl/ckl.py",
                "locks/cab.lock"):
        assert (cache / rel).is_file(), rel
    assert quiet_check(cache) == 0  # reported once: what is left is sound


def test_a_digest_whose_file_is_gone_is_dropped_so_a_new_file_is_recorded_afresh(cache):
    (cache / "ef/cef.so").unlink()
    (cache / compile_cache.DIGESTS / "stray").write_text("not a digest")
    assert quiet_check(cache) == 0
    assert not digest_path(cache, "ef/cef.so").exists() and not (cache / compile_cache.DIGESTS / "stray").exists()
    write(cache, "ef/cef.so", b"regenerated, other bytes")
    assert record(cache) == 1 and quiet_check(cache) == 0


def test_a_digest_that_is_no_digest_or_a_link_does_not_vouch_for_its_file(cache, tmp_path):
    digest_path(cache, "ab/cab.py").write_text("sha256:nonsense")
    forged = tmp_path / "forged"
    forged.write_text(digest_path(cache, "ef/cef.so").read_text())
    digest_path(cache, "ef/cef.so").unlink()
    digest_path(cache, "ef/cef.so").symlink_to(forged)
    forged_dir = tmp_path / "forged_digests"  # a linked folder of digests vouching for an edited file
    shutil.copytree(cache / compile_cache.DIGESTS / "cd", forged_dir)
    write(cache, "cd/ccd.cpp", b"edited")
    (forged_dir / "ccd.cpp.sha256").write_text(compile_cache.file_digest(io.BytesIO(b"edited")))
    shutil.rmtree(cache / compile_cache.DIGESTS / "cd")
    (cache / compile_cache.DIGESTS / "cd").symlink_to(forged_dir, target_is_directory=True)
    with pytest.warns(CacheRebuilt, match="3 damaged"):
        assert check(cache) == 3
    assert not any((cache / rel).exists() for rel in ("ab/cab.py", "ef/cef.so", "cd/ccd.cpp"))
    assert forged.exists() and (forged_dir / "ccd.cpp.sha256").exists()  # links' targets left alone


def test_the_process_checks_its_folder_once_before_compiling_and_records_after(tmp_path, monkeypatch):
    """use_node_cache() checks our folder (not the user's); record_new_files() records after a compiling client."""
    monkeypatch.setenv("FEDSAP_RAY_CACHE", str(tmp_path))
    monkeypatch.delenv(compiled.ENV, raising=False)
    monkeypatch.setattr(compiled, "_CHECKED_ROOT", None)
    monkeypatch.setattr(compiled, "_RECORDED_AT", None)
    root = tmp_path / "inductor"
    write(root, "ab/cab.py", b"# left by a process killed before it recorded")
    with pytest.warns(CacheRebuilt, match="1 damaged"):
        assert compiled.use_node_cache() == root
    assert not (root / "ab/cab.py").exists()
    write(root, "ab/cab.py", b"# this process's compile")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled.use_node_cache() == root  # checked once per process
        compiled.record_new_files("off")  # nothing compiled: nothing recorded
        assert not digest_path(root, "ab/cab.py").exists()
        compiled.record_new_files("miss")
        assert digest_path(root, "ab/cab.py").exists()
    monkeypatch.setenv(compiled.ENV, str(tmp_path / "mine"))  # the user's folder is theirs: not checked
    monkeypatch.setattr(compiled, "_CHECKED_ROOT", None)
    write(tmp_path, "mine/ab/cab.py", b"# theirs")
    assert compiled.use_node_cache() == tmp_path / "mine" and (tmp_path / "mine/ab/cab.py").exists()


def test_a_warm_check_of_hundreds_of_files_is_cheap(tmp_path):
    root = tmp_path / "inductor"
    for i in range(300):
        write(root, f"{i % 50:02d}/c{i}.so", os.urandom(20_000))
    record(root)
    t = time.perf_counter()
    assert quiet_check(root) == 0
    assert time.perf_counter() - t < 0.5
