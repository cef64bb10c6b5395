#!/usr/bin/env bash
# nodeshare on this machine, no Docker needed: installs into .venv (once, and again when
# pyproject.toml changes), then runs
#   deploy/local.sh demo [options]   the whole pipeline on the bundled broker
#   deploy/local.sh test [pytest args]   the test suite
#   deploy/local.sh <any nodeshare command>
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${NODESHARE_VENV:-$root/.venv}
python=${PYTHON:-python3}

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "nodeshare needs Python 3.11 or newer; '$python' is $("$python" --version 2>&1 || echo missing)." >&2
  echo "Set PYTHON=/path/to/python3.11 and try again." >&2
  exit 2
fi

if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  if ! "$python" -m venv "$venv" 2>/dev/null; then
    # Debian and Ubuntu ship venv separately.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing python3-venv with apt-get" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$venv"
      "$python" -m venv "$venv"
    else
      echo "'$python -m venv' failed: install your distribution's python3-venv package." >&2
      exit 2
    fi
  fi
fi

cmd=${1:-demo}
extra=""
[ "$cmd" = test ] && extra="[test]"
stamp="$venv/.nodeshare-installed$extra"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  echo "installing nodeshare$extra into $venv (first run takes a minute)" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/python" -m pip install -qq --disable-pip-version-check -e "$root$extra"
  touch "$stamp"
fi

# install_once COMMAND WHAT PACKAGES...: install Debian packages for a test unless COMMAND is there
# (needs root and apt-get; otherwise, or if apt-get fails, the test that needs them is skipped).
install_once() {
  local have="$1" what="$2"
  shift 2
  command -v "$have" >/dev/null && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "$have is not installed and cannot be (needs root and apt-get): the $what will be skipped" >&2
    return 0
  fi
  echo "installing $* from Debian for the $what" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1
  } || echo "apt-get could not install $*: the $what will be skipped" >&2
}

case "$cmd" in
  test)
    shift
    cd "$root"
    # a real Slurm (Debian 12: 22.05); npm for s3rver, the durable broker's storage (deploy/local_s3.py)
    install_once slurmctld "Slurm integration tests" slurmctld slurmd munge slurm-client
    install_once npm "durable-broker tests" npm
    install_once slurmdbd "Slurm accounting test (slurmdbd on MariaDB: sacct, sacctmgr)" slurmdbd mariadb-server
    # nodes made of network namespaces (deploy/netns.py): ip; unshare and nsenter come with util-linux
    install_once ip "network-namespace node tests" iproute2
    exec "$venv/bin/python" -m pytest "$@"
    ;;
  demo)
    shift || true
    exec "$venv/bin/nodeshare" demo "$@"
    ;;
  *)
    exec "$venv/bin/nodeshare" "$@"
    ;;
esac
