#!/usr/bin/env bash
# Builds device_payload/ (git-ignored; travels with the device tool's carry=["device_payload"]):
#   device_payload/shared/models/stories260K/  the llama2.c model, tokenizers, greedy_reference.json
#   device_payload/wheels/                     pytest and its pure-Python dependencies (offline install
#                                              on the device if pytest is missing there)
# Usage: bash scripts/prepare_device_payload.sh   (JAXINFER_SHARED: the shared/ folder, default ../shared)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED="${JAXINFER_SHARED:-$(cd .. && pwd)/shared}"
SRC="$SHARED/models/stories260K"
DST=device_payload/shared/models/stories260K
for f in stories260K.bin tok512.model tok512.bin greedy_reference.json README.md; do
  [ -f "$SRC/$f" ] || { echo "missing $SRC/$f (set JAXINFER_SHARED)" >&2; exit 1; }
done
rm -rf "$DST" && mkdir -p "$DST" device_payload/wheels
cp "$SRC"/{stories260K.bin,tok512.model,tok512.bin,greedy_reference.json,README.md} "$DST/"
PY="${PYTHON:-python}"
"$PY" -m pip download -q --only-binary=:all: -d device_payload/wheels \
  "pytest>=8" || echo "pip download failed: no pytest wheels" >&2
du -sh device_payload
du -sb device_payload | awk '{ if ($1 > 64*1024*1024) { print "device_payload over 64 MiB" > "/dev/stderr"; exit 1 } }'
