# gpuguard: `make test` and `make demo` set up everything they need on Debian 12 (as root).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
.PHONY: all help deps venv check test lint typecheck suite gpu-test bench clean man install \
	install-python install-data units uninstall rpm-files dist deb rpm demo e2e cockpit install-cockpit \
	gnome-extension install-gnome-extension

all: test

help:
	@echo "make check      ruff and the unit tests (tests/unit) as nobody: seconds, for the edit-test loop"
	@echo "make test       everything CI runs: deps, ruff, mypy, every test but tests/gpu (as root)"
	@echo "make e2e        the end-to-end tests alone (real systemd in systemd-nspawn; root)"
	@echo "make gpu-test   the real-GPU checks (tests/gpu; a machine with an NVIDIA GPU)"
	@echo "make demo       the demo in a throwaway systemd container (root)"
	@echo "make bench      the benchmarks (bench/)"
	@echo "make dist       the release tarball, dist/gpuguard-<version>.tar.gz (packaging/README.md)"
	@echo "make deb rpm    the packages; make install, uninstall; make man; make cockpit"

# The Debian packages the suite, the builds and the demo drive for real: the list, and why
# each is there, is packaging/deps.sh, which installs only those missing (as root).
deps:
	packaging/deps.sh

$(BIN)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

lint: venv
	$(BIN)/ruff check gpuguardd tests bench packaging demo

typecheck: venv
	$(BIN)/mypy

# The tests by kind (docs/testing.md): tests/unit (no root, no services), tests/host (root
# on this host), tests/bus (a private dbus-daemon), tests/cockpit (a browser), tests/packaging,
# tests/e2e (real systemd), tests/gpu (a real GPU: never part of `make test`, CI has none).
suite: deps venv cockpit
	$(BIN)/pytest -q -p no:cacheprovider --ignore=tests/gpu tests

# `make check`: the edit-test loop. ruff, then tests/unit, which needs neither root nor a
# service (its tools come from make deps): as root it runs as nobody, so a unit test that needs root
# fails here (tests/unit/conftest.py fails every skip). nobody cannot reach an interpreter
# under root's home (pyenv): then a venv of the system's Python ($(NOBODY_PYTHON)) serves,
# made once. A checkout nobody cannot read (under /root) runs them as root, and says so.
# -n auto: pytest-xdist, one worker a core.
NOBODY := setpriv --reuid=nobody --regid=nogroup --clear-groups --inh-caps=-all
NOBODY_PYTHON ?= /usr/bin/python3
NOBODY_VENV := .venv-nobody
UNIT_PYTEST = env PYTHONDONTWRITEBYTECODE=1 $(1) -m pytest -q -p no:cacheprovider -n auto tests/unit

check: venv
	$(BIN)/ruff check gpuguardd tests bench packaging demo
	@start=$$(date +%s%N); run=; py=$(BIN)/python; \
	if [ "$$(id -u)" != 0 ]; then :; \
	elif ! $(NOBODY) test -r tests/unit/conftest.py; then \
		echo "make check: nobody cannot read $(CURDIR) (a private home?): the unit tests run as root" >&2; \
	elif $(NOBODY) env $(BIN)/python -c 'import pytest' 2>/dev/null; then \
		run="$(NOBODY) env HOME=/nonexistent"; \
	else \
		$(MAKE) --no-print-directory $(NOBODY_VENV)/.installed || exit 1; \
		run="$(NOBODY) env HOME=/nonexistent"; py=$(NOBODY_VENV)/bin/python; \
	fi; \
	echo "$$run $(call UNIT_PYTEST,$$py)"; \
	$$run $(call UNIT_PYTEST,$$py); \
	code=$$?; echo "make check: tests/unit took $$(( ($$(date +%s%N) - start) / 1000000 )) ms"; exit $$code

$(NOBODY_VENV)/.installed: setup.cfg pyproject.toml
	$(NOBODY_PYTHON) -m venv $(NOBODY_VENV)
	$(NOBODY_VENV)/bin/pip install -q -e '.[test]'
	touch $@

gpu-test: venv
	$(BIN)/pytest -v -p no:cacheprovider tests/gpu

test: deps venv lint typecheck suite

bench: deps venv
	$(BIN)/python bench/bench_scan.py
	$(BIN)/python bench/bench_startup.py
	$(BIN)/python bench/bench_sweep.py
	$(BIN)/python bench/bench_dbus.py
	$(BIN)/python bench/bench_history.py

# Both boot the machine's own systemd as PID 1 in a throwaway systemd-nspawn container over a
# volatile overlay of / (tests/e2e/harness.py): nothing is written to the host. Root only.
demo: deps venv
	$(BIN)/python demo/demo.py

e2e: deps venv
	$(BIN)/pytest -v -p no:cacheprovider tests/e2e

clean:
	rm -rf $(VENV) $(NOBODY_VENV) build dist *.egg-info tests/fakenvml/build cockpit/node_modules cockpit/dist

# --- The Cockpit page (cockpit/README.md) ----------------------------------------------------
# npm ci installs exactly what cockpit/package-lock.json pins; esbuild bundles the page into
# cockpit/dist, which is all that `make install` and the packages install (no node there).
COCKPIT_SOURCES := $(wildcard cockpit/src/*) cockpit/build.mjs

cockpit: cockpit/dist/gpuguard.js

cockpit/node_modules/.installed: cockpit/package.json cockpit/package-lock.json
	cd cockpit && npm ci --no-audit --no-fund --loglevel=error
	touch $@

cockpit/dist/gpuguard.js: cockpit/node_modules/.installed $(COCKPIT_SOURCES)
	cd cockpit && NODE_ENV=production node build.mjs

# --- Man pages, installation, packages (packaging/README.md explains the layout) --------------
VERSION_OF := sed -n 's/^__version__ = "\(.*\)"$$/\1/p'
VERSION := $(shell $(VERSION_OF) gpuguardd/__init__.py)
PREFIX ?= /usr
DESTDIR ?=
BINDIR ?= $(PREFIX)/bin
LIBEXECDIR ?= $(PREFIX)/libexec
DATADIR ?= $(PREFIX)/share
MANDIR ?= $(DATADIR)/man
SYSCONFDIR ?= /etc
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
DBUS_POLICYDIR ?= $(DATADIR)/dbus-1/system.d
DBUS_SERVICEDIR ?= $(DATADIR)/dbus-1/system-services
DBUS_INTERFACEDIR ?= $(DATADIR)/dbus-1/interfaces
POLKIT_ACTIONDIR ?= $(DATADIR)/polkit-1/actions
COMPLETIONDIR ?= $(DATADIR)/bash-completion/completions
COCKPITDIR ?= $(DATADIR)/cockpit/gpuguard
USERUNITDIR ?= $(PREFIX)/lib/systemd/user
EXTENSIONDIR ?= $(DATADIR)/gnome-shell/extensions
GNOME_EXTENSION := gpuguard@gpuguard.org
# Which layout of the GNOME Shell extension installs (gnome-shell-extension/build.py): 43 for
# GNOME 43 and 44, 45 for 45 and later; by default the one for the gnome-shell installed here.
GNOME_SHELL_LAYOUT ?= $(shell v=$$(gnome-shell --version 2>/dev/null | sed -n 's/^GNOME Shell \([0-9]*\).*/\1/p'); \
	if [ -n "$$v" ] && [ "$$v" -lt 45 ]; then echo 43; else echo 45; fi)
# `make install` keeps gpuguard's modules out of the system's site-packages (PEP 668: that
# belongs to the distribution's package manager); its two programs put this first on sys.path.
PYTHONDIR ?= $(PREFIX)/lib/gpuguard/python
# The interpreter of the installed programs: the system's, whose packages provide dbus-fast,
# sdnotify and prometheus_client; never a venv's or pyenv's.
INSTALL_PYTHON ?= /usr/bin/python3
INSTALL ?= install
DIST ?= dist
DIST_ABS = $(abspath $(DIST))
# Package builds see the distribution's tools only (no venv, no pyenv shims first on PATH).
CLEAN_ENV := env -u PYTHONPATH -u VIRTUAL_ENV -u PYENV_VERSION -u PYTHONHOME \
	PATH=/usr/sbin:/usr/bin:/sbin:/bin

MAN_SOURCES := $(wildcard man/*.scd)
MAN_PAGES := $(patsubst man/%.scd,build/man/%,$(MAN_SOURCES))
DBUS_NAME := org.gpuguard.GpuGuard1

man: $(MAN_PAGES)

build/man/%: man/%.scd gpuguardd/__init__.py
	@mkdir -p build/man
	sed 's/@VERSION@/$(VERSION)/g' $< | scdoc > $@.tmp
	mv $@.tmp $@

# $(call entry_point,MODULE,FILE,MODE): one shell command writing a program that runs MODULE's
# main() from PYTHONDIR (MODULE and FILE may be shell variables).
define entry_point
printf '%s\n' '#!$(INSTALL_PYTHON)' \
	'# Installed by make install: the gpuguardd package lives in $(PYTHONDIR).' \
	'import sys' '' 'sys.path.insert(0, "$(PYTHONDIR)")' '' \
	"from $(1) import main" '' 'main()' > $(2).tmp && chmod $(3) $(2).tmp && mv $(2).tmp $(2)
endef

# packaging/files.txt is the one list of the files installed outside the Python package:
# install-python writes its programs, install-data installs the rest, uninstall removes them
# and rpm-files makes the .rpm's %files of it. packaging/files.py fills in these directories.
FILES = $(PYTHON) packaging/files.py $(1) UNITS=$(UNITS) BINDIR=$(BINDIR) LIBEXECDIR=$(LIBEXECDIR) \
	DATADIR=$(DATADIR) MANDIR=$(MANDIR) SYSCONFDIR=$(SYSCONFDIR) UNITDIR=$(UNITDIR) \
	SYSUSERSDIR=$(SYSUSERSDIR) USERUNITDIR=$(USERUNITDIR) DBUS_POLICYDIR=$(DBUS_POLICYDIR) \
	DBUS_SERVICEDIR=$(DBUS_SERVICEDIR) DBUS_INTERFACEDIR=$(DBUS_INTERFACEDIR) \
	POLKIT_ACTIONDIR=$(POLKIT_ACTIONDIR) COMPLETIONDIR=$(COMPLETIONDIR)

install-python:
	$(INSTALL) -d $(DESTDIR)$(PYTHONDIR)
	@# The modules, and the D-Bus interface they are built from (package data, as setup.py builds it).
	find gpuguardd -name '*.py' -exec $(INSTALL) -D -m 644 {} $(DESTDIR)$(PYTHONDIR)/{} \;
	$(INSTALL) -m 644 dbus/$(DBUS_NAME).xml $(DESTDIR)$(PYTHONDIR)/gpuguardd/bus/$(DBUS_NAME).xml
	$(INSTALL_PYTHON) -m compileall -q -d $(PYTHONDIR)/gpuguardd $(DESTDIR)$(PYTHONDIR)/gpuguardd
	@set -e; programs=$$($(call FILES,programs)); \
	printf '%s\n' "$$programs" | while read -r mode module target; do \
		echo "writing $(DESTDIR)$$target (runs $$module)"; \
		$(INSTALL) -d "$(DESTDIR)$${target%/*}"; \
		$(call entry_point,$$module,"$(DESTDIR)$$target",$$mode); \
	done

# The files that call gpuguard's programs by their path (the units, the example drop-ins, the
# Slurm scripts) are templates, FILE.in; packaging/units.py, the one place that knows their
# placeholders, fills them in with this LIBEXECDIR and BINDIR, into build/units. Made afresh
# each time: another make with other directories must not find the last one's.
UNITS := build/units

units:
	rm -rf $(UNITS)
	$(PYTHON) packaging/units.py $(UNITS) BINDIR=$(BINDIR) LIBEXECDIR=$(LIBEXECDIR)

# Everything but the Python code; the .deb and the .rpm use this too (their Python part comes
# from dh-python and %pyproject_install). An existing configuration is the admin's: never
# overwritten.
install-data: man units
	@set -e; files=$$($(call FILES,data)); \
	printf '%s\n' "$$files" | while read -r mode source target flag; do \
		if [ "$$flag" = config ] && [ -e "$(DESTDIR)$$target" ]; then \
			echo "keeping the existing $(DESTDIR)$$target"; continue; \
		fi; \
		$(INSTALL) -d "$(DESTDIR)$${target%/*}"; \
		echo "$(INSTALL) -m $$mode $$source $(DESTDIR)$$target"; \
		$(INSTALL) -m $$mode "$$source" "$(DESTDIR)$$target"; \
	done

# The .rpm's %files for what install-python (the spec: its console scripts) and install-data
# put in, on stdout: the spec's %files -f.
rpm-files:
	@$(call FILES,rpm)

# The built page only: the .deb and the .rpm call this on a copy that has cockpit/dist already.
install-cockpit:
	@test -f cockpit/dist/gpuguard.js || { echo "cockpit/dist is not built: run make cockpit" >&2; exit 1; }
	$(INSTALL) -d $(DESTDIR)$(COCKPITDIR)/assets
	$(INSTALL) -m 644 cockpit/dist/index.html cockpit/dist/manifest.json cockpit/dist/gpuguard.js \
		cockpit/dist/gpuguard.css cockpit/dist/gpuguard.js.LEGAL.txt $(DESTDIR)$(COCKPITDIR)/
	$(INSTALL) -m 644 cockpit/dist/assets/* $(DESTDIR)$(COCKPITDIR)/assets/

# The GNOME Shell extension: both layouts and the zips extensions.gnome.org takes (needs
# gnome-extensions, from gnome-shell), in build/gnome-shell-extension.
gnome-extension:
	python3 gnome-shell-extension/build.py build/gnome-shell-extension --pack

# One layout (GNOME_SHELL_LAYOUT), where GNOME Shell looks for system-wide extensions; the
# .deb and the .rpm use this too.
install-gnome-extension:
	python3 gnome-shell-extension/build.py build/gnome-shell-extension >/dev/null
	$(INSTALL) -d $(DESTDIR)$(EXTENSIONDIR)/$(GNOME_EXTENSION)
	$(INSTALL) -m 644 build/gnome-shell-extension/$(GNOME_SHELL_LAYOUT)/$(GNOME_EXTENSION)/* \
		$(DESTDIR)$(EXTENSIONDIR)/$(GNOME_EXTENSION)/

# The page is (re)built where npm has installed its build tools, or where it is missing: a tree
# that carries the built page and no node_modules (a release tarball) builds and installs
# without node or the npm registry.
PAGE := $(if $(wildcard cockpit/node_modules/.installed),cockpit,$(if $(wildcard cockpit/dist/gpuguard.js),,cockpit))

install: $(PAGE) install-python install-data install-cockpit install-gnome-extension
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "gpuguard $(VERSION) installed; start it with: systemctl enable --now gpuguardd.service"

uninstall:
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
		echo "systemctl disable --now gpuguardd.service"; \
		systemctl disable --now gpuguardd.service 2>/dev/null || true; \
	fi
	@# The unit keeps its runtime directory across restarts (RuntimeDirectoryPreserve=yes):
	@# with the daemon gone for good, nothing in it is left to finish.
	rm -rf $(DESTDIR)/run/gpuguard
	@set -e; files=$$($(call FILES,remove)); \
	for f in $$files; do echo "rm -f $(DESTDIR)$$f"; rm -f "$(DESTDIR)$$f"; done
	@# Directories that are gpuguard's alone go whole: also what an older version put there.
	rm -rf $(DESTDIR)$(PYTHONDIR)/gpuguardd $(DESTDIR)$(DATADIR)/gpuguard $(DESTDIR)$(COCKPITDIR) \
		$(DESTDIR)$(EXTENSIONDIR)/$(GNOME_EXTENSION)
	rmdir $(DESTDIR)$(DATADIR)/cockpit 2>/dev/null || true
	rmdir $(DESTDIR)$(EXTENSIONDIR) $(DESTDIR)$(DATADIR)/gnome-shell 2>/dev/null || true
	rmdir $(DESTDIR)$(PYTHONDIR) $(DESTDIR)$(PREFIX)/lib/gpuguard 2>/dev/null || true
	@# The configuration goes only if it is still the one make install put there.
	@set -e; config=$$($(call FILES,config)); \
	printf '%s\n' "$$config" | while read -r source target; do \
		if [ -e "$(DESTDIR)$$target" ] && cmp -s "$$source" "$(DESTDIR)$$target"; then \
			echo "rm -f $(DESTDIR)$$target"; rm -f "$(DESTDIR)$$target"; \
		elif [ -e "$(DESTDIR)$$target" ]; then echo "keeping the changed $(DESTDIR)$$target"; fi; \
	done
	@# The directories of gpuguard's own the files were in (libexec's gpuguard, ...), once empty.
	@set -e; dirs=$$($(call FILES,dirs)); \
	for d in $$dirs; do rmdir "$(DESTDIR)$$d" 2>/dev/null || true; done
	@# The sweep history stays, as `apt-get remove` keeps it; PURGE=yes removes it too.
	@if [ "$(PURGE)" = yes ]; then echo "rm -rf $(DESTDIR)/var/lib/gpuguard"; rm -rf $(DESTDIR)/var/lib/gpuguard; \
	elif [ -d $(DESTDIR)/var/lib/gpuguard ]; then echo "keeping the sweep history in $(DESTDIR)/var/lib/gpuguard (PURGE=yes removes it)"; fi
	@hooks=$$(grep -l -s '^# Managed by gpuguard' $(DESTDIR)$(SYSCONFDIR)/systemd/system/*.service.d/gpuguard.conf); \
	if [ -n "$$hooks" ]; then echo "hooks left in place (gpuguardctl hook remove before uninstalling):" $$hooks; fi
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi

# This directory is a git checkout's top (not a tarball unpacked somewhere inside another one).
IN_CHECKOUT := $(shell [ "$$(git rev-parse --show-toplevel 2>/dev/null)" = "$(CURDIR)" ] && echo yes)

# The source tree as a package build sees it, with the built Cockpit page: in a checkout what
# git tracks or would track (new files too, ignored ones not); elsewhere (an unpacked release
# tarball) every file and link but the usual build products.
# $(call stage_source,DIR)
define stage_source
	rm -rf $(1) && mkdir -p $(1)
	if [ -n "$(IN_CHECKOUT)" ]; then \
		git ls-files -z --cached --others --exclude-standard; \
	else \
		find . \( -path ./.git -o -path ./.venv -o -path ./.venv-nobody -o -path ./build -o -path ./dist \
			-o -path ./cockpit/node_modules -o -path ./cockpit/dist -o -path ./tests/fakenvml/build \
			-o -name '*.egg-info' -o -name __pycache__ -o -name '.*_cache' \) -prune \
			-o \( -type f -o -type l \) -print0; \
	fi | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C $(1)
	cp -r cockpit/dist $(1)/cockpit/dist
endef

# The release tarball, what a distribution downloads: gpuguard-<version>/ with the built
# Cockpit page (so that a package builds without node or the network). In a checkout the tree
# of DIST_REF (git archive; DIST_REF=worktree: the working tree, as `make deb` sees it); in an
# unpacked tarball, the tree itself.
DIST_REF ?= HEAD
# The commit to pack with git archive (empty: pack with stage_source), and its version.
DIST_FROM_GIT := $(if $(IN_CHECKOUT),$(filter-out worktree,$(DIST_REF)))
DIST_VERSION := $(if $(DIST_FROM_GIT),$(shell git show $(DIST_FROM_GIT):gpuguardd/__init__.py 2>/dev/null | $(VERSION_OF)),$(VERSION))
DIST_STAGE = $(DIST_ABS)/dist-build/gpuguard-$(DIST_VERSION)

dist: $(PAGE)
	@test -n "$(DIST_VERSION)" || { echo "make dist: no __version__ in gpuguardd/__init__.py of $(DIST_REF)" >&2; exit 1; }
ifneq ($(DIST_FROM_GIT),)
	@if [ "$(DIST_FROM_GIT)" = HEAD ] && [ -n "$$(git status --porcelain --untracked-files=no)" ]; then \
		echo "make dist: packing HEAD; the uncommitted changes are not in the tarball" >&2; \
	fi
	rm -rf $(DIST_STAGE) && mkdir -p $(DIST_STAGE)
	git archive --format=tar $(DIST_FROM_GIT) | tar -xf - -C $(DIST_STAGE)
	cp -r cockpit/dist $(DIST_STAGE)/cockpit/dist
else
	$(call stage_source,$(DIST_STAGE))
endif
	tar --sort=name --owner=0 --group=0 --numeric-owner -C $(DIST_ABS)/dist-build -cf - gpuguard-$(DIST_VERSION) \
		| gzip -n > $(DIST_ABS)/gpuguard-$(DIST_VERSION).tar.gz.tmp
	mv $(DIST_ABS)/gpuguard-$(DIST_VERSION).tar.gz.tmp $(DIST_ABS)/gpuguard-$(DIST_VERSION).tar.gz
	rm -rf $(DIST_ABS)/dist-build
	@echo "built $(DIST)/gpuguard-$(DIST_VERSION).tar.gz"

DEB_SRC = $(DIST_ABS)/deb-build/gpuguard-$(VERSION)

# dpkg-buildpackage -us -uc -b on a copy with debian/ at its top; packaging/README.md.
deb: $(PAGE)
	$(call stage_source,$(DEB_SRC))
	cp -r packaging/debian $(DEB_SRC)/debian
	@# The package's version is gpuguardd.__version__: a version the changelog does not have
	@# yet gets an entry of its own in the copy.
	@cl=$(DEB_SRC)/debian/changelog; \
	if [ "$$(dpkg-parsechangelog -l $$cl -S Version)" != "$(VERSION)" ]; then \
		{ printf 'gpuguard (%s) unstable; urgency=medium\n\n  * New upstream version %s.\n\n -- %s  %s\n\n' \
			"$(VERSION)" "$(VERSION)" "$$(dpkg-parsechangelog -l $$cl -S Maintainer)" "$$(date -R)"; \
			cat $$cl; } > $$cl.new && mv $$cl.new $$cl; \
	fi
	cd $(DEB_SRC) && $(CLEAN_ENV) dpkg-buildpackage -us -uc -b
	mkdir -p $(DIST_ABS)
	cp $(DIST_ABS)/deb-build/gpuguard_$(VERSION)_all.deb \
		$(DIST_ABS)/deb-build/cockpit-gpuguard_$(VERSION)_all.deb \
		$(DIST_ABS)/deb-build/gnome-shell-extension-gpuguard_$(VERSION)_all.deb $(DIST_ABS)/
	# TMPDIR: lintian leaves its mldbm-elf-* caches behind; keep them in the build tree.
	$(CLEAN_ENV) TMPDIR=$(DIST_ABS)/deb-build lintian --fail-on error \
		$(DIST_ABS)/deb-build/gpuguard_$(VERSION)_*.changes
	@echo "built $(DIST)/gpuguard_$(VERSION)_all.deb $(DIST)/cockpit-gpuguard_$(VERSION)_all.deb"

RPM_TOP = $(DIST_ABS)/rpm-build

# rpmbuild -bb; on a distribution without Fedora's Python and systemd RPM macros (Debian),
# packaging/rpm/macros.fallback stands in for them and --nodeps skips the BuildRequires, which
# rpm's empty database there cannot know.
rpm: $(PAGE)
	rm -rf $(RPM_TOP) && mkdir -p $(RPM_TOP)/SOURCES
	$(call stage_source,$(RPM_TOP)/src/gpuguard-$(VERSION))
	tar -czf $(RPM_TOP)/SOURCES/gpuguard-$(VERSION).tar.gz -C $(RPM_TOP)/src gpuguard-$(VERSION)
	set -e; extra=; \
	if [ -z "$$(rpm --eval '%{?pyproject_wheel}')" ]; then extra="--load=$(CURDIR)/packaging/rpm/macros.fallback"; fi; \
	if ! rpm -q rpm >/dev/null 2>&1; then extra="$$extra --nodeps"; fi; \
	echo "rpmbuild -bb $$extra"; \
	$(CLEAN_ENV) rpmbuild -bb $$extra --define "_topdir $(RPM_TOP)" \
		--define "gpuguard_version $(VERSION)" packaging/rpm/gpuguard.spec
	mkdir -p $(DIST_ABS)
	cp $(RPM_TOP)/RPMS/noarch/gpuguard-$(VERSION)-*.noarch.rpm \
		$(RPM_TOP)/RPMS/noarch/cockpit-gpuguard-$(VERSION)-*.noarch.rpm \
		$(RPM_TOP)/RPMS/noarch/gnome-shell-extension-gpuguard-$(VERSION)-*.noarch.rpm $(DIST_ABS)/
	@echo "built" $(DIST)/gpuguard-$(VERSION)-*.noarch.rpm $(DIST)/cockpit-gpuguard-$(VERSION)-*.noarch.rpm
