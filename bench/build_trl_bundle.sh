#!/usr/bin/env bash
# TRL for an offline GPU host, as wheels: what bench/trl_gpu_compare.py needs there beside what the
# host has (Python 3.12, torch 2.11, transformers, accelerate, pandas, pyarrow, and vLLM 0.25.1
# from ../shared/gpu/build-bundle). The host has no package index and takes files only in
# transfers of at most 64 MiB, so the wheels travel as one tar cut into parts of at most 60 MiB,
# one part per folder, with an unpack script in the first.
#
#   bench/build_trl_bundle.sh [DEST]       (DEST, default .gpu/trl: a folder git ignores)
#
# Result: DEST/p1/{part.aa, unpack_trl.sh}, DEST/p2/part.ab, ... (one folder today: about 2 MiB).
# Ship each DEST/pN to the same machine (carry it), copy it to /tmp/trl-parts/pN there, then:
#
#   source /tmp/trl-parts/p1/unpack_trl.sh /tmp/trl-parts/p*
#
# which installs the wheels into /tmp/trl-site and puts it on PYTHONPATH.
#
# Versions: TRL 1.16.0, the newest release, supports vLLM >=0.22,<=0.31 (its `vllm` extra), so
# the host's 0.25.1 is in range. Its own needs that such a host lacks: datasets, and datasets'
# dill and multiprocess. datasets 4.7.0 is TRL's lowest supported release and asks least of the
# host (pyarrow >= 21; 5.x wants pyarrow >= 24); dill and multiprocess are the versions it pins.
set -euo pipefail
DEST=$(realpath -m "${1:-.gpu/trl}")
WORK=${TMPDIR:-/tmp}/trl-bundle-work
PACKAGES=(trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
    PLAT+=(--platform "$p")
done
rm -rf "$WORK" "$DEST"
mkdir -p "$WORK/wheels" "$DEST"
echo "downloading ${PACKAGES[*]}"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/wheels" "${PACKAGES[@]}"
[ "$(ls "$WORK"/wheels/*.whl | wc -l)" -eq ${#PACKAGES[@]} ] || { echo "expected ${#PACKAGES[@]} wheels" >&2; exit 1; }
tar -C "$WORK" -cf "$WORK/trl-wheels.tar" wheels
split -b 60M "$WORK/trl-wheels.tar" "$WORK/part."
i=0
for part in "$WORK"/part.*; do
    i=$((i + 1))
    mkdir -p "$DEST/p$i"
    mv "$part" "$DEST/p$i/"
done
cat > "$DEST/p1/unpack_trl.sh" <<'EOF'
# Source it on the GPU host with every part's folder, in order:
#   source /tmp/trl-parts/p1/unpack_trl.sh /tmp/trl-parts/p*
# Installs TRL and the wheels beside it into /tmp/trl-site (no index, no dependency resolution:
# the rest is the host's) and puts that folder on PYTHONPATH.
if [ ! -d /tmp/trl-site/trl ]; then
    rm -rf /tmp/trl-unpack && mkdir -p /tmp/trl-unpack
    for d in "$@"; do cat "$d"/part.*; done | tar -x -C /tmp/trl-unpack
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/trl-site /tmp/trl-unpack/wheels/*.whl \
        || echo "TRL UNPACK FAILED" >&2
fi
export PYTHONPATH=/tmp/trl-site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import trl, datasets, transformers, accelerate, pyarrow; print('trl', trl.__version__, 'datasets', datasets.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'pyarrow', pyarrow.__version__)"
EOF
du -sh "$DEST"/p*
