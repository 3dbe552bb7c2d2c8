# Two commands on a fresh machine:
#   make demo   create .venv, install graphopt (+ the zoo's torchvision/transformers) and
#               print `graphopt explain` for the bundled default model
#   make test   create .venv, install the dev extra, compile-check the CUDA kernels (nvcc,
#               sm_80 + sm_90, no GPU needed: a system toolkit, else the dev extra's pip one;
#               with neither it says so in one line) and run the CPU test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?= -q -m "not slow" -n auto

.PHONY: demo test install install-dev check-kernels test-all bench-kernels clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# An editable install of this layout (passes/ and cuda_ext/ mapped into the graphopt package) makes
# setuptools print an InformationOnly notice ("Editable installation. Please be careful with folders
# in your working directory..."), general advice rather than a problem with the package; it is the one
# warning filtered here. A wheel build (pip wheel .) warns about nothing.
EDITABLE := PYTHONWARNINGS="ignore:Editable installation:UserWarning"

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q --upgrade pip
	$(EDITABLE) $(PIP) install -q -e ".[zoo]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(EDITABLE) $(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed
	$(VENV)/bin/graphopt explain

check-kernels: $(VENV)/.installed-dev
	$(PY) -m graphopt.cuda_ext.build --check-compile --arch sm_80,sm_90 --if-available

test: $(VENV)/.installed-dev check-kernels
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: $(VENV)/.installed-dev
	$(PY) -m pytest -q -n auto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
