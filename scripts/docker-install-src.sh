#!/bin/sh
# The images' last install step (Dockerfile: `RUN install-src`): pip-installs /src, the source,
# without dependencies (earlier layers hold them), compiling prompt analysis's C extension
# (gateway/analysis/_native.c, setup.py) with a C compiler and the Python headers installed for
# this step only, then checks the extension imports and removes the compiler and /src.
set -eu
inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
dev="gcc libc6-dev"
[ -e "$inc/Python.h" ] || dev="$dev python3-dev"  # Debian's python3 (compose-check's base image)
apt-get update
# shellcheck disable=SC2086
apt-get install -y --no-install-recommends $dev
pip-install --no-deps /src
# shellcheck disable=SC2086
apt-get purge -y --auto-remove $dev
rm -rf /var/lib/apt/lists/* /src
cd / && python3 -c 'import gateway.analysis._native'
