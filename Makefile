# gpuguard: `make test` and `make demo` set up everything they need on Debian 12 (as root).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
APT_PACKAGES := python3 python3-venv python3-dev gcc make psmisc lsof dbus-daemon dbus-bin \
	libglib2.0-bin libxml2-utils systemd-container polkitd pkexec

.PHONY: all deps venv test lint typecheck unit gpu-test bench clean

all: test

# Debian packages the suite drives for real (dbus-daemon, busctl, gdbus, fuser, lsof, gcc for
# the fake NVML library, systemd-nspawn). Installed only where missing, so a developer machine
# that has them is not touched.
deps:
	@missing=""; for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		if [ "$$(id -u)" != 0 ]; then echo "run as root to install:$$missing" >&2; exit 1; fi; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

$(BIN)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

lint: venv
	$(BIN)/ruff check gpuguardd tests bench

typecheck: venv
	$(BIN)/mypy

# tests/gpu needs a real NVIDIA GPU: never part of `make test` (CI has none); see gpu-test.
unit: deps venv
	$(BIN)/pytest -q -p no:cacheprovider --ignore=tests/gpu tests

gpu-test: venv
	$(BIN)/pytest -v -p no:cacheprovider tests/gpu

test: deps venv lint typecheck unit

bench: deps venv
	$(BIN)/python bench/bench_scan.py
	$(BIN)/python bench/bench_sweep.py

clean:
	rm -rf $(VENV) build dist *.egg-info tests/fakenvml/build
