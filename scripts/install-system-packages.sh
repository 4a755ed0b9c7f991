#!/usr/bin/env bash
# Install every Debian package listed in system-packages.txt that is missing.
# Idempotent and quick when everything is there (one dpkg-query).
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t wanted < <(grep -v '^\s*#' system-packages.txt | sed 's/\s*#.*//' | awk 'NF && $2 != "@backports" {print $1}')
# "name @backports": wanted from <codename>-backports (e.g. runsc: the stable one is too old)
mapfile -t wanted_backports < <(grep -v '^\s*#' system-packages.txt | sed 's/\s*#.*//' | awk '$2 == "@backports" {print $1}')
missing=()
for pkg in "${wanted[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$pkg")
done
missing_backports=()
for pkg in "${wanted_backports[@]}"; do
  version=$(dpkg-query -W -f='${db:Status-Status} ${Version}' "$pkg" 2>/dev/null || true)
  [[ "$version" == installed*bpo* ]] || missing_backports+=("$pkg")
done
if [ ${#missing[@]} -eq 0 ] && [ ${#missing_backports[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${missing[*]} ${missing_backports[*]} (run as root: make install)" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]} ${missing_backports[*]}"
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing_backports[@]} -gt 0 ]; then
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  sources=/etc/apt/sources.list.d/corral-${codename}-backports.sources
  if [ -n "$codename" ] && [ ! -e "$sources" ]; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: %s-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$codename" > "$sources"
  fi
fi
apt-get -o DPkg::Lock::Timeout=300 update -q
if [ ${#missing[@]} -gt 0 ]; then
  apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing[@]}"
fi
if [ ${#missing_backports[@]} -gt 0 ]; then
  echo "installing from ${codename}-backports: ${missing_backports[*]}"
  apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends -t "${codename}-backports" \
    "${missing_backports[@]}" \
    || apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${missing_backports[@]}"
fi
