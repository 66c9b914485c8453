#!/bin/sh
# Build NVIDIA's CDI tools (nvidia-ctk and nvidia-cdi-hook) and their runtime handler
# (nvidia-container-runtime) from NVIDIA's public sources, in a scratch directory OUTSIDE this
# repository (nothing of theirs enters it), for the side-by-side tests and benches of
# docs/cdi-hook.md and docs/nri.md:
#
#   bench/build_reference_cdi.sh SCRATCH TOOLKIT_GIT [TAG...]   (default: v1.17.0 v1.18.0 v1.20.0)
#
#   SCRATCH      a directory outside the repo; gets go/ (Debian's Go, unpacked with dpkg -x,
#                never installed), src-TAG/ (NVIDIA's sources at TAG) and TAG/nvidia-ctk,
#                TAG/nvidia-cdi-hook, TAG/nvidia-container-runtime
#   TOOLKIT_GIT  a git dir (or checkout) of github.com/NVIDIA/nvidia-container-toolkit holding TAG
#
# Go: each tag is built with the Go its go.mod asks for. Up to 1.18.0 that is <= 1.24: Go 1.24
# from Debian 13 (trixie). 1.18.1 and later want 1.25, which only Debian unstable (sid) has:
# Go 1.26 from there. The .debs come with `apt-get download` against a private sources list and
# lists directory, from the Debian mirror this machine's own apt sources name (no host is written
# here); where the machine names none the script stops in one line. NVIDIA's repository vendors its
# modules (GOFLAGS=-mod=vendor), so the build itself needs no network.
# The tests find the result through NVHOOK_REFERENCE_CDI=SCRATCH (tests/test_cdihook_nvidia.py,
# tests/test_cdihook_nvidia120.py), and so does bench/nri_pod_start.py.
set -eu
[ $# -ge 2 ] || { sed -n '2,21p' "$0"; exit 2; }
mkdir -p "$1"
S=$(realpath "$1")
TOOLKIT_ARG=$2
TOOLKIT_GIT=$2
shift 2
TAGS=${*:-v1.17.0 v1.18.0 v1.20.0}
git --git-dir="$TOOLKIT_GIT" rev-parse --git-dir >/dev/null 2>&1 \
    || TOOLKIT_GIT=$(git -C "$TOOLKIT_GIT" rev-parse --absolute-git-dir 2>/dev/null) \
    || { echo "build_reference_cdi: $TOOLKIT_ARG is not a git dir of NVIDIA's nvidia-container-toolkit" >&2; exit 2; }

# The machine's Debian mirror: the first URI of a deb source (deb822 .sources or one-line .list)
# whose path ends in /debian, so the security and updates archives are not taken for it.
debian_mirror() {
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] && sed -n 's/^deb\(\s\+\[[^]]*\]\)\?\s\+\(\S*\/debian\)\/\?\s.*/\2/p' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] && sed -n 's/^URIs:\s*\(\S*\/debian\)\/\?\s*$/\1/p' "$f"
    done
}
MIRROR=$(debian_mirror | head -1)
[ -n "$MIRROR" ] || { echo "build_reference_cdi: no Debian mirror in /etc/apt/sources.list{,.d/*}; add one (a URI ending in /debian)" >&2; exit 1; }

# fetch_go VERSION SUITE: Debian's golang-VERSION from SUITE into $S/go/root, once.
fetch_go() {
    [ -x "$S/go/root/usr/lib/go-$1/bin/go" ] && return 0
    d="$S/go/$2"
    mkdir -p "$d/apt/lists/partial" "$d/apt/cache/archives/partial"
    echo "deb [trusted=yes] $MIRROR $2 main" > "$d/sources.list"
    APT="-o Dir::Etc::SourceList=$d/sources.list -o Dir::Etc::SourceParts=/dev/null \
         -o Dir::State::Lists=$d/apt/lists -o Dir::Cache=$d/apt/cache"
    # shellcheck disable=SC2086
    apt-get $APT update
    # shellcheck disable=SC2086
    (cd "$d" && apt-get $APT download "golang-$1-go" "golang-$1-src")
    for deb in "$d"/golang-"$1"-*.deb; do dpkg -x "$deb" "$S/go/root"; done
}

for tag in $TAGS; do
    src="$S/src-$tag"
    if [ ! -d "$src" ]; then
        mkdir -p "$src"
        git --git-dir="$TOOLKIT_GIT" archive "$tag" | tar -x -C "$src"
    fi
    want=$(sed -n 's/^go 1\.\([0-9]*\).*/\1/p' "$src/go.mod")
    if [ "${want:-0}" -le 24 ]; then gov=1.24 suite=trixie; else gov=1.26 suite=sid; fi
    fetch_go "$gov" "$suite"
    GO="$S/go/root/usr/lib/go-$gov/bin/go"
    mkdir -p "$S/$tag"
    for cmd in nvidia-ctk nvidia-cdi-hook nvidia-container-runtime; do
        (cd "$src" && GOTOOLCHAIN=local GOFLAGS=-mod=vendor GOCACHE="$S/go/cache-$gov" \
            "$GO" build -ldflags "-s -w -X github.com/NVIDIA/nvidia-container-toolkit/internal/info.version=${tag#v}" \
            -o "$S/$tag/$cmd" "./cmd/$cmd")
    done
    "$S/$tag/nvidia-ctk" --version | head -1
done
