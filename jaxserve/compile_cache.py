"""Where compiled work lives on disk: serialized executables, the XLA cache, a manifest.

Layout of a cache directory (``compiled_cache/`` by default)::

    xla/                      XLA persistent compilation cache (jax manages it)
    executables/<key>.bin     a header, the payload's sha256, then the payload
                              (jax.experimental.serialize_executable's bytes)
    executables/<key>.json    what the key was made of, size and sha256 of the payload
    manifest.json             one row per (model, cell): versions, flags, seconds, hit/miss

The key hashes everything that could make a stored executable wrong for this process:
model name and config hash, the cell, the function variant, the abstract shapes of
every argument, a hash of jaxserve's model and polymorph sources, the entry format,
jax/jaxlib/flax versions, the backend and device kind (on the CPU, the instruction set: host_cpu), ``XLA_FLAGS`` and the jax config flags that change
lowering. Change any of them and the key changes, so a stale entry can never load; it
is simply a miss.

A ``.bin`` checks itself: its header carries the payload's sha256, so a load reads and
verifies that one file. (The sidecar is a description for people and for ``prune``;
two warmup jobs writing one key replace ``.bin`` and ``.json`` one after the other, and
their payloads differ byte for byte, so a reader between them would see one job's
payload beside the other's checksum.) A payload whose checksum fails is reported,
deleted and rebuilt; a payload that fails to deserialize is treated the same way.

The cache holds native code that this process will run: it is *trusted code*.
Directories are owner-only (0700) and files 0600; never point the server at a cache
someone else can write. (jax writes the XLA cache's files with the umask's mode:
:meth:`CompileCache.restrict_modes` tightens them after each of the cache's compiles and
at the end of ``jaxserve warmup``. A program the process compiles outside the cache,
weight initialization say, may leave a file at the umask's mode in xla/ until then; xla/
itself is 0700, so no one else can reach it.)
Because the root is made 0700, a root that already exists must be this user's and
either empty or a cache already (:func:`check_cache_root`): ``--cache-dir .`` or ``~``
is refused rather than silently locked down.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import stat
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import flax
import jax
import jaxlib

log = logging.getLogger("jaxserve.cache")

_LOWERING_FLAGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_numpy_rank_promotion",
    "jax_threefry_partitionable",
)


# The code that builds what a polymorph compiles (models, the per-cell functions, padding,
# the native kernels executables call). A jaxserve upgrade that changes any of it must not
# load executables an older one wrote.
_PROGRAM_SOURCES = ("models", "kernels", "servables.py", "polymorph.py")
_PROGRAM_SUFFIXES = (".py", ".cc")


@functools.cache
def program_fingerprint(root: Path | None = None) -> str:
    """sha256 over jaxserve's sources that decide the compiled programs (a conservative
    proxy for the lowered program: hashing the StableHLO would mean tracing every cell at
    load time, which the serialized fast path exists to skip). ``root``: a jaxserve
    package directory (default: this one)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in _PROGRAM_SOURCES:
        path = root / name
        files = sorted(f for f in path.rglob("*") if f.suffix in _PROGRAM_SUFFIXES) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.cache
def host_cpu() -> str:
    """The instruction set XLA:CPU compiles for: the machine and a hash of the CPU's feature
    flags (/proc/cpuinfo). XLA:CPU targets the host it runs on, and its device kind is just
    "cpu", so without this a cache warmed on an AVX-512/AMX build host and shipped to an older
    CPU would hand it code it cannot run (XLA's loader refuses it, or it dies of SIGILL);
    with it, that is a clean miss compiled at warmup."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86 / arm64 spelling
                features = " ".join(sorted(set(line.split(":", 1)[1].split())))
                return f"{platform.machine()}:{hashlib.sha256(features.encode()).hexdigest()[:16]}"
    except OSError:
        pass
    return f"{platform.machine()}:{platform.processor()}"


# The layout of executables/<key>.bin. Part of every key, so entries in another format are
# clean misses (and pruned), never reported as corrupt. Change both together.
ENTRY_FORMAT = "2"
_MAGIC = b"jaxserve executable 2\n"


def environment_fingerprint() -> dict[str, str]:
    """What decides the compiled code besides the model, cell and argument shapes:
    jaxserve's program sources and entry format, versions (flax too: its modules, such as
    nnx.LayerNorm, write part of every program), backend, the CPU's instruction set (CPU
    backend only: a GPU executable's code is for the GPU its device kind names), flags, and
    the attention implementation (XLA ops, or the fused kernel build it calls: computing the
    key registers that kernel, which deserializing an executable that calls it needs)."""
    from jaxserve import kernels

    device = jax.devices()[0]
    fp = {
        "program": program_fingerprint(),
        "entry_format": ENTRY_FORMAT,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "host_cpu": host_cpu() if device.platform == "cpu" else "",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "attention": kernels.attention_fingerprint(),
    }
    for flag in _LOWERING_FLAGS:
        fp[flag] = str(getattr(jax.config, flag, None))
    return fp


def entry_key(parts: dict[str, Any]) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ManifestRow:
    model: str
    config_hash: str
    cell: str
    key: str
    jax: str
    jaxlib: str
    xla_flags: str
    compile_seconds: float
    source: str  # "serialized" (fast path), "compiled" (miss), "rebuilt" (corrupt entry replaced),
    #              or "xla-cache" (loaded from XLA's persistent cache; not re-serialized: see CompileCache)
    compile_options: dict = field(default_factory=dict)  # the XLA options the executable was compiled with
    # warmup's tuning (PolymorphTable): best time per candidate, ms, keyed by options_label; {} when not tuned
    tuning_ms: dict = field(default_factory=dict)
    precision: str = "f32"  # dense-kernel dtype (jaxserve.models.precision)
    host_cpu: str = ""  # the CPU instruction set it was compiled for (host_cpu(); "" off the CPU)


_compile_counter = {"backend_compiles": 0, "seconds": 0.0, "xla_cache_hits": 0}
_listener_installed = False


def install_compile_counter() -> None:
    """Count every XLA backend compile in this process (ours or anyone's).

    The serving path must never compile; the engine exposes this count in metrics and
    the tests assert it does not move after warmup. jax reports a persistent-cache hit
    through the same backend-compile event (it wraps the retrieval), so a hit counts
    here too — strictly right for "nothing is compiled or even looked up at request
    time"; :func:`xla_cache_hits` tells how many of them were hits.
    """
    global _listener_installed
    if _listener_installed:
        return

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _compile_counter["backend_compiles"] += 1
            _compile_counter["seconds"] += duration

    def on_event(event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _compile_counter["xla_cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    _listener_installed = True


def compile_count() -> int:
    install_compile_counter()
    return _compile_counter["backend_compiles"]


def xla_cache_hits() -> int:
    install_compile_counter()
    return _compile_counter["xla_cache_hits"]


def compile_seconds() -> float:
    install_compile_counter()
    return _compile_counter["seconds"]


def _frame(payload: bytes) -> bytes:
    """A ``.bin``'s bytes: header, the payload's sha256, the payload."""
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _unframe(data: bytes) -> bytes:
    """The payload of a ``.bin``'s bytes; ValueError if the header or checksum is wrong."""
    if not data.startswith(_MAGIC):
        raise ValueError("not a jaxserve executable (bad header)")
    digest, payload = data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(f"checksum mismatch ({len(payload)} bytes)")
    return payload


class CacheDirError(ValueError):
    """A cache directory that jaxserve will not take over (see :func:`check_cache_root`)."""


# any one: a jaxserve cache (cost models: `jaxserve profile` writes its default one there)
_CACHE_MARKERS = {"manifest.json", "executables", "xla", ".lock", "cost_model.json", "cost_model-bf16.json"}
_PLACEHOLDERS = {"README.md", ".gitkeep", ".gitignore"}  # an empty directory kept in a repository


def check_cache_root(path: str | Path) -> None:
    """Raise CacheDirError unless ``path`` is missing or may become a cache: a directory
    of this user's that is empty (but for placeholders such as the repository's
    compiled_cache/README.md) or already a jaxserve cache. The cache makes its root
    0700; doing that to a project, a home directory or /tmp would lock others out of it."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise CacheDirError(f"cache directory {str(path)!r} exists and is not a directory")
    if path.stat().st_uid != os.geteuid():
        raise CacheDirError(f"cache directory {str(path)!r} belongs to another user: a cache is trusted "
                            "code, and jaxserve will not make someone else's directory owner-only")
    names = {p.name for p in path.iterdir()}
    if names - _PLACEHOLDERS and not names & _CACHE_MARKERS:
        raise CacheDirError(f"cache directory {str(path)!r} holds other files and is not a jaxserve cache: "
                            "jaxserve makes its cache directory owner-only (0700), so give it an empty "
                            "or new directory")


def _cache_root(path: Path) -> Path:
    """Create the cache's root owner-only, or take over an existing one that passes
    :func:`check_cache_root` and make it owner-only."""
    check_cache_root(path)
    return _owner_only_dir(path)


def _owner_only_dir(path: Path) -> Path:
    """A directory 0700: only for the root once checked, and the directories inside it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def write_owner_only(path: Path, data: bytes) -> None:
    """Write via a temporary file of this writer's own (two warmup jobs, or a server starting
    beside one, may write the same entry at once: with one shared temporary name they
    truncated each other's file and one replace found it gone) and an atomic rename, so a
    crash or a concurrent writer never leaves a half entry under the real name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def _exclusive(root: Path):
    """Hold ``root/.lock`` exclusively (flock: released when the descriptor closes, even if
    the process dies), for read-modify-write of the manifest across processes."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


ORPHAN_AGE_S = 600.0  # a temporary file or a payload without its sidecar younger than this may
#                       belong to a writer still at work, so prune leaves it


class CompileCache:
    """Serialized executables keyed by :func:`entry_key`, plus the XLA persistent cache.

    Never serialize a program this process has loaded from XLA's persistent cache. On
    jax 0.10's CPU backend, once a process has loaded program P from that cache, any
    executable of P it serializes (that one, or even a fresh compile of P afterwards)
    is written without its kernels: the next process that loads it fails at run time
    with ``NOT_FOUND: Function <fusion> not found`` (reproduced in
    tests/integration/test_compile_cache.py). It happens whenever serialized entries are missing
    while the XLA cache still holds the programs: a jaxserve upgrade that changes the
    keys, a corrupt entry rebuilt, an ``executables/`` folder removed. So:

    - by default (the server starting) a cell that came from the XLA cache stays
      unserialized: ready quickly and correct; its manifest row says ``xla-cache``;
    - with ``rebuild_serialized`` (the ``jaxserve warmup`` job, whose purpose is to fill
      the cache before a deploy) and a non-empty XLA cache, a missing cell is compiled
      with the persistent cache bypassed *before* anything loads it, serialized, and then
      compiled through the XLA cache as well (a hit is a cheap read; a miss writes the
      entry). With an empty XLA cache at start nothing can hit, so one compile does both.
    """

    def __init__(self, root: str | Path, use_xla_cache: bool = True, rebuild_serialized: bool = False):
        self.root = _cache_root(Path(root))
        self.exe_dir = _owner_only_dir(self.root / "executables")
        self.events: list[str] = []  # human-readable reports of corrupt entries
        xla_dir = self.root / "xla"
        # compile a missing cell afresh (bypassing the XLA cache) so it can be serialized: only
        # asked for by the warmup job, and only needed when the XLA cache could answer it
        self.compile_fresh = rebuild_serialized and use_xla_cache and xla_dir.is_dir() and any(xla_dir.iterdir())
        # without the XLA cache, compile with it bypassed even if another part of this process
        # switched jax's (process-wide) persistent cache on: a load from it must not be serialized
        self.bypass_xla = not use_xla_cache
        if use_xla_cache:
            enable_xla_cache(xla_dir)

    def compile(self, key: str, lowered, description: dict[str, Any], options: dict[str, str] | None = None,
                store: bool = True) -> tuple[Any, str]:
        """Compile ``lowered`` (with ``options``, default ``description["compile_options"]``)
        and store it under ``key`` unless it came from the XLA cache (see the class
        docstring) or ``store`` is False (a candidate that warmup's tuning may not keep: the
        table stores the one it keeps). Returns the executable and where it came from:
        "compiled" or "xla-cache"."""
        options = (options if options is not None else description.get("compile_options")) or None
        if self.compile_fresh or self.bypass_xla:
            with xla_cache_bypassed():
                compiled = lowered.compile(compiler_options=options)
            if store:
                self.store(key, compiled, description)
            if self.compile_fresh:
                lowered.compile(compiler_options=options)  # through the XLA cache too: a miss writes the entry
                self.restrict_modes()
            return compiled, "compiled"
        hits = xla_cache_hits()
        compiled = lowered.compile(compiler_options=options)
        if xla_cache_hits() != hits:
            return compiled, "xla-cache"
        self.restrict_modes()  # the miss wrote an XLA cache entry
        if store:
            self.store(key, compiled, description)
        return compiled, "compiled"

    def restrict_modes(self) -> None:
        """Make every file under xla/ 0600 and every directory there 0700 (our own files
        are written 0600 already). jax writes its cache files with the umask's mode (0644,
        typically), and any program the process compiles goes there, not only ours; xla/
        itself is 0700, so nobody else could reach them meanwhile, but the files should say
        so too. Called after each compile here and by ``jaxserve warmup`` at its end.
        Cheap: a walk of a few hundred entries, chmod only where the mode differs."""
        for dirpath, dirnames, filenames in os.walk(self.root / "xla"):
            for name, mode in [(d, 0o700) for d in dirnames] + [(f, 0o600) for f in filenames]:
                path = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):  # gone meanwhile (jax's own rename, another process)
                    st = os.lstat(path)
                    if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                        os.chmod(path, mode)

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.exe_dir / f"{key}.bin", self.exe_dir / f"{key}.json"

    def load(self, key: str, in_tree, out_tree):
        """The executable stored under ``key``, or None on a miss or a corrupt entry."""
        from jax.experimental import serialize_executable

        try:
            payload = self._read_entry(key)
            if payload is None:
                return None
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as exc:  # corrupt, truncated, or from an incompatible build
            msg = f"discarding corrupt cache entry {key}: {exc}"
            log.warning(msg)
            self.events.append(msg)
            self.discard(key)
            return None

    def store(self, key: str, compiled, description: dict[str, Any]) -> None:
        self.store_payload(key, serialized(compiled), description)

    def store_payload(self, key: str, payload: bytes, description: dict[str, Any]) -> None:
        """Store an executable already serialized (:func:`serialized`)."""
        self._write_entry(key, payload, description)

    def description(self, key: str) -> dict[str, Any]:
        """What was stored with the entry under ``key`` (its sidecar); {} if unreadable."""
        try:
            return json.loads(self._paths(key)[1].read_text())
        except (OSError, ValueError):
            return {}

    def _read_entry(self, key: str) -> bytes | None:
        """The payload stored under ``key`` (verified against the checksum in its own file),
        None if there is none; ValueError if it is damaged."""
        try:
            data = self._paths(key)[0].read_bytes()
        except FileNotFoundError:  # a miss, or discarded meanwhile by a process that found it corrupt
            return None
        return _unframe(data)

    def _write_entry(self, key: str, payload: bytes, description: dict[str, Any]) -> None:
        """The payload, self-checking, then its sidecar (written last: an entry whose sidecar
        exists is complete, which prune and an interrupted warmup go by)."""
        payload_path, meta_path = self._paths(key)
        meta = dict(description, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
        write_owner_only(payload_path, _frame(payload))
        write_owner_only(meta_path, json.dumps(meta, indent=1, default=str).encode())

    def discard(self, key: str) -> None:
        for p in self._paths(key):
            p.unlink(missing_ok=True)

    def prune(self, models: set[str], keep: set[str], precision: str = "f32") -> int:
        """Delete the serialized entries of ``models`` at ``precision`` whose key is not in
        ``keep`` (left behind by an older jaxserve, jax, config or grid: they can never load
        again), and any payload without a sidecar or half-written file. Entries of other
        models, or of the same model at another precision (a deploy may warm both), stay.
        Returns how many entries were removed."""
        def stale(key: str, entry: dict | None) -> bool:  # a sidecar or a manifest row; None: unreadable
            if key in keep:
                return False
            return entry is None or (entry.get("model") in models and entry.get("precision", "f32") == precision)

        removed = 0
        for meta_path in self.exe_dir.glob("*.json"):
            try:
                meta = json.loads(meta_path.read_text())
            except FileNotFoundError:  # discarded meanwhile by a process that found the entry corrupt
                continue
            except (OSError, ValueError):
                meta = None
            if not isinstance(meta, dict) or meta.get("model") is None:
                meta = None  # a sidecar that names no model can never load either
            if stale(meta_path.stem, meta):
                self.discard(meta_path.stem)
                removed += 1
        now = time.time()
        for path in self.exe_dir.iterdir():
            orphan = path.suffix == ".tmp" or (path.suffix == ".bin" and not path.with_suffix(".json").exists())
            with contextlib.suppress(FileNotFoundError):  # its writer may have renamed it meanwhile
                if orphan and now - path.stat().st_mtime > ORPHAN_AGE_S:
                    path.unlink()
                    removed += path.suffix == ".bin"
        self._update_manifest(lambda rows: {k: r for k, r in rows.items() if not stale(k, r)})
        return removed

    def write_manifest(self, rows: list[ManifestRow]) -> Path:
        """Merge ``rows`` into manifest.json (keyed by entry key; newest row wins)."""
        return self._update_manifest(lambda existing: {**existing, **{row.key: asdict(row) for row in rows}})

    def _update_manifest(self, change: Callable[[dict[str, dict]], dict[str, dict]]) -> Path:
        """Read, change and write manifest.json under the cache's lock, so concurrent warmup
        jobs (one per model, say) never lose each other's rows. An unreadable manifest
        counts as empty: it is a record, not something anything loads from."""
        path = self.root / "manifest.json"
        with _exclusive(self.root):
            rows: dict[str, dict] = {}
            if path.exists():
                try:
                    rows = {r["key"]: r for r in json.loads(path.read_text())["entries"]}
                except (ValueError, KeyError, TypeError):
                    rows = {}
            body = {"updated": time.strftime("%Y-%m-%dT%H:%M:%S"), "entries": list(change(rows).values())}
            write_owner_only(path, json.dumps(body, indent=1).encode())
        return path


def serialized(compiled) -> bytes:
    """An executable's bytes for the cache. Take them before its first call: on jax 0.10 an
    executable that has run can fail to serialize (``UNIMPLEMENTED: `LessThan` is not
    serializable``, seen with the ViT cells)."""
    from jax.experimental import serialize_executable

    payload, _, _ = serialize_executable.serialize(compiled)
    return payload


def enable_xla_cache(path: str | Path) -> None:
    """Turn on jax's persistent cache for *every* program, however small or fast to compile.

    jax's defaults skip programs that compile in under a second or are tiny, which is
    exactly what our polymorph cells are on a small model.

    jax also turns on XLA's own side caches by default (the GPU per-fusion autotune
    cache), and it does so by writing *the cache directory's path* into the compile
    options, which are part of every entry's key: a cache written at one path then
    never hits at another. A warmup job's output is meant to be shipped (CI artifact, image
    layer) to hosts of the same kind, so we switch those side caches off ("none") and keep
    the key path-independent (measurements: bench/RESULTS.md, 'The measurements behind the
    code's rules'); the serialized executables remain the fast path on every backend.

    jax opens its cache once, at the first compile, in the directory configured then: a later
    change of the directory alone is not seen, and this process would keep reading (and
    writing) the first cache's xla/. A second cache in another directory (a test's, a bench's)
    then "hits" programs it never held and, by the rule of :class:`CompileCache`, leaves them
    unserialized, so a worker loading that cache compiles them. Hence the reset.
    """
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    path = _owner_only_dir(Path(path))
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@contextlib.contextmanager
def xla_cache_bypassed():
    """Compile with no persistent-cache reads or writes inside the block. The setting is
    process-wide, so use it only where nothing else compiles meanwhile (warmup)."""
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        reset_cache()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
