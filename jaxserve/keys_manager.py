"""QUART's KeysManager (§6.1): key stages' parameters kept warm in host memory, per node.

The paper keeps a forked, copy-on-write process per key stage on each server, so a new
replica only copies parameters that already sit in the server's memory instead of reading
the model from disk; an LRU evicts cached processes once memory use passes 85%. Here the
warm copy is an object in Ray's object store (shared memory on the node): the stage's
parameters, a pytree of numpy arrays, ``ray.put`` once. A new replica (:class:`StageReplica`)
asks the node's :class:`KeysManager` for a :class:`Lease`; on a hit it ``ray.get``\\ s the
arrays (zero-copy, read-only views of the shared memory) and copies them onto its device:
the replica owns its copy, as the paper's non-COW fork does, and the cached object is not
pinned by it. (On the CPU backend ``jax.device_put`` of a read-only, 64-byte-aligned numpy
array, as Ray's are, aliases its memory, ``may_alias=False`` or not, so the copy is made
explicitly there; ``share=True``
keeps the alias instead: the paper's COW sharing, which pins the entry until the replica
lets go.) On a miss it restores the stage's orbax checkpoint itself and asks the manager to
cache it (:meth:`KeysManager.populate`).

On disk, each stage is an orbax checkpoint (:func:`save_stage_checkpoint`, read back with
:func:`jaxserve.orbax_io.restore_here`) with a record beside it (``digest.json``): the
sha256 of its arrays (:func:`params_digest`: paths, dtypes, shapes, bytes) and the size and
mtime of every checkpoint file. Entries are keyed by ``(stage, digest)``
(:class:`CacheKey`). Before serving an entry the manager reads the record
(:func:`recorded_digest`, a few ``stat`` calls, no array read); a checkpoint rewritten since
(another digest, or files that no longer match the record) is never served from the cache:
its stale entries are dropped and the replica loads from disk (the paper's invalidation
hook).

Eviction: before caching ``n`` bytes the manager evicts least-recently-used entries while
``used + n`` would pass ``high_water`` (0.85, the paper's threshold) of the node's object
store ``capacity``. ``used`` is the larger of Ray's figure for the node (its
``object_store_memory`` resource, total minus available; Ray updates it asynchronously) and
the bytes of the manager's own entries (always in the store). Both ``capacity_bytes`` and
``high_water`` are arguments, and ``store_usage=False`` counts only the entries, so a test
can force eviction exactly. A stage that does not fit even with the cache empty is not
cached (loads keep coming from disk); an object store that is full anyway spills to disk
(Ray's default), and ``ObjectStoreFullError`` where spilling is off evicts the rest and
gives up caching: memory pressure evicts, never crashes.

Where the state lives (decided): **one KeysManager Ray actor per node** (named
``jaxserve-keys-manager-<node id>``, pinned to its node: :func:`keys_manager`), the paper's
per-server KeysManager. The actor calls ``ray.put`` itself, so it *owns* the objects, and
holding their ObjectRefs keeps them alive for as long as the actor lives, whichever replicas
come and go (an object ``ray.put`` by a replica would die with that replica: Ray frees an
object when its owner dies). The objects land in the store of the actor's node, which is
the node the entries report (:attr:`CacheEntry.node_id`). A replica that ``ray.get``\\ s an
entry borrows it; an evicted entry is freed once the last borrower drops its reference. If
the actor dies its entries go with it (Ray frees an object whose owner died, not at once:
a read under way may still succeed); a replica then gets ``RayActorError`` from its lease
call or an ``ObjectLostError``-family error from its ``ray.get``, and loads from disk. A
driver-side manager would tie the cache to the driver's lifetime and put every entry on the
driver's node; the class works there too (it is plain Python), which is not how it is
deployed.

Names follow :mod:`jaxserve.sched.quart`, the policy's model of this cache
(:class:`~jaxserve.sched.quart.ParameterCache`): a load's source is ``"cache"`` or disk
(``"page"``/``"cold"`` there, which a replica cannot tell apart: it reports ``"disk"``);
``holds``, ``touch``, ``invalidate`` and ``cache_high_water`` mean the same.

Where we differ from the paper: no fork (a Ray actor is a fresh process; the warm copy is
the object store, not a sleeping process), so the process start of a new replica is not
saved, only its parameter read; the 85% is of Ray's object store on the node, not of the
machine's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("the KeysManager needs the ray extra: pip install 'jaxserve[ray]'") from exc

from jaxserve.sched.base import Stage

__all__ = ["CHECKPOINT", "RECORD", "CacheEntry", "CacheKey", "KeysManager", "Lease", "ReadyReport", "StageReplica",
           "cached_nodes", "drop_page_cache", "keys_manager", "load_stage_params", "params_digest", "params_from_state",
           "recorded_digest", "save_stage_checkpoint", "stage_dir", "state_from_params", "write_record"]

CHECKPOINT = "params"  # the orbax checkpoint, inside a stage's directory
RECORD = "digest.json"  # beside it: the arrays' sha256 and the checkpoint files' fingerprint
DEFAULT_HIGH_WATER = 0.85  # §6.1: evict past 85% of the memory
_LOST = (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.ObjectFetchTimedOutError,
         ray.exceptions.ReferenceCountingAssertionError, ray.exceptions.RayActorError)


# ------------------------------------------------------------------ parameters on disk

def stage_dir(root: str | Path, stage: Stage) -> Path:
    """Where ``stage``'s checkpoint and record live under ``root``: ``<model>/<start>-<stop>-of-<L>``."""
    return Path(root) / stage.model / f"{stage.start}-{stage.stop}-of-{stage.num_layers}"


def params_from_state(state: Any) -> dict:
    """A stage's parameters as the cache and the checkpoints hold them: a nested dict with
    string keys (``nnx.to_pure_dict``; list indices become ``"0"``, ``"1"``...) of numpy arrays."""
    from flax import nnx

    def strings(node):
        if isinstance(node, dict):
            return {str(k): strings(v) for k, v in node.items()}
        return np.asarray(node)

    return strings(nnx.to_pure_dict(state))


def state_from_params(abstract_state: Any, params: dict) -> Any:
    """``abstract_state`` (an ``nnx`` state, e.g. a stage servable's) with ``params``' arrays in
    place of its leaves, matched by path. KeyError for a missing parameter; ValueError for a
    shape or dtype that differs."""
    from flax import nnx

    pairs = []
    for path, variable in nnx.to_flat_state(abstract_state):
        node = params
        for part in path:
            node = node[str(part)]
        want = variable.get_value()
        if tuple(node.shape) != tuple(want.shape) or np.dtype(node.dtype) != np.dtype(want.dtype):
            raise ValueError(f"{'/'.join(map(str, path))}: {node.dtype}{list(node.shape)} where the state takes "
                             f"{want.dtype}{list(want.shape)}")
        pairs.append((path, variable.replace(node)))
    return nnx.from_flat_state(pairs)


def _leaves(params: Any) -> list[tuple[str, Any]]:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return sorted((jax.tree_util.keystr(path), leaf) for path, leaf in flat)


def params_digest(params: Any) -> str:
    """sha256 (hex) of a parameter tree: every leaf's path, dtype, shape and bytes, in path
    order. Equal trees hash equal wherever they live (numpy or device arrays)."""
    h = hashlib.sha256()
    for name, leaf in _leaves(params):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{name}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / CHECKPOINT).rglob("*") if p.is_file())


def _fingerprint(directory: Path) -> dict[str, list[int]]:
    out = {}
    for p in _checkpoint_files(directory):
        st = p.stat()
        out[str(p.relative_to(directory))] = [st.st_size, st.st_mtime_ns]
    return out


def write_record(directory: str | Path, digest: str) -> None:
    """Record ``digest`` as the hash of the checkpoint in ``directory`` as its files are now."""
    directory = Path(directory)
    record = {"sha256": digest, "files": _fingerprint(directory)}
    tmp = directory / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, directory / RECORD)


def save_stage_checkpoint(directory: str | Path, params: Any) -> str:
    """Write ``params`` (a tree of arrays) as an orbax checkpoint under ``directory`` (replacing
    one there) and its record beside it; the digest. The record is removed first, so a
    checkpoint half rewritten never carries the old digest."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / RECORD).unlink(missing_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / CHECKPOINT, params, force=True)
    digest = params_digest(params)
    write_record(directory, digest)
    return digest


def recorded_digest(directory: str | Path) -> str | None:
    """The digest recorded for the checkpoint in ``directory``, or None where there is no
    record or the checkpoint's files (names, sizes, mtimes) no longer match it: rewritten
    without a new record, the digest is unknown. Reads no array."""
    directory = Path(directory)
    try:
        record = json.loads((directory / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if record.get("files") != _fingerprint(directory):
        return None
    return record.get("sha256")


def load_stage_params(directory: str | Path, host: bool = False) -> Any:
    """Restore the stage checkpoint in ``directory``: device arrays on this process's default
    device (what a replica without the cache does), or numpy arrays (``host``)."""
    import jax

    from jaxserve.orbax_io import restore_here

    params = restore_here(Path(directory).absolute() / CHECKPOINT)
    if host:
        return jax.tree_util.tree_map(np.asarray, params)
    return jax.block_until_ready(params)


def drop_page_cache(directory: str | Path) -> int:
    """Evict the checkpoint's files from the OS page cache (fsync, then
    ``posix_fadvise(DONTNEED)``), so the next read comes from the disk; the files done."""
    count = 0
    for p in _checkpoint_files(Path(directory)):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


# ------------------------------------------------------------------ the cache

@dataclass(frozen=True)
class CacheKey:
    """What an entry holds: ``stage``'s parameters as its checkpoint had them when its
    digest was ``digest``."""

    stage: Stage
    digest: str


@dataclass(frozen=True)
class CacheEntry:
    """One cached stage: its key, bytes, the Ray node whose object store holds it, when it was
    last used (``time.monotonic`` of the manager's process) and its hits so far."""

    key: CacheKey
    nbytes: int
    node_id: str
    last_used: float
    hits: int


@dataclass(frozen=True)
class Lease:
    """The manager's answer to a new replica. ``source`` ``"cache"``: ``ref`` (a one-element
    tuple, so Ray hands the ObjectRef itself, not its value) holds the parameters of ``key``;
    ``"disk"``: load the checkpoint (``key`` None when its digest is unknown). ``invalidated``:
    stale entries of the stage dropped by this lease."""

    source: str
    key: CacheKey | None
    ref: tuple | None
    node_id: str
    invalidated: int = 0


@dataclass
class _Slot:
    ref: Any
    nbytes: int
    last_used: float
    hits: int = 0


def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _node_store_bytes(node_id: str) -> tuple[float | None, float | None]:
    """(capacity, used) of ``node_id``'s object store as Ray's resources report it (used:
    total minus available, updated asynchronously); (None, None) where it cannot be read."""
    try:
        from ray._private import state

        total = state.total_resources_per_node().get(node_id, {}).get("object_store_memory")
        avail = state.available_resources_per_node().get(node_id, {}).get("object_store_memory")
    except Exception:  # a private API: fall back to the cluster's figures
        total = ray.cluster_resources().get("object_store_memory")
        avail = ray.available_resources().get("object_store_memory")
    if total is None:
        return None, None
    return float(total), (float(total) - float(avail) if avail is not None else None)


class KeysManager:
    """Key stages' parameters in this node's object store, LRU past ``high_water`` of
    ``capacity_bytes`` (default: the node's object store). Deployed as a Ray actor per node
    (:func:`keys_manager`); every method is one actor call. Counters: :meth:`stats`."""

    def __init__(self, capacity_bytes: float | None = None, high_water: float = DEFAULT_HIGH_WATER,
                 store_usage: bool = True, clock: Callable[[], float] = time.monotonic):
        if not 0 < high_water <= 1:
            raise ValueError(f"high_water must be in (0, 1], got {high_water}")
        self.node_id = _node_id()
        self.capacity_bytes = capacity_bytes
        self.cache_high_water = high_water
        self.store_usage = store_usage
        self._clock = clock
        self._slots: OrderedDict[CacheKey, _Slot] = OrderedDict()  # least recently used first
        self._counts = {"hits": 0, "misses": 0, "invalidated": 0, "evicted": 0, "not_cached": 0}

    # ---------------------------------------------------------------- lookups
    def lease(self, stage: Stage, directory: str) -> Lease:
        """Where a new replica of ``stage`` (checkpoint in ``directory``) takes its parameters:
        the cache when an entry's digest is the one recorded on disk now, else the disk. Stale
        entries of the stage (another digest, or the record unknown) are dropped here."""
        digest = recorded_digest(directory)
        dropped = self._drop_stale(stage, digest)
        key = CacheKey(stage, digest) if digest is not None else None
        slot = self._slots.get(key) if key is not None else None
        if slot is None:
            self._counts["misses"] += 1
            return Lease("disk", key, None, self.node_id, dropped)
        self.touch(key)
        slot.hits += 1
        self._counts["hits"] += 1
        return Lease("cache", key, (slot.ref,), self.node_id, dropped)

    def holds(self, stage: Stage, directory: str | None = None) -> bool:
        """Whether an entry of ``stage`` is cached (with ``directory``: one valid for the
        checkpoint there now)."""
        if directory is None:
            return any(k.stage == stage for k in self._slots)
        digest = recorded_digest(directory)
        return digest is not None and CacheKey(stage, digest) in self._slots

    def touch(self, key: CacheKey) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            slot.last_used = self._clock()
            self._slots.move_to_end(key)

    def entries(self) -> tuple[CacheEntry, ...]:
        """The entries, least recently used first."""
        return tuple(CacheEntry(k, s.nbytes, self.node_id, s.last_used, s.hits) for k, s in self._slots.items())

    def stats(self) -> dict[str, int]:
        """Counters since start: hits, misses, invalidated, evicted, not_cached (too large)."""
        return dict(self._counts, entries=len(self._slots), bytes=self.cached_bytes())

    def cached_bytes(self) -> int:
        return sum(s.nbytes for s in self._slots.values())

    def capacity(self) -> float:
        """The object store bytes the high-water mark is taken of."""
        if self.capacity_bytes is not None:
            return float(self.capacity_bytes)
        total, _ = _node_store_bytes(self.node_id)
        if total is None:
            raise RuntimeError("Ray reports no object_store_memory for this node; pass capacity_bytes")
        return total

    def used_bytes(self) -> float:
        """Bytes counted as used: the entries', or (``store_usage``) the larger of those and
        the node's object store use as Ray reports it."""
        mine = float(self.cached_bytes())
        if not self.store_usage:
            return mine
        _, used = _node_store_bytes(self.node_id)
        return max(mine, used or 0.0)

    # ---------------------------------------------------------------- changes
    def populate(self, stage: Stage, directory: str) -> CacheKey | None:
        """Cache ``stage``'s checkpoint in ``directory`` (read here, on the manager's node),
        evicting LRU entries to stay under the high-water mark; the key, or None when it was
        not cached (larger than the mark allows, the store full, or the checkpoint changed
        while it was read). Already cached: touched, nothing read. A checkpoint without a
        valid record gets one: its digest is that of the arrays read."""
        directory = str(Path(directory).absolute())
        digest = recorded_digest(directory)
        self._drop_stale(stage, digest)
        if digest is not None and CacheKey(stage, digest) in self._slots:
            self.touch(CacheKey(stage, digest))
            return CacheKey(stage, digest)
        before = _fingerprint(Path(directory))
        params = load_stage_params(directory, host=True)
        if _fingerprint(Path(directory)) != before:
            return None  # rewritten while read
        actual = params_digest(params)
        if digest is None:
            write_record(directory, actual)
        elif actual != digest:  # the record lies about the files (same sizes and mtimes): trust the arrays
            write_record(directory, actual)
        return self.insert(CacheKey(stage, actual), params)

    def insert(self, key: CacheKey, params: Any) -> CacheKey | None:
        """Put ``params`` (numpy arrays) in the object store under ``key`` (replacing any
        entry of that stage), evicting LRU entries first; None when it cannot be cached."""
        nbytes = int(sum(np.asarray(leaf).nbytes for _, leaf in _leaves(params)))
        self._drop_stale(key.stage, key.digest)
        if key in self._slots:
            self.touch(key)
            return key
        limit = self.cache_high_water * self.capacity()
        if nbytes > limit:
            self._counts["not_cached"] += 1
            return None
        used = self.used_bytes()
        while self._slots and used + nbytes > limit:
            used -= self._evict_one()
        if used + nbytes > limit:  # others' objects fill the store
            self._counts["not_cached"] += 1
            return None
        try:
            ref = ray.put(params)
        except ray.exceptions.ObjectStoreFullError:
            while self._slots:
                self._evict_one()
            self._counts["not_cached"] += 1
            return None
        self._slots[key] = _Slot(ref, nbytes, self._clock())
        return key

    def invalidate(self, stage: Stage) -> int:
        """Drop every entry of ``stage`` (its checkpoint changed); how many."""
        return self._drop_stale(stage, None)

    def evict(self, key: CacheKey) -> bool:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._counts["evicted"] += 1
        return slot is not None

    def clear(self) -> int:
        n = len(self._slots)
        self._slots.clear()
        return n

    def node(self) -> str:
        return self.node_id

    def _evict_one(self) -> int:
        _, slot = self._slots.popitem(last=False)
        self._counts["evicted"] += 1
        return slot.nbytes

    def _drop_stale(self, stage: Stage, digest: str | None) -> int:
        stale = [k for k in self._slots if k.stage == stage and k.digest != digest]
        for k in stale:
            del self._slots[k]
        self._counts["invalidated"] += len(stale)
        return len(stale)


_ManagerActor = ray.remote(num_cpus=0)(KeysManager)


def keys_manager(node_id: str | None = None, namespace: str = "jaxserve", **options) -> Any:
    """The KeysManager actor of ``node_id`` (default: this process's node), started on that
    node if there is none (``options``: :class:`KeysManager`'s arguments, used only then).
    Named ``jaxserve-keys-manager-<node id>`` in ``namespace``: every process of the cluster
    asking for that node's finds the same one. Not detached: Ray collects it (and its entries)
    once the process that started it holds no handle to it or ends, so whoever starts it keeps
    the handle for as long as the cache should live (a QUART server:
    :attr:`jaxserve.quart_exec.QuartRayWorkers.manager`); a process that only finds it may drop
    its handle freely."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or _node_id()
    return _ManagerActor.options(
        name=f"jaxserve-keys-manager-{node_id}", namespace=namespace, get_if_exists=True, lifetime=None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(**options)


def cached_nodes(stage: Stage, directory: str | None = None, namespace: str = "jaxserve") -> list[str]:
    """The alive nodes whose KeysManager holds ``stage`` (with ``directory``: an entry valid
    for the checkpoint there now): what cache-aware placement
    (:func:`jaxserve.sched.quart.choose_server`'s ``cached``) asks. Starts no manager."""
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        try:
            handle = ray.get_actor(f"jaxserve-keys-manager-{node['NodeID']}", namespace=namespace)
        except ValueError:  # no manager on that node
            continue
        try:
            if ray.get(handle.holds.remote(stage, directory)):
                out.append(node["NodeID"])
        except ray.exceptions.RayActorError:
            continue
    return out


# ------------------------------------------------------------------ a replica

@dataclass(frozen=True)
class ReadyReport:
    """A replica's start: where its parameters came from (``"cache"`` or ``"disk"``), the
    seconds from asking to device arrays ready, their bytes and digest (of the arrays
    held), its node and process; ``shared``: some device arrays alias the object store."""

    source: str
    seconds: float
    nbytes: int
    digest: str | None
    node_id: str
    pid: int
    shared: bool = False


def _aliases(device_array: Any, host: np.ndarray) -> bool:
    try:
        return device_array.unsafe_buffer_pointer() == host.ctypes.data
    except Exception:  # not a single-buffer array of this process's memory
        return False


def _private_copy(a: np.ndarray) -> np.ndarray:
    """A read-only copy of ``a`` in memory of this process, 64-byte aligned: what the CPU
    backend adopts without a second copy (it copies, at a quarter of memcpy's speed here,
    arrays that are writable or less aligned)."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    offset = (-buf.ctypes.data) % 64
    out = buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    out.flags.writeable = False
    return out


def _to_device(host: Any, copy: bool = True) -> tuple[Any, bool]:
    """``host`` (numpy, e.g. views of the object store) on the default device, waited for;
    and whether any array aliases ``host``'s memory. ``copy``: never alias (the CPU backend
    aliases aligned read-only numpy arrays whatever ``may_alias`` says: such leaves get a
    private copy, which it adopts). On an accelerator ``device_put`` is the copy."""
    import jax

    params = jax.device_put(host)
    if copy:
        params = jax.tree_util.tree_map(lambda d, h: jax.device_put(_private_copy(h)) if _aliases(d, h) else d,
                                        params, host)
    params = jax.block_until_ready(params)
    shared = any(_aliases(d, h) for d, h in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(host)))
    return params, shared


class StageReplica:
    """A new replica of a stage, as far as its parameters go: :meth:`become_ready` takes them
    from the node's KeysManager (a hit: ``ray.get`` + ``jax.device_put``) or the disk (orbax
    restore; then asks the manager to cache them), and holds them on its device. Running
    steps is :mod:`jaxserve.ray_workers`' business; this is the load it would do first."""

    def __init__(self, env: dict[str, str] | None = None):
        for k, v in (env or {}).items():  # before JAX is imported here
            os.environ[k] = v
        self.params = None
        self.stage: Stage | None = None

    def become_ready(self, stage: Stage, directory: str, manager: Any = None, populate: bool = True,
                     digest: bool = False, share: bool = False) -> ReadyReport:
        """Load ``stage``'s parameters (checkpoint in ``directory``) onto the device, through
        ``manager`` (a KeysManager actor handle) when given; ``populate``: on a miss, ask the
        manager to cache the stage (without waiting). ``digest``: hash what was loaded
        (off the clock) for the report. ``share``: from the cache, let the device arrays
        alias the object store where the backend can (the CPU) instead of copying."""
        self.params = None
        t0 = time.perf_counter()
        source, params, shared = "disk", None, False
        if manager is not None:
            try:
                lease = ray.get(manager.lease.remote(stage, directory))
                if lease.source == "cache":
                    host = ray.get(lease.ref[0])
                    params, shared = _to_device(host, copy=not share)
                    del host  # copied: the object is no longer pinned by this replica
                    source = "cache"
            except _LOST:  # the manager or its object is gone: the disk, without asking it to cache
                params, manager = None, None
        if params is None:
            params = load_stage_params(directory)
        seconds = time.perf_counter() - t0
        if source == "disk" and manager is not None and populate:
            manager.populate.remote(stage, directory)
        self.params, self.stage = params, stage
        nbytes = int(sum(leaf.nbytes for _, leaf in _leaves(params)))
        return ReadyReport(source, seconds, nbytes, params_digest(params) if digest else None, _node_id(), os.getpid(),
                           shared)

    def host_params(self) -> Any:
        """The held parameters, copied to numpy (for comparisons)."""
        import jax

        return jax.tree_util.tree_map(np.asarray, self.params)

    def release(self) -> None:
        self.params, self.stage = None, None

    def ping(self) -> int:
        """Ready to take calls (imports done); the process id."""
        import jax

        jax.devices()  # the import and the backend's start are what a first call pays
        return os.getpid()


ReplicaActor = ray.remote(StageReplica)
