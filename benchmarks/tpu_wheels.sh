#!/usr/bin/env bash
# Fills DIR (default .whl-tpu, ignored by git) with the wheels of requirements.txt that a TPU VM image with JAX
# lacks, for Python 3.11 on x86-64: all but JAX, jaxlib, libtpu, numpy and scipy (the image's), tensorstore and
# h5py (tpu_check.sh installs them from the image's own package index), matplotlib's stack, the datasets
# stack and the test tools (nothing tpu_check.sh runs imports them). ~30 MB, so it travels with the repository.
#   bash benchmarks/tpu_wheels.sh .whl-tpu     # here, with network; then carry .whl-tpu to the chip
set -euo pipefail
dir=${1:-.whl-tpu}
mkdir -p "$dir"
skip='^(jax|jaxlib|libtpu|numpy|scipy|tensorstore|h5py|pandas|pyarrow|pillow|matplotlib|contourpy|kiwisolver|cycler|fonttools|pyparsing|datasets|pytest|pytest-xdist|pytest-timeout|execnet|iniconfig|pluggy|ruff)=='
grep -E '^[A-Za-z]' requirements.txt | sed 's/ *#.*//' | grep -viE "$skip" > "$dir/requirements-tpu.txt"
platforms=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${p}_x86_64"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp $platforms \
  -d "$dir" -r "$dir/requirements-tpu.txt" 2>&1 | grep -v "^WARNING: Location" || true
echo "$(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
