#!/usr/bin/env bash
# The Debian 12 packages gpuguard's tests, builds and demo drive for real: `make deps` (and so
# `make test`, `make demo`, CI) runs this, and so can a newcomer, as root or not. Installed only
# where missing, so a developer machine that has them is not touched, and root is needed only
# when something is missing.
#
#   packaging/deps.sh            install what is missing (as root; without root: list it, fail)
#   packaging/deps.sh --dry-run  print the apt-get commands it would run, install nothing
set -euo pipefail

# Debian packages the suite drives for real (dbus-daemon, busctl, gdbus, fuser, lsof, gcc for
# the fake NVML library, systemd-nspawn, polkit).
PACKAGES=(python3 python3-venv python3-dev gcc make psmisc lsof dbus-daemon dbus-bin
	libglib2.0-bin libxml2-utils systemd-container polkitd pkexec)
# The D-Bus service tests drive busctl (systemd), setpriv (util-linux) and dbus-send (dbus-bin).
PACKAGES+=(systemd util-linux)
# Packaging and docs (make man, deb, rpm and their tests): scdoc for the man pages, Debian's
# build tool chain, rpmbuild, bash-completion; the runtime dependencies from Debian so that the
# .deb installs without a download (the e2e container has no network) and `make install`'s
# programs run on the system Python.
PACKAGES+=(scdoc man-db dpkg-dev debhelper dh-python pybuild-plugin-pyproject python3-all
	python3-setuptools python3-wheel python3-build python3-installer lintian rpm bash-completion
	python3-dbus-fast python3-sdnotify)
# The Cockpit page (cockpit/, make cockpit): node to build it with esbuild from the npm packages
# its lockfile pins; its browser tests run Debian's cockpit-ws/cockpit-bridge and headless
# chromium (fonts for its screenshots). npm itself: see the end.
PACKAGES+=(nodejs cockpit-ws cockpit-bridge chromium fonts-liberation)
# Fleet: Prometheus metrics (the client library, the real node_exporter and Prometheus
# servers the tests scrape with, promtool) and the real Slurm the epilog is tested against.
PACKAGES+=(python3-prometheus-client prometheus prometheus-node-exporter slurmctld slurmd munge)
# The desktop (docs/desktop.md): GNOME Shell 43 headless for the extension's tests
# (gnome-extensions packs the zips, imagemagick crops the screenshots), the gjs interpreter
# that runs the extension's logic outside the shell (only a recommendation of gnome-shell,
# which depends on the library alone), dunst on Xvfb for gpuguard-notify's. Installed
# without recommends: with them gnome-shell brings gdm3 and a whole desktop (1.2 GB instead
# of 400 MB).
NO_RECOMMENDS=(gnome-shell gjs xvfb imagemagick dunst)

dry_run=
case "${1-}" in
	"") ;;
	--dry-run) dry_run=yes ;;
	*) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

# The packages among the arguments that dpkg does not have installed, one per line.
missing() {
	local p
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || echo "$p"
	done
}

updated=
# apt_install OPTIONS... -- PACKAGES...: apt-get install the packages, after one apt-get update.
apt_install() {
	local options=()
	while [ "$1" != -- ]; do options+=("$1"); shift; done
	shift
	local command=(apt-get install -y -qq "${options[@]}" "$@")
	echo "installing: $* ${options[*]}"
	if [ -n "$dry_run" ]; then
		echo "${command[*]}"
		return
	fi
	if [ "$(id -u)" != 0 ]; then
		echo "run as root to install: $*" >&2
		exit 1
	fi
	if [ -z "$updated" ]; then
		apt-get update -qq
		updated=yes
	fi
	DEBIAN_FRONTEND=noninteractive "${command[@]}" >/dev/null
}

mapfile -t lacking < <(missing "${NO_RECOMMENDS[@]}")
if [ ${#lacking[@]} -gt 0 ]; then apt_install --no-install-recommends -- "${lacking[@]}"; fi
mapfile -t lacking < <(missing "${PACKAGES[@]}")
if [ ${#lacking[@]} -gt 0 ]; then apt_install -- "${lacking[@]}"; fi
# npm: Debian's package, unless the nodejs installed bundles its own (NodeSource's does).
if ! command -v npm >/dev/null; then apt_install -- npm; fi
