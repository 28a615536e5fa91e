"""Native CPU kernels that compiled executables call through XLA's FFI.

One kernel so far: fused multi-head attention (``attention_cpu.cc``; why and how in its
header), registered as two FFI targets: ``ATTENTION_TARGET`` (a per-key bias [B, S]) and
``ATTENTION_POS_BIAS_TARGET`` (that, plus a per-head [H, S, S] bias: MPNet's relative
positions; measurements: bench/RESULTS.md, 'The measurements behind the code's rules'). It is
C++ built on the host that runs it, the way PyTorch's inductor and Triton build theirs: the
system C++ compiler (``$CXX``, else g++, c++ or clang++) with ``-O3 -march=native`` against the FFI headers
that ship in jaxlib, once per (source, compiler, jaxlib, CPU instruction set), into an
owner-only kernel directory (``$JAXSERVE_KERNEL_DIR``, else ``$XDG_CACHE_HOME/jaxserve/
kernels`` or ``~/.cache/jaxserve/kernels``). A build takes a few seconds and happens when a
process first traces or loads an executable that would use it (warmup), never per request.

Where the kernel cannot be had (no compiler, a failed build, a kernel directory someone
else could write, a backend other than the CPU) or ``JAXSERVE_FUSED_ATTENTION=0`` is set,
attention runs as XLA ops instead: same results to float32 rounding, slower at long
sequences. Which one a process uses is part of every compile-cache key
(:func:`attention_fingerprint`), so executables built with one are never loaded by a
process using the other, and an executable that calls the kernel is only deserialized
after the kernel is registered (computing the key registers it).

Beside it, one plain C library that XLA never calls: OTAS's Alg. 2 dynamic program
(``otas_dp.c``, :func:`otas_dp_library`; :func:`jaxserve.sched.otas.solve_token_dp` calls it
through ctypes). It is built the same way, with the system C compiler (``$CC``, else gcc, cc
or clang), ``-O2`` without fast-math or FMA contraction (its labels must equal numpy's to the
bit), once per (source, compiler, flags, machine), into the same kernel directory, when a
server or simulation makes an image policy (``launch.make_policy``) or else on the first DP a
process solves. Where it cannot be had (no compiler, a failed build, an untrusted
kernel directory: a warning, once) or ``JAXSERVE_NATIVE_DP=0`` is set, the DP runs in
Python/numpy: the same answers to the bit, slower. Nothing on its path imports jax (the
schedulers must not).

The kernel directory holds native code this process loads: like ``compiled_cache/``, it is
trusted code. It is created 0700, libraries are written 0700 and atomically, and a
library or directory that another user owns or could write is refused (with a warning),
not loaded.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("jaxserve.kernels")

SOURCE = Path(__file__).resolve().parent / "attention_cpu.cc"
ATTENTION_TARGET = "jaxserve_fused_attention_f32"
ATTENTION_POS_BIAS_TARGET = ATTENTION_TARGET + "_pos_bias"  # build_kernel: <target> + "_pos_bias"
_SYMBOL = "JaxserveFusedAttention"
_POS_BIAS_SYMBOL = "JaxserveFusedAttentionPosBias"
_FLAGS = ("-O3", "-std=c++17", "-ffp-contract=fast", "-fPIC", "-shared", "-w")
_ARCH_FLAGS = ("-march=native",)  # dropped on a compiler that refuses it
OTAS_DP_SOURCE = Path(__file__).resolve().parent / "otas_dp.c"
_OTAS_DP_SYMBOL = "jaxserve_otas_dp"
# IEEE doubles as Python and numpy compute them: no fast-math, no fused multiply-add, no -march
_OTAS_DP_FLAGS = ("-O2", "-std=c11", "-fno-fast-math", "-ffp-contract=off", "-fPIC", "-shared")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxserve_attention", default=None)


@dataclass(frozen=True)
class Kernel:
    """A built, loaded and registered kernel library."""

    target: str  # the FFI target name executables call (a per-key bias [B, S])
    path: Path
    build_id: str  # hash of source, compiler, flags, jaxlib and CPU: part of cache keys
    built_seconds: float  # 0.0 when an earlier build was reused

    @property
    def pos_bias_target(self) -> str:
        """The FFI target of the variant that also adds a per-head [H, S, S] bias."""
        return self.target + "_pos_bias"


def kernel_dir() -> Path:
    explicit = os.environ.get("JAXSERVE_KERNEL_DIR")
    if explicit:
        return Path(explicit)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "jaxserve" / "kernels"


def _find_compiler(candidates: tuple[str | None, ...]) -> str | None:
    for candidate in candidates:
        if candidate:
            found = shutil.which(candidate)
            if found:
                return found
    return None


def _compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else g++, c++ or clang++."""
    return _find_compiler((os.environ.get("CXX"), "g++", "c++", "clang++"))


def _c_compiler() -> str | None:
    """The C compiler: ``$CC``, else gcc, cc or clang."""
    return _find_compiler((os.environ.get("CC"), "gcc", "cc", "clang"))


def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def _check_trusted(path: Path, *, directory: bool) -> None:
    """Raise PermissionError unless ``path`` is ours and nobody else can write it."""
    st = os.lstat(path)
    kind = "directory" if directory else "library"
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"kernel {kind} {path} is a symbolic link")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"kernel {kind} {path} belongs to uid {st.st_uid}, not this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"kernel {kind} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _build_id(*parts: bytes) -> str:
    """A library's build id: the hash of what went into it (each part NUL-terminated)."""
    ident = hashlib.sha256()
    for part in parts:
        ident.update(part + b"\0")
    return ident.hexdigest()[:16]


def _compile(command: list[str], out: Path, arch_flags: tuple[str, ...] = ()) -> None:
    """Run ``command`` (compiler first, then its flags and sources) with ``-o`` a temporary file
    beside ``out``, made 0700 and renamed onto ``out`` (atomic: a reader sees no half-written
    library). With ``arch_flags``, first tried right after the compiler, then without them."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        for arch in (arch_flags, ()) if arch_flags else ((),):
            proc = subprocess.run([*command[:1], *arch, *command[1:], "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode == 0:
                break
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"{Path(command[0]).name} failed (exit {proc.returncode}): " + " | ".join(tail))
        os.chmod(tmp, 0o700)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _build(source: Path, out: Path, cxx: str, defines: dict[str, str]) -> None:
    import jax.ffi

    defs = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    _compile([cxx, *_FLAGS, *defs, "-I", jax.ffi.include_dir(), str(source)], out, _ARCH_FLAGS)


def _built_library(directory: Path, name: str, build, what: str) -> tuple[Path, float]:
    """``directory / name``, built by ``build(path)`` unless already there: the directory is made
    0700 and must be trusted (:func:`_check_trusted`), one builder per directory at a time (a file
    lock), and the library must be trusted too. Returns (path, build seconds: 0.0 if reused)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _check_trusted(directory, directory=True)
    path = directory / name
    seconds = 0.0
    lock = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory at a time
        if not path.exists():
            t0 = time.perf_counter()
            build(path)
            seconds = time.perf_counter() - t0
            log.info("built the %s in %.1f s: %s", what, seconds, path)
    finally:
        os.close(lock)  # releases the lock
    _check_trusted(path, directory=False)
    return path, seconds


def build_kernel(target: str = ATTENTION_TARGET, defines: dict[str, str] | None = None,
                 directory: Path | None = None) -> Kernel:
    """Build (or reuse) the attention kernel library, load it and register it with XLA as
    ``target`` (and its position-bias variant as ``target + "_pos_bias"``) for the CPU. ``defines``: extra -D macros (the tests build the 16-lane variant
    on any CPU with ``JAXSERVE_VEC_BYTES=64``). Raises if it cannot."""
    import jax
    import jaxlib

    from jaxserve.compile_cache import host_cpu

    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    defines = dict(defines or {})
    build_id = _build_id(SOURCE.read_bytes(), _compiler_version(cxx).encode(), " ".join(_FLAGS + _ARCH_FLAGS).encode(),
                         repr(sorted(defines.items())).encode(), jaxlib.__version__.encode(), host_cpu().encode())
    path, seconds = _built_library(directory if directory is not None else kernel_dir(), f"attention-{build_id}.so",
                                   lambda out: _build(SOURCE, out, cxx, defines), "fused attention kernel")
    library = ctypes.CDLL(str(path))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, _SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(target + "_pos_bias", jax.ffi.pycapsule(getattr(library, _POS_BIAS_SYMBOL)),
                                platform="cpu")
    _LIBRARIES.append(library)  # keep it loaded for as long as executables may call it
    return Kernel(target=target, path=path, build_id=build_id, built_seconds=seconds)


_LIBRARIES: list[ctypes.CDLL] = []


@functools.cache
def fused_attention_kernel() -> Kernel | None:
    """This process's attention kernel, built and registered on first call; None where it is
    off (``JAXSERVE_FUSED_ATTENTION=0``), not for this backend, or could not be built (the
    reason is logged once)."""
    if os.environ.get("JAXSERVE_FUSED_ATTENTION", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import jax

    if jax.default_backend() != "cpu":
        return None
    try:
        return build_kernel()
    except Exception as exc:  # no compiler, a failed build, an untrusted directory
        log.warning("fused attention kernel unavailable, attention runs as XLA ops: %s", exc)
        return None


def attention_impl() -> str:
    """"fused" or "xla": what attention traced now in this thread compiles to."""
    forced = _override.get()
    if forced is not None:
        return forced
    return "fused" if fused_attention_kernel() is not None else "xla"


def attention_fingerprint() -> str:
    """The attention implementation, for compile-cache keys: "xla" or "fused:<build id>"."""
    if attention_impl() == "xla":
        return "xla"
    kernel = fused_attention_kernel()
    return f"fused:{kernel.build_id}" if kernel is not None else "xla"


@contextlib.contextmanager
def tracing_xla_attention():
    """Attention traced inside this block compiles to XLA ops, without clearing jax's caches:
    only for tracing a function object jax has not traced before (warmup's tuning wraps the
    cell's function afresh, :class:`jaxserve.polymorph.PolymorphTable`), since a cached trace
    of the same function would come back in the other form. Cache keys made inside the block
    would name XLA attention: make them outside it."""
    token = _override.set("xla")
    try:
        yield
    finally:
        _override.reset(token)


@contextlib.contextmanager
def xla_attention():
    """Trace (and key) attention as XLA ops inside this block, kernel or not: the benchmarks'
    same-run A/B and the tests' reference.

    jit's trace cache is keyed by the function and its argument types, not by this switch,
    so a function traced on one side would be reused on the other: the block clears jax's
    caches when it starts and ends (compiled executables already held are untouched). That
    costs a retrace, which is why this is for benchmarks and tests, not a serving process."""
    import jax

    with tracing_xla_attention():
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()


@dataclass(frozen=True)
class NativeDP:
    """The loaded OTAS DP library: ``solve`` is its ``jaxserve_otas_dp`` (argument and return
    types set; the contract is in otas_dp.c's header)."""

    solve: object  # ctypes function
    path: Path
    build_id: str  # hash of source, compiler, flags and machine
    built_seconds: float  # 0.0 when an earlier build was reused


def build_otas_dp(directory: Path | None = None) -> NativeDP:
    """Build (or reuse) and load the OTAS DP library (otas_dp.c) in ``directory`` (default
    :func:`kernel_dir`). Raises if it cannot: no C compiler, a failed build, an untrusted
    directory or library."""
    cc = _c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    build_id = _build_id(OTAS_DP_SOURCE.read_bytes(), _compiler_version(cc).encode(), " ".join(_OTAS_DP_FLAGS).encode(),
                         f"{platform.system()} {platform.machine()}".encode())
    path, seconds = _built_library(directory if directory is not None else kernel_dir(), f"otas_dp-{build_id}.so",
                                   lambda out: _compile([cc, *_OTAS_DP_FLAGS, str(OTAS_DP_SOURCE)], out),
                                   "native OTAS DP")
    library = ctypes.CDLL(str(path))
    solve = getattr(library, _OTAS_DP_SYMBOL)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    solve.argtypes = (i64, ptr, ptr, ctypes.c_double, ctypes.c_double, i64, i64, ptr, ptr, ptr, ptr)
    solve.restype = i64
    _LIBRARIES.append(library)
    return NativeDP(solve=solve, path=path, build_id=build_id, built_seconds=seconds)


@functools.cache
def otas_dp_library() -> NativeDP | None:
    """This process's OTAS DP library, built and loaded on first call; None where it could not
    be (the reason is logged once: the DP then runs in Python/numpy, the same answers)."""
    try:
        return build_otas_dp()
    except Exception as exc:  # no compiler, a failed build, an untrusted directory, a library that will not load
        log.warning("native OTAS DP unavailable, the DP runs in Python/numpy: %s", exc)
        return None
