#!/bin/sh
# Build NVIDIA's CDI tools (nvidia-ctk and nvidia-cdi-hook) and their runtime handler
# (nvidia-container-runtime) from NVIDIA's public sources, in a scratch directory OUTSIDE this
# repository (nothing of theirs enters it), for the side-by-side tests and benches of
# docs/cdi-hook.md and docs/nri.md:
#
#   bench/build_reference_cdi.sh SCRATCH [TAG...]      (default tags: v1.17.0 v1.18.0)
#
#   SCRATCH   a directory outside the repo; gets go/ (Debian 13's Go 1.24, unpacked with
#             dpkg -x, never installed), src-TAG/ (NVIDIA's sources at TAG, from a git
#             checkout given as $TOOLKIT_GIT, default: the fetch tool's mirror) and
#             TAG/nvidia-ctk, TAG/nvidia-cdi-hook, TAG/nvidia-container-runtime
#
# Go: Debian 12's golang is too old for the toolkit (1.17 wants >= 1.22, 1.18.0 wants 1.24;
# 1.18.1 and later want 1.25, which Debian 13 does not have). The .debs come from trixie with
# `apt-get download` against a private sources list and lists directory. NVIDIA's repository
# vendors its modules (GOFLAGS=-mod=vendor), so the build needs no network.
# The tests find the result through NVHOOK_REFERENCE_CDI=SCRATCH (tests/test_cdihook_nvidia.py),
# and so does bench/nri_pod_start.py (NVIDIA's runtime handler on the private node).
set -eu
[ $# -ge 1 ] || { sed -n '2,19p' "$0"; exit 2; }
mkdir -p "$1"
S=$(realpath "$1")
shift
TAGS=${*:-v1.17.0 v1.18.0}
TOOLKIT_GIT=${TOOLKIT_GIT:-/work/.mirror/NVIDIA+nvidia-container-toolkit/repo}

GO="$S/go/root/usr/lib/go-1.24/bin/go"
if [ ! -x "$GO" ]; then
    mkdir -p "$S/go/apt/lists/partial" "$S/go/apt/cache/archives/partial"
    echo 'deb [trusted=yes] http://deb.debian.org/debian trixie main' > "$S/go/trixie.list"
    APT="-o Dir::Etc::SourceList=$S/go/trixie.list -o Dir::Etc::SourceParts=/dev/null \
         -o Dir::State::Lists=$S/go/apt/lists -o Dir::Cache=$S/go/apt/cache"
    # shellcheck disable=SC2086
    apt-get $APT update
    # shellcheck disable=SC2086
    (cd "$S/go" && apt-get $APT download golang-1.24-go golang-1.24-src)
    for d in "$S"/go/golang-1.24-*.deb; do dpkg -x "$d" "$S/go/root"; done
fi
export PATH="$(dirname "$GO"):$PATH" GOTOOLCHAIN=local GOFLAGS=-mod=vendor GOCACHE="$S/go/cache"

for tag in $TAGS; do
    src="$S/src-$tag"
    if [ ! -d "$src" ]; then
        mkdir -p "$src"
        git --git-dir="$TOOLKIT_GIT" archive "$tag" | tar -x -C "$src"
    fi
    mkdir -p "$S/$tag"
    for cmd in nvidia-ctk nvidia-cdi-hook nvidia-container-runtime; do
        (cd "$src" && go build -ldflags "-s -w -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${tag#v}" \
            -o "$S/$tag/$cmd" "./cmd/$cmd")
    done
    "$S/$tag/nvidia-ctk" --version | head -1
done
