"""Compile cache: serialized fast path, keying against staleness, corruption, permissions."""

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxserve.compile_cache as cc
from jaxserve.compile_cache import CompileCache, compile_count
from jaxserve.models.bert import BERT_CONFIGS, BertConfig, init_bert
from jaxserve.polymorph import PolymorphTable, pad_token_batch
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import bert_servable, weights_of

GRID = ShapeGrid(batch_sizes=(1, 2), seq_buckets=(16,))
CFG = BERT_CONFIGS["bert-tiny-test"]


def _table(cache, cfg: BertConfig = CFG):
    t = PolymorphTable(bert_servable("tiny", cfg, GRID), cache)
    rows = t.warmup()
    return t, rows


def _embed(table, weights, cell=Cell(2, 16)):
    ids, mask = pad_token_batch([[101, 7, 8, 9, 102], [101, 5, 102]], cell)
    return table.run(cell, weights, ids, mask)["embedding"]


@pytest.fixture()
def cache_dir(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def _warmed_once(tmp_path_factory):
    path = tmp_path_factory.mktemp("warmed") / "cache"
    _table(CompileCache(path, use_xla_cache=False))
    return path


@pytest.fixture()
def warmed_dir(_warmed_once, tmp_path):
    """A cache holding every cell of GRID, this test's own copy (warmed once per module)."""
    import shutil

    return Path(shutil.copytree(_warmed_once, tmp_path / "cache"))


def test_second_start_loads_serialized_executables_without_compiling(cache_dir):
    weights = weights_of(init_bert(CFG, seed=1))
    t1, rows1 = _table(CompileCache(cache_dir, use_xla_cache=False))
    assert {r.source for r in rows1} == {"compiled"}
    before = compile_count()
    t2, rows2 = _table(CompileCache(cache_dir, use_xla_cache=False))
    assert {r.source for r in rows2} == {"serialized"}
    assert compile_count() == before
    np.testing.assert_array_equal(_embed(t1, weights), _embed(t2, weights))
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    row = manifest["entries"][0]
    for field in ("model", "config_hash", "cell", "jax", "jaxlib", "xla_flags", "compile_seconds", "source"):
        assert field in row
    assert len(manifest["entries"]) == len(GRID.cells())


def test_one_executable_serves_every_checkpoint_of_a_config(warmed_dir):
    t, _ = _table(CompileCache(warmed_dir, use_xla_cache=False))
    a, b = weights_of(init_bert(CFG, seed=1)), weights_of(init_bert(CFG, seed=2))
    assert not np.allclose(_embed(t, a), _embed(t, b))


@pytest.mark.parametrize(
    "change",
    ["program", "entry_format", "jax", "jaxlib", "flax", "xla_flags", "device_kind", "host_cpu",
     "jax_default_matmul_precision"],
)
def test_other_versions_or_flags_never_load_a_stale_entry(warmed_dir, monkeypatch, change):
    table, rows = _table(CompileCache(warmed_dir, use_xla_cache=False))
    assert {r.source for r in rows} == {"serialized"}  # the stored entries load under today's key
    cell = Cell(2, 16)
    stored_key, _ = table._key(cell)
    real = cc.environment_fingerprint

    def altered():
        fp = real()
        fp[change] = fp[change] + "-other"
        return fp

    monkeypatch.setattr("jaxserve.polymorph.environment_fingerprint", altered)
    new_key, parts = table._key(cell)
    assert new_key != stored_key and parts["env"][change].endswith("-other")
    assert table.cache.load(new_key, *table._trees(cell)) is None
    assert table.cache.load(stored_key, *table._trees(cell)) is not None


def test_program_fingerprint_follows_the_model_sources(tmp_path):
    import shutil

    pkg = tmp_path / "jaxserve"
    shutil.copytree(Path(cc.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "assets", "profiles"))
    assert cc.program_fingerprint(pkg) == cc.program_fingerprint()
    (pkg / "cli.py").write_text("# not part of any compiled program\n")
    assert cc.program_fingerprint(pkg) == cc.program_fingerprint()
    attn = pkg / "models" / "attention.py"
    attn.write_text(attn.read_text() + "\n# changed\n")
    cc.program_fingerprint.cache_clear()
    assert cc.program_fingerprint(pkg) != cc.program_fingerprint()


def test_other_config_or_shape_never_loads_a_stale_entry(cache_dir):
    _table(CompileCache(cache_dir, use_xla_cache=False))
    other = BertConfig(**{**CFG.__dict__, "intermediate_size": 48})
    _, rows = _table(CompileCache(cache_dir, use_xla_cache=False), other)
    assert {r.source for r in rows} == {"compiled"}
    keys = {r.key for r in _table(CompileCache(cache_dir, use_xla_cache=False))[1]}
    assert len(keys) == len(GRID.cells())  # every cell its own key


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage_with_valid_checksum"])
def test_corrupt_entry_is_reported_discarded_and_rebuilt(warmed_dir, damage):
    weights = weights_of(init_bert(CFG, seed=1))
    t1, rows = _table(CompileCache(warmed_dir, use_xla_cache=False))
    expected = _embed(t1, weights)
    victim = next(r for r in rows if r.cell == Cell(2, 16).label())
    payload = warmed_dir / "executables" / f"{victim.key}.bin"
    data = payload.read_bytes()
    if damage == "truncate":
        payload.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        payload.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:  # a payload that passes the checksum but is not an executable
        payload.write_bytes(cc._frame(b"not an executable" * 10))
    cache = CompileCache(warmed_dir, use_xla_cache=False)
    t2, rows2 = _table(cache)
    sources = {r.cell: r.source for r in rows2}
    assert sources[Cell(2, 16).label()] == "rebuilt"
    assert sum(s == "serialized" for s in sources.values()) == len(GRID.cells()) - 1
    assert any(victim.key in e for e in cache.events)
    np.testing.assert_array_equal(_embed(t2, weights), expected)
    # and the rebuilt entry is good again
    _, rows3 = _table(CompileCache(warmed_dir, use_xla_cache=False))
    assert {r.source for r in rows3} == {"serialized"}


def test_cache_is_owner_only(cache_dir):
    _table(CompileCache(cache_dir, use_xla_cache=False))
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cache_dir / "executables").st_mode) == 0o700
    for f in (cache_dir / "executables").iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(cache_dir / "manifest.json").st_mode) == 0o600


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_existing_directory_becomes_a_cache_only_if_empty_or_a_cache_already(tmp_path, monkeypatch):
    """The root is made 0700: `--cache-dir .`, `~` or (as root) /tmp must be refused, not locked down."""
    project = tmp_path / "project"
    project.mkdir(mode=0o755)
    os.chmod(project, 0o755)
    (project / "setup.py").write_text("")
    with pytest.raises(cc.CacheDirError, match="project.*not a jaxserve cache"):
        CompileCache(project, use_xla_cache=False)
    assert _mode(project) == 0o755 and not (project / "executables").exists()

    placeholder = tmp_path / "compiled_cache"  # as in the repository: only a tracked README.md
    placeholder.mkdir(mode=0o755)
    os.chmod(placeholder, 0o755)
    (placeholder / "README.md").write_text("the cache goes here\n")
    CompileCache(placeholder, use_xla_cache=False)
    assert _mode(placeholder) == 0o700
    os.chmod(placeholder, 0o755)
    CompileCache(placeholder, use_xla_cache=False)  # a cache already (executables/, .lock): taken again
    assert _mode(placeholder) == 0o700

    someone_elses = tmp_path / "shared"
    someone_elses.mkdir(mode=0o1777)
    os.chmod(someone_elses, 0o1777)
    real_uid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_uid + 1)  # as if another user owned it
    with pytest.raises(cc.CacheDirError, match="shared.*another user"):
        CompileCache(someone_elses, use_xla_cache=False)
    assert _mode(someone_elses) == 0o1777


def test_xla_cache_files_are_owner_only(tmp_path):
    """jax writes the XLA cache's files with the umask's mode (022 in the child): the cache
    tightens them to 0600 after each of its compiles, and restrict_modes() (the end of
    `jaxserve warmup`) tightens what other programs of the process left there."""
    path = tmp_path / "cache"
    modes = _child(path)["modes"]  # the grid warmed through the XLA cache
    assert any(name.startswith("xla" + os.sep) for name in modes), "the XLA cache wrote nothing"
    wrong = {name: oct(m) for name, m in modes.items() if m != (0o700 if (path / name).is_dir() else 0o600)}
    assert not wrong
    CompileCache(path, use_xla_cache=False).restrict_modes()  # what init_bert's programs wrote meanwhile
    for p in path.rglob("*"):
        assert _mode(p) == (0o700 if p.is_dir() else 0o600), p


_ENTRY_WRITER = """
import os, sys
from jaxserve.compile_cache import CompileCache
cache = CompileCache(sys.argv[1], use_xla_cache=False)
stop, who, i = sys.argv[2], sys.argv[3], 0
while not os.path.exists(stop):  # until the reader has seen enough
    payload = os.urandom(1 << 16)  # serialized executables differ byte for byte between processes too
    cache._write_entry("k", payload, {"model": "m", "who": who, "i": i})
    i += 1
"""


def test_a_reader_racing_two_writers_of_one_key_never_sees_a_checksum_failure(cache_dir):
    """Two warmup jobs store one key while a server loads it. A checksum kept beside the payload
    (a second file, replaced separately) paired one writer's payload with the other's checksum:
    a good entry reported corrupt and deleted. The checksum inside the .bin cannot be paired wrong.
    The writers write until told to stop, and the reader stops once it has read the entry 300 times
    while each writer stored it at least 100 times more (the sidecars it saw say so): an overlap
    made sure of by events, whatever the machine's load."""
    cache = CompileCache(cache_dir, use_xla_cache=False)
    stop = cache_dir.parent / "stop-writing"
    writers = [subprocess.Popen([sys.executable, "-c", _ENTRY_WRITER, str(cache_dir), str(stop), who],
                                stderr=subprocess.PIPE, text=True) for who in "ab"]
    reads, failures, first, last = 0, [], {}, {}
    deadline = time.monotonic() + 600  # only if the writers never get going
    try:
        while reads < 300 or any(last.get(w, -1) - first.get(w, 0) < 100 for w in "ab"):
            assert all(w.poll() is None for w in writers), "a writer died"
            assert time.monotonic() < deadline, f"no overlap after 600 s: {reads} reads, writes seen {first} -> {last}"
            try:
                payload = cache._read_entry("k")
            except ValueError as exc:
                failures.append(str(exc))
            else:
                reads += payload is not None and len(payload) == 1 << 16
            seen = cache.description("k")
            if "who" in seen:
                first.setdefault(seen["who"], seen["i"])
                last[seen["who"]] = max(last.get(seen["who"], 0), seen["i"])
    finally:
        stop.touch()
        for w in writers:
            _, err = w.communicate(timeout=300)
            assert w.returncode == 0, err[-2000:]
    assert not failures, f"{len(failures)} of {reads + len(failures)} reads failed: {failures[0]}"
    assert len(cache._read_entry("k")) == 1 << 16


def test_prune_skips_a_sidecar_discarded_meanwhile(cache_dir):
    """Another process may discard a corrupt entry while prune walks the sidecars."""
    cache = CompileCache(cache_dir, use_xla_cache=False)
    cache._write_entry("kept", b"payload", {"model": "tiny"})
    (cache.exe_dir / "gone.json").symlink_to(cache.exe_dir / "no-such-file")  # listed, then unreadable: deleted
    assert cache.prune({"tiny"}, {"kept"}) == 0
    assert cache._read_entry("kept") == b"payload"


_XLA_CHILD = """
import json, os, sys
os.umask(0o022)
from jaxserve.compile_cache import CompileCache, compile_count, xla_cache_hits
from jaxserve.models.bert import BERT_CONFIGS, init_bert
from jaxserve.polymorph import PolymorphTable, pad_token_batch
from jaxserve.sched.base import Cell, ShapeGrid
from jaxserve.servables import bert_servable, weights_of
cfg = BERT_CONFIGS["bert-tiny-test"]
cache = CompileCache(sys.argv[1], rebuild_serialized=sys.argv[2:] == ["rebuild"])
table = PolymorphTable(bert_servable("tiny", cfg, ShapeGrid((1, 2), (16,))), cache)
rows = table.warmup()
counts = {"compiles": compile_count(), "hits": xla_cache_hits(),  # the grid's, before anything else runs
          "programs": sum(len(table.candidates(c)) for c in table.servable.grid.cells())}  # tuning's candidates
modes = {os.path.relpath(os.path.join(d, n), sys.argv[1]): os.stat(os.path.join(d, n)).st_mode & 0o777
         for d, dirs, files in os.walk(sys.argv[1]) for n in dirs + files}  # after the grid, before anything else
w = weights_of(init_bert(cfg, seed=3))  # compiles outside the cache: jax writes its XLA-cache files 0644 (umask)
emb = [table.run(c, w, *pad_token_batch([[101, 7, 8, 102]] * c.batch, c))["embedding"][0].tolist()
       for c in (Cell(1, 16), Cell(2, 16))]
print(json.dumps({**counts, "sources": [r.source for r in rows], "emb": emb, "modes": modes}))
"""


def _child(path, *extra):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _XLA_CHILD, str(path), *extra], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_xla_cache_still_hits_after_the_cache_directory_is_moved(tmp_path):
    """A warmup job's cache is shipped elsewhere (CI artifact, image layer): XLA must still hit.

    Without serialized executables every cell is traced and lowered again, and the XLA
    persistent cache must answer all of them; jax's default side caches would put the
    directory's path into every key and make all of them miss.
    """
    import shutil

    first = _child(tmp_path / "built")
    assert first["hits"] == 0 and first["compiles"] == first["programs"] >= 2  # 2 cells, each candidate once
    shutil.copytree(tmp_path / "built", tmp_path / "shipped")
    shutil.rmtree(tmp_path / "shipped" / "executables")  # force the XLA-cache path
    assert _child(tmp_path / "shipped")["hits"] == first["programs"]


def test_an_executable_loaded_from_the_xla_cache_is_never_serialized(tmp_path):
    """jax 0.10 (CPU) serializes an XLA-cache load without its kernels; the next process
    then fails with NOT_FOUND when it runs it. The server keeps such cells unserialized;
    the warmup job (rebuild_serialized) compiles them afresh and stores those."""
    import shutil

    path = tmp_path / "cache"
    first = _child(path)
    assert first["sources"] == ["compiled", "compiled"]
    shutil.rmtree(path / "executables")  # e.g. an upgrade changed every key; the XLA cache still has the programs
    served = _child(path)
    assert served["sources"] == ["xla-cache", "xla-cache"] and served["hits"] == served["programs"]
    assert not list((path / "executables").glob("*.bin"))
    np.testing.assert_allclose(served["emb"], first["emb"], atol=1e-6)
    rebuilt = _child(path, "rebuild")
    assert rebuilt["sources"] == ["compiled", "compiled"] and len(list((path / "executables").glob("*.bin"))) == 2
    loaded = _child(path)  # the fast path again, and its executables run
    assert loaded["sources"] == ["serialized", "serialized"] and loaded["compiles"] == 0
    np.testing.assert_allclose(loaded["emb"], first["emb"], atol=1e-6)


def test_prune_removes_only_this_models_entries_that_can_never_load(cache_dir, monkeypatch):
    cache = CompileCache(cache_dir, use_xla_cache=False)
    stale = _table(cache)[0].keys()
    other = PolymorphTable(bert_servable("other", CFG, GRID), cache)
    other.warmup()
    other_keys = other.keys()
    real = cc.environment_fingerprint
    monkeypatch.setattr("jaxserve.polymorph.environment_fingerprint", lambda: {**real(), "jax": "next"})
    new, _ = _table(cache)  # an upgrade: every key of "tiny" changed, the old entries stay behind
    old = time.time() - cc.ORPHAN_AGE_S - 60
    for name in ("orphan.bin", ".half.bin.1.2.tmp"):  # a payload without its sidecar; a write that never finished
        (cache.exe_dir / name).write_bytes(b"x")
        os.utime(cache.exe_dir / name, (old, old))
    (cache.exe_dir / ".busy.bin.3.4.tmp").write_bytes(b"x")  # a writer at work right now: left alone
    assert stale.isdisjoint(new.keys())
    on_disk = lambda: {p.stem for p in cache.exe_dir.glob("*.bin")}  # noqa: E731
    assert stale <= on_disk()
    removed = cache.prune({"tiny"}, new.keys())
    assert removed == len(stale) + 1
    assert on_disk() == new.keys() | other_keys  # the other model's entries are untouched
    assert [p.name for p in cache.exe_dir.glob("*.tmp")] == [".busy.bin.3.4.tmp"]
    manifest_keys = {r["key"] for r in json.loads((cache_dir / "manifest.json").read_text())["entries"]}
    assert manifest_keys == new.keys() | other_keys
    again, rows = _table(cache)  # what was kept still loads
    assert {r.source for r in rows} == {"serialized"}


_WRITER = """
import json, sys
from jaxserve.compile_cache import CompileCache, ManifestRow, write_owner_only
root, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
cache = CompileCache(root, use_xla_cache=False)
for i in range(n):
    cache.write_manifest([ManifestRow(model=who, config_hash="c", cell=f"b{i}", key=f"{who}-{i}", jax="j",
                                      jaxlib="j", xla_flags="", compile_seconds=0.0, source="compiled")])
    write_owner_only(cache.exe_dir / "same.json", json.dumps({"who": who, "i": i, "pad": "x" * 50000}).encode())
"""


def test_concurrent_writers_lose_no_manifest_row_and_never_fail(cache_dir):
    """Three processes (say, warmup jobs for different models on one cache) merge manifest
    rows and rewrite the same entry at once: every row survives, no write fails, and the
    shared entry is one writer's whole file."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(cache_dir), who, "150"], stderr=subprocess.PIPE,
                              text=True) for who in "abc"]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    rows = json.loads((cache_dir / "manifest.json").read_text())["entries"]
    assert sorted(r["key"] for r in rows) == sorted(f"{w}-{i}" for w in "abc" for i in range(150))
    last = json.loads((cache_dir / "executables" / "same.json").read_text())
    assert last["i"] == 149 and len(last["pad"]) == 50000
    assert not list((cache_dir / "executables").glob("*.tmp"))
